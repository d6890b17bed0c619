"""What a benchmark says about the machine it ran on: CPU model, threads, measured read bandwidth."""

from __future__ import annotations

import statistics
import time

import torch

from fp8cache.platform.cpu_info import cpu_model_name


def describe() -> dict:
    return {"cpu": cpu_model_name(), "threads": torch.get_num_threads(), "torch": torch.__version__}


def synchronize(device: torch.device | str = "cpu") -> None:
    """Wait for the device's queued work (a no-op on the CPU), so host clocks time what ran."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def probe_kind(device: torch.device | str = "cpu") -> str:
    """What read_probe measures there: "read" on a CPU, "copy" (bytes read plus bytes written) on a GPU, the
    figure GPU bandwidth is usually quoted as and what a device copy reaches."""
    return "read" if torch.device(device).type == "cpu" else "copy"


def read_probe(num_bytes: int = 512 * 1024 * 1024, device: torch.device | str = "cpu"):
    """(fn, bytes): on a CPU fn reads `bytes` of main memory (all threads), a reduction over a buffer far
    larger than its caches; on a GPU it copies a 2 GiB buffer into another, and bytes counts both the reads and
    the writes (probe_kind). fn waits for the device; time it for the bandwidth."""
    if torch.device(device).type != "cpu":
        src = torch.ones(2 * 2**30 // 4, dtype=torch.float32, device=device)  # far past the GPU's L2
        dst = torch.empty_like(src)
        dst.copy_(src)

        def copy() -> None:
            dst.copy_(src)
            synchronize(device)

        return copy, 2 * src.numel() * 4
    buf = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    buf.sum()  # fault the pages in

    def read() -> None:
        buf.sum()
        synchronize(device)

    return read, buf.numel() * 4


def read_bandwidth_gbps(num_bytes: int = 512 * 1024 * 1024, repeats: int = 5,
                        device: torch.device | str = "cpu") -> float:
    """Read bandwidth of the device's main memory, the median of `repeats` timed reads (see read_probe)."""
    read, num_bytes = read_probe(num_bytes, device)
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        read()
        times.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times) / 1e9


def interleaved_ms(fns: list, warmup: int = 2, repeats: int = 5, settle_ms: float = 0.0,
                   settle_fns: list | None = None) -> list[float]:
    """Median milliseconds of each fn over `repeats` rounds in which every fn runs once, in turn. With
    settle_ms, each timed call comes right after untimed calls lasting at least that long of the same fn,
    or of its twin in settle_fns (the same work on other data, which leaves no data in the caches), so
    that it runs in its own steady state rather than in the wake of the fn before it."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, settle_fn, spent in zip(fns, settle_fns or fns, times):
            _settle(settle_fn, settle_ms)
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent) * 1e3 for spent in times]


def _settle(fn, settle_ms: float) -> None:
    if settle_ms <= 0:
        return
    until = time.perf_counter() + settle_ms / 1e3
    fn()
    while time.perf_counter() < until:
        fn()


def load_cpu_path(device: torch.device | str, cpu_isa: str) -> None:
    """Load the op library of `cpu_isa` (native, avx512, avx2, scalar) into this process before anything else
    does, so that the bench's engines and kernels run it; ValueError names why it cannot be."""
    from fp8cache import ops

    if cpu_isa == "native":
        ops.load(device)
        return
    if str(device) != "cpu":
        raise ValueError(f"{cpu_isa} is a CPU path; add --device cpu")
    try:
        ops.load(device, cpu_isa=cpu_isa)
    except RuntimeError as exc:
        raise ValueError(str(exc)) from exc


def cpu_path(device: torch.device | str) -> str | None:
    """The CPU path (avx512, avx2, scalar) of the op library this process runs, on a CPU."""
    return torch.ops.fp8kv.cpu_isa() if str(device) == "cpu" and hasattr(torch.ops.fp8kv, "cpu_isa") else None


def set_threads(threads: int | None) -> None:
    """The bench's --threads: torch's intra-op threads for this process (None: torch's default)."""
    if threads is not None:
        torch.set_num_threads(threads)
