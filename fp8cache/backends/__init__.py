"""What runs differently on each kind of device: `cpu` (fused layers, packed linears, memory tuning, the model
dtype choice) and `cuda` (CUDA graphs, the deferred kernel-error flag)."""
