"""The CPU backend: fp8kv's own decoder layers and linear kernels, memory tuning, and the model dtype choice."""
