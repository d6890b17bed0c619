"""Quality of an FP8 cache: `fp8kv calibrate` (scales measured on the unquantized model) and `fp8kv eval`
(perplexity and KL of the FP8 cache against the model-dtype cache, on real text)."""
