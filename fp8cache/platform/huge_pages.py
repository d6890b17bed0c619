"""Large CPU cache tensors on transparent huge pages.

Paged attention reads blocks scattered over the whole cache, so with 4 KiB pages nearly every block is a
TLB miss and a page walk (for the kernels' prefetches too). Linux backs a range given
madvise(MADV_HUGEPAGE) with 2 MiB pages when /sys/kernel/mm/transparent_hugepage/enabled is `madvise` or
`always`; the advice must come before the pages are first touched. Measured on the 2-core test machine
(decode attention, batch 8, context 8192, each cache interleaved with its twin on 4 KiB pages in one
process, five runs): fp8_e4m3 4-7% faster; the bfloat16 cache, bound by bandwidth, 2% slower on average
(-0.4% to +5.5%). Elsewhere (no THP, not Linux) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros on the CPU, on huge pages when it spans some, its pages faulted in only when first used.

    A large tensor gets its own anonymous mapping, 2 MiB-aligned: torch's allocator may hand out freed heap
    memory whose pages are already touched (4 KiB pages, which the advice no longer changes); seen after a
    model's temporaries were freed."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or _madvise() is None:
        return torch.zeros(shape, dtype=dtype)
    # Private (a shared anonymous mapping is shmem, outside THP's madvise mode) and untouched: the kernel
    # zero-fills each page on first touch.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    pointer = ctypes.c_char.from_buffer(region)
    offset = -ctypes.addressof(pointer) % HUGE_PAGE
    del pointer  # a live export would keep the mapping from ever being unmapped
    # The tensor holds the mapping (a buffer export) and unmaps it when the tensor is freed.
    tensor = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)
    advise(tensor)
    # Untouched: a fresh private mapping reads as zeros, and its pages cost memory only once written.
    return tensor.view(dtype).view(shape)


def advise(tensor: torch.Tensor) -> bool:
    """Ask for huge pages for the 2 MiB-aligned part of tensor's memory; True if the kernel took the advice."""
    madvise = _madvise()
    start = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // HUGE_PAGE * HUGE_PAGE
    if madvise is None or end <= start:
        return False
    return madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE) == 0


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
