"""Which device the engine runs on, and what that device's defaults are.

`auto` (the default everywhere) is the first GPU torch can use (CUDA, or ROCm, which torch also calls
"cuda"), else the CPU. Every device but the CPU takes the GPU code paths: "meta" stands in for a GPU in
tests that run the engine under torch's FakeTensorMode (CUDA's device rules, no data).
"""

from __future__ import annotations

import torch

AUTO = "auto"
CHOICES_HELP = "auto (the first GPU if torch sees one, else the CPU), cpu, cuda or cuda:N"


class DeviceError(ValueError):
    """A device the user asked for that this machine cannot give."""


def resolve_device(name: str | torch.device | None) -> torch.device:
    """The torch.device behind a --device value; raises DeviceError naming the fix."""
    if name is None or (isinstance(name, str) and name.strip().lower() in ("", AUTO)):
        return torch.device("cuda", 0) if gpu_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"--device {name!r} is not a device; use {CHOICES_HELP}") from exc
    if device.type in ("cpu", "meta"):
        return device
    if device.type != "cuda":
        raise DeviceError(f"--device {name!r}: fp8kv runs on {CHOICES_HELP}")
    if not gpu_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None and torch.version.hip is None \
            else "no usable GPU or driver"
        raise DeviceError(f"--device {name!r}: torch sees no GPU here ({build}); use --device cpu or auto")
    count = torch.cuda.device_count()
    index = 0 if device.index is None else device.index
    if index >= count:
        raise DeviceError(f"--device {name!r}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)


def gpu_available() -> bool:
    """Whether torch can use a GPU on this machine (CUDA, or ROCm under torch's "cuda" name)."""
    return torch.cuda.is_available()


def is_rocm() -> bool:
    """Whether this torch build drives AMD GPUs (ROCm/HIP) rather than NVIDIA's."""
    return getattr(torch.version, "hip", None) is not None


def kernel_backend(device: torch.device) -> str:
    """The kernel backend that serves `device`: cpu, cuda or rocm (any other device stands in for a GPU)."""
    if device.type == "cpu":
        return "cpu"
    return "rocm" if is_rocm() else "cuda"


def compute_capability(device: torch.device) -> tuple[int, int]:
    """A CUDA GPU's (major, minor) compute capability, e.g. (9, 0) for an H100/H200."""
    return torch.cuda.get_device_capability(device)


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def is_gpu(device: torch.device | str) -> bool:
    """GPU code paths: every device but the CPU (meta included, see the module docstring)."""
    return torch.device(device).type != "cpu"


def describe(device: torch.device) -> str:
    """One line for the startup log: the device, and for a GPU its name and memory."""
    if device.type != "cuda":
        return str(device)
    props = torch.cuda.get_device_properties(device)
    free, total = torch.cuda.mem_get_info(device)
    kind = "ROCm" if torch.version.hip else f"CUDA {torch.version.cuda}"
    return (f"{device} ({props.name}, {total / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free, "
            f"{props.multi_processor_count} SMs, {kind})")
