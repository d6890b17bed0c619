"""CPU caches on transparent huge pages: what /proc/self/smaps says the kernel gave us."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from fp8cache.kvcache.layout import allocate_kv_cache
from fp8cache.platform import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _smaps_kib(start: int, end: int, field: str = "AnonHugePages") -> int:
    """A /proc/self/smaps field (KiB) summed over this process's mappings that overlap [start, end)."""
    total = 0
    for entry in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        lo, hi = (int(x, 16) for x in entry.split()[0].split("-"))
        if lo < end and hi > start:
            total += sum(int(line.split()[1]) for line in entry.splitlines() if line.startswith(f"{field}:"))
    return total


def _huge_kib(start: int, end: int) -> int:
    return _smaps_kib(start, end)


def _thp_mode() -> str:
    if not sys.platform.startswith("linux") or not THP.exists():
        return "none"
    return re.search(r"\[(\w+)\]", THP.read_text()).group(1)


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off here")
def test_a_large_cpu_cache_lies_on_huge_pages():
    key_cache, value_cache = allocate_kv_cache(4096, 16, 8, 128, "fp8_e4m3", torch.bfloat16)
    for cache in (key_cache, value_cache):
        assert cache.dtype == torch.uint8 and cache.is_contiguous() and not cache.any()
        cache.fill_(7)  # pages exist once written
        start, end = cache.data_ptr(), cache.data_ptr() + cache.numel()
        whole = end // huge_pages.HUGE_PAGE - -(-start // huge_pages.HUGE_PAGE)  # 2 MiB pages inside it
        # Most of them (the kernel may find no free 2 MiB page for a few).
        assert _huge_kib(start, end) >= whole * huge_pages.HUGE_PAGE // 1024 // 2


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off here")
def test_a_cache_allocated_after_freed_heap_memory_still_lies_on_huge_pages():
    """Freed, already-touched heap memory below a live allocation (as a model load leaves behind) must not
    become the cache: its 4 KiB pages would stay 4 KiB whatever the advice."""
    torch.ones(3 << 18)  # freeing a 3 MiB mapping raises glibc's mmap threshold past 3 MiB
    chunks = [torch.ones(3 << 18) for _ in range(40)]  # 120 MiB of touched heap ...
    pin = torch.ones(3 << 18)  # ... kept from the top of the heap by a live allocation
    del chunks
    key_cache, _ = allocate_kv_cache(2048, 16, 8, 128, "fp8_e4m3", torch.bfloat16)
    key_cache.fill_(7)
    start, end = key_cache.data_ptr(), key_cache.data_ptr() + key_cache.numel()
    whole = end // huge_pages.HUGE_PAGE - -(-start // huge_pages.HUGE_PAGE)
    assert whole > 0 and _huge_kib(start, end) >= whole * huge_pages.HUGE_PAGE // 1024 // 2
    del pin


def test_advice_needs_a_whole_huge_page():
    assert not huge_pages.advise(torch.empty(1000, dtype=torch.uint8))
    zeros = huge_pages.zeros((3, 5), torch.float32)
    assert zeros.shape == (3, 5) and zeros.dtype == torch.float32 and not zeros.any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_a_large_cpu_cache_costs_no_memory_until_written():
    """A generous default budget must not cost resident memory (or start-up time zero-filling it) before the
    blocks are used: the cache's pages stay untouched until a block is written."""
    key_cache, _ = allocate_kv_cache(8192, 16, 8, 128, "fp8_e4m3", torch.bfloat16)  # 128 MiB
    start, end = key_cache.data_ptr(), key_cache.data_ptr() + key_cache.numel()
    assert _smaps_kib(start, end, "Rss") < 8 * 1024
    key_cache[:256].fill_(1)  # 4 MiB of blocks written
    assert _smaps_kib(start, end, "Rss") >= 4 * 1024
