"""The CPU's model code: packed linear layers (fp8kv's panels or oneDNN's layout), the whole-layer decode op, and the
measurement behind `--dtype auto` on a CPU."""
