"""The ground floor: what this machine and process are. Which device runs the engine and which model dtype
`--dtype auto` means there, the CPU's features, huge pages and malloc tuning, where fp8kv keeps its files and
which environment names it reads, durable writes, and the log format. Nothing here imports the rest of fp8kv."""
