"""Tensor parallelism over torch.distributed: process groups and collectives (parallel_state), the step
channel from rank 0 to the workers (worker), rank processes (processes, group) and the Megatron-style split of
a loaded model (sharding). Model code uses this package, not the reverse: fp8cache/model/tp_ranks.py hands it
the runners each rank builds."""
