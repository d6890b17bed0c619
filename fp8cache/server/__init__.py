"""fp8kv's HTTP server: OpenAI- and TGI-compatible routes over the engine, Prometheus metrics."""
