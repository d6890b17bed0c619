"""Tensor parallelism over torch.distributed: process group, model sharding, and the worker loop."""
