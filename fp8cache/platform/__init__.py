"""The ground floor: what this machine and process are. Which device runs the engine and its facts (GPU,
vendor, compute capability), which model dtype `--dtype auto` means there, the CPU's name and features, huge
pages and malloc tuning, where fp8kv keeps its files (paths), every FP8KV_* environment variable (envs), durable
writes, and the log format. Nothing here imports the rest of fp8kv."""
