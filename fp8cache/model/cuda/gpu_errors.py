"""Errors of the GPU ops, read without waiting for the GPU.

Called one by one, each GPU op allocates an error flag and reads it back after its kernels: a full wait for
the GPU per call. A runner instead hands the ops one flag per device (torch.ops.fp8kv.set_gpu_error_flag);
the kernels set bits in it (they never read or write outside the cache, whatever the bits), the flag is
copied to pinned host memory without blocking after each step, and the copy is read once it has landed,
at the start of a later step: the step's own wait for its sampled tokens is the only one.
"""

from __future__ import annotations

import torch

# Bits of the flag (csrc/cuda/launch.h).
_BITS = {1: "a slot_mapping entry past the cache (those tokens were not written)",
         2: "a block table entry outside the cache's blocks (not read)",
         4: "a sequence length past max_seq_len or its block table",
         8: "a window start outside [seq_len - window_size, seq_len]",
         16: "a window block table entry outside the window cache (not read)"}

_by_device: dict[torch.device, KernelErrors] = {}


class KernelErrorFlagged(RuntimeError):
    """A GPU kernel of an earlier step reported bad arguments (it skipped them instead of touching memory)."""


class KernelErrors:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.copied = torch.cuda.Event()
        torch.ops.fp8kv.set_gpu_error_flag(self.flag)

    def after_step(self) -> None:
        """Queue the flag's copy to the host (no wait)."""
        self.host.copy_(self.flag, non_blocking=True)
        self.copied.record()

    def check(self) -> None:
        """Raise what the kernels reported, once its copy has landed (no wait: a copy still on its way is read
        at a later step)."""
        if not self.copied.query():
            return
        bits = int(self.host[0])
        if bits:
            self.flag.zero_()
            self.host.zero_()
            found = "; ".join(text for bit, text in _BITS.items() if bits & bit) or f"error bits {bits}"
            raise KernelErrorFlagged(f"a GPU attention or cache kernel reported bad arguments: {found}")


def for_device(device: torch.device) -> KernelErrors | None:
    """The device's shared flag, None where the ops read errors per call (CPU, stand-in devices, a library
    built without its CUDA sources)."""
    if device.type != "cuda" or not hasattr(torch.ops.fp8kv, "set_gpu_error_flag"):
        return None
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if device not in _by_device:
        with torch.cuda.device(device):
            _by_device[device] = KernelErrors(device)
    return _by_device[device]
