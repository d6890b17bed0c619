"""A stand-in GPU for tests on machines without one: the engine configured for device "meta" (fp8kv takes its
GPU code paths for every device but the CPU) and run under torch's FakeTensorMode, which applies CUDA's
device rules: a CPU tensor meeting a device tensor raises, as it would on a GPU. Nothing holds data.

FakeGpu also stands in for the host's reads of device values and counts what a GPU would wait on: a
`.item()` / `.tolist()` / `bool()` of a device tensor and a blocking device-to-host copy are host syncs, a
host-to-device copy is counted with its non_blocking flag, and every op with a device tensor among its
inputs or outputs is counted by name (views and allocations excepted: they launch no kernel).
"""

from __future__ import annotations

import collections
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that launch no kernel on a GPU.
NO_KERNEL = {"view", "_unsafe_view", "as_strided", "slice", "select", "unsqueeze", "squeeze", "t", "transpose",
             "permute", "expand", "alias", "detach", "empty", "empty_strided", "_reshape_alias", "reshape", "split",
             "split_with_sizes", "unbind", "narrow", "lift_fresh", "empty_like", "new_empty", "view_as", "device",
             "_to_copy_no_data", "is_pinned", "_pin_memory"}


_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.item.default}


def _on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


class DeviceWork(TorchDispatchMode):
    """Counts syncs, host-to-device copies and device ops (see the module docstring); answers reads of
    device values with zeros (the stand-in device holds no data)."""

    def __init__(self) -> None:
        super().__init__()
        self.reset()

    def reset(self) -> None:
        self.syncs = 0
        self.h2d: list[bool] = []  # non_blocking of each host-to-device copy
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS:  # a read of a value; host tensors hold no data here either
            if _on_device(args[0]):
                self.syncs += 1
            dtype = args[0].dtype
            if func is torch.ops.aten.is_nonzero.default or dtype == torch.bool:
                return False
            return 0.0 if dtype.is_floating_point else 0
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in ("_to_copy", "copy_"):
            src, dst = (args[1], args[0]) if name == "copy_" else (args[0], out)
            non_blocking = bool(kwargs.get("non_blocking", False) or (name == "copy_" and len(args) > 2 and args[2]))
            if _on_device(src) and not _on_device(dst) and not non_blocking:
                self.syncs += 1
            if not _on_device(src) and _on_device(dst):
                self.h2d.append(non_blocking)
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if name not in NO_KERNEL and any(_on_device(t) for t in (*outs, *args)):
            self.ops[name] += 1
        return out

    def device_ops(self) -> int:
        return sum(self.ops.values())


@contextmanager
def fake_gpu():
    """with fake_gpu() as work: ... runs on device "meta" with CUDA's device rules; `work` counts (DeviceWork)."""
    from fp8cache import ops

    ops.load()  # the fp8kv ops (on a GPU machine the GPU build: one library per process) and their fake kernels
    previous = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)  # model.to("meta") makes fake parameters
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), DeviceWork() as work:
            yield work
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(previous)
        # Tensors cached while the mode was on are fake ones; a later test on the real CPU must not be handed them.
        from fp8cache.kvcache import rotation

        rotation._hadamard.cache_clear()
