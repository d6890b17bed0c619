"""KV cache sizing and allocation: how many blocks fit the memory the user gives the cache."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fp8cache.kvcache import dynamic_scales, formats

if TYPE_CHECKING:
    from fp8cache.kvcache.spec import KVCacheSpec

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")
_SIZE_HELP = 'an int of bytes or a string such as "2GiB", "512MiB", "1.5GB"'


def parse_memory_size(value: int | str, field: str = "kv_cache_memory") -> int:
    """Bytes for an int or a size string ("2GiB", "512MiB", "1.5GB", "1000000")."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str):
        match = _SIZE.fullmatch(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{field}={value!r} is not a size; give {_SIZE_HELP}")
        size = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise TypeError(f"{field}={value!r} is not a size; give {_SIZE_HELP}")
    if size <= 0:
        raise ValueError(f"{field}={value!r} must be more than 0 bytes; give {_SIZE_HELP}")
    return size


def available_memory_bytes() -> int:
    """Memory the OS could give us now: MemAvailable from /proc/meminfo, else free pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def bytes_per_token(num_layers: int, num_kv_heads: int, head_size: int, kv_cache_dtype: str,
                    model_dtype: torch.dtype, backend: str = "cpu", dynamic: bool = False,
                    skip_layers: int = 0) -> int:
    """Cache bytes one token takes across all layers, K and V; dynamic: with its per-token scales; skip_layers:
    how many of the layers an FP8 cache keeps in the model dtype (without scales)."""
    fp8_layers = num_layers - skip_layers if formats.is_fp8(formats.format_code(kv_cache_dtype, backend)) \
        else num_layers
    element = formats.bytes_per_element(kv_cache_dtype, model_dtype, backend)
    skipped = 2 * (num_layers - fp8_layers) * num_kv_heads * head_size * model_dtype.itemsize
    scales = dynamic_scales.bytes_per_token(fp8_layers, num_kv_heads) if dynamic else 0
    return 2 * fp8_layers * num_kv_heads * head_size * element + skipped + scales


def spec_bytes_per_token(spec: KVCacheSpec, window: bool = False) -> int:
    """bytes_per_token of a spec's cache (each layer in its own format), or (window) of its recent-token ring,
    held in window_dtype."""
    if window:
        return bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_size, formats.CacheFormat.AUTO,
                               spec.window_dtype, spec.backend)
    return bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_size, spec.format, spec.model_dtype,
                           spec.backend, spec.dynamic_scales, len(spec.skip_layers))


@dataclass
class CachePlan:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    budget_bytes: int
    budget_source: str
    window_size: int = 0  # kv_recent_window: newest tokens per sequence also kept in the model dtype
    window_seats: int = 0  # running sequences that can hold a window at once
    window_blocks_per_seat: int = 0
    window_bytes: int = 0  # all seats' window blocks, taken from the budget
    window_sinks: int = 0  # kv_recent_window_sinks: each sequence's first tokens, seats before the recent ones

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def window_num_blocks(self) -> int:
        return self.window_seats * self.window_blocks_per_seat


# Window seats: enough for as many max_model_len sequences as the budget holds with their seats, or, when
# more, as many as fit in this share of the budget (for shorter sequences: at most 1/16 less FP8 cache); never
# more than max_num_seqs.
WINDOW_BUDGET_SHARE = 16


def plan_cache(kv_cache_memory: int | str | None, kv_cache_memory_fraction: float, block_size: int,
               token_bytes: int, window_size: int = 0, window_token_bytes: int = 0,
               max_num_seqs: int = 1, max_model_len: int = 0, device_limit: DeviceLimit | None = None,
               window_sinks: int = 0) -> CachePlan:
    """Blocks of the FP8 (or auto) cache, and window seats, that fit the budget together. A seat's ring holds
    window_sinks + window_size tokens (the sinks' seats, then the recent ones).

    The budget is kv_cache_memory when given; else what max_num_seqs sequences of max_model_len tokens need
    (with their window seats), capped by what the device can give (`device_limit`; by default
    kv_cache_memory_fraction of the host's available memory)."""
    window_sinks = window_sinks if window_size > 0 else 0
    ring_blocks = -(-(window_sinks + window_size) // block_size)
    seat_bytes = ring_blocks * block_size * window_token_bytes if window_size > 0 else 0
    if kv_cache_memory is not None:
        budget, source = parse_memory_size(kv_cache_memory), "kv_cache_memory"
    else:
        limit = device_limit or host_limit(kv_cache_memory_fraction)
        need = max_num_seqs * (_sequence_bytes(max_model_len, block_size, token_bytes) + seat_bytes)
        if max_model_len > 0 and need <= limit.bytes:
            budget, source = need, f"sized for max_num_seqs {max_num_seqs} x max_model_len {max_model_len}"
        else:
            budget, source = limit.bytes, limit.source
        if budget <= 0:
            raise ValueError(f"no memory is left for the KV cache ({limit.source}); "
                             "free memory, raise the limit or give kv_cache_memory")
    seats = blocks_per_seat = window_bytes = 0
    if window_size > 0:
        blocks_per_seat = ring_blocks
        seats = max(1, min(max_num_seqs, window_seats(budget, block_size, token_bytes, seat_bytes, max_model_len)))
        window_bytes = seats * seat_bytes
    num_blocks = (budget - window_bytes) // (block_size * token_bytes)
    if num_blocks < 1:
        window = f" after {window_bytes} bytes of recent-token window" if window_bytes else ""
        raise ValueError(
            f"the KV cache budget ({budget} bytes, {source}) holds no block of {block_size} tokens "
            f"({block_size * token_bytes} bytes){window}; raise kv_cache_memory or kv_cache_memory_fraction"
            + (" or lower kv_recent_window" if window_bytes else ""))
    return CachePlan(num_blocks, block_size, token_bytes, budget, source, window_size, seats, blocks_per_seat,
                     window_bytes, window_sinks)


def plan_for(spec: KVCacheSpec, kv_cache_memory: int | str | None, kv_cache_memory_fraction: float,
             max_num_seqs: int = 1, max_model_len: int = 0, device_limit: DeviceLimit | None = None) -> CachePlan:
    """plan_cache for a spec's cache and its recent-token window."""
    return plan_cache(kv_cache_memory, kv_cache_memory_fraction, spec.block_size, spec_bytes_per_token(spec),
                      spec.window_size, spec_bytes_per_token(spec, window=True), max_num_seqs, max_model_len,
                      device_limit, spec.window_sinks)


def _sequence_bytes(max_model_len: int, block_size: int, token_bytes: int) -> int:
    return -(-max_model_len // block_size) * block_size * token_bytes if max_model_len > 0 else 0


def window_seats(budget: int, block_size: int, token_bytes: int, seat_bytes: int, max_model_len: int) -> int:
    """Seats before the max_num_seqs cap (see WINDOW_BUDGET_SHARE); max_model_len 0: unknown."""
    sequence_bytes = _sequence_bytes(max_model_len, block_size, token_bytes)
    full = budget // (sequence_bytes + seat_bytes) if sequence_bytes else 0
    return max(full, budget // WINDOW_BUDGET_SHARE // seat_bytes)


@dataclass(frozen=True)
class DeviceLimit:
    """The most the KV cache may take on its device, and how that was decided (for the startup line)."""

    bytes: int
    source: str


def host_limit(fraction: float) -> DeviceLimit:
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0 < fraction <= 1:
        raise ValueError(f"kv_cache_memory_fraction={fraction!r} must be a number in (0, 1]")
    return DeviceLimit(int(available_memory_bytes() * fraction), f"capped at {fraction:g} of available memory")


def gpu_limit(device: torch.device, utilization: float, reserve_bytes: int) -> DeviceLimit:
    """vLLM's --gpu-memory-utilization: the cache gets what is left of `utilization` of the GPU's memory after
    what is in use now (weights, other processes) and `reserve_bytes` for the forward pass's activations."""
    if not isinstance(utilization, (int, float)) or isinstance(utilization, bool) or not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={utilization!r} must be a number in (0, 1]")
    free, total = torch.cuda.mem_get_info(device)
    left = int(utilization * total) - (total - free) - reserve_bytes
    return DeviceLimit(left, f"{utilization:g} of {total / 2**30:.1f} GiB GPU memory, "
                             f"{(total - free) / 2**30:.2f} GiB in use, {reserve_bytes / 2**30:.2f} GiB for activations")


def allocate_caches(allocate: Callable, spec: KVCacheSpec, num_blocks: int, device: torch.device | str,
                    window: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (key_cache, value_cache) pair per layer of a spec's cache, each in its layer's format, or (window) of
    its recent-token ring, in docs/design.md section 4 layouts. `allocate` has kvcache.layout.allocate_kv_cache's
    signature."""
    if window:
        formats_and_dtypes = [(formats.CacheFormat.AUTO, spec.window_dtype)] * spec.num_layers
    else:
        formats_and_dtypes = [(fmt, spec.model_dtype) for fmt in spec.layer_formats]
    return [allocate(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size, fmt, dtype, str(device))
            for fmt, dtype in formats_and_dtypes]


def describe(plan: CachePlan, cache_label: str, max_model_len: int, max_num_seqs: int = 1,
             model_dtype: torch.dtype | None = None, window_dtype: torch.dtype | None = None) -> list[str]:
    """The start log's lines about the cache; cache_label: its resolved dtype (and any layers in another)."""
    mib = plan.num_blocks * plan.block_size * plan.bytes_per_token / 2**20
    lines = [(f"KV cache: {cache_label}, {plan.num_blocks} blocks of {plan.block_size} tokens = "
              f"{plan.capacity_tokens} tokens of capacity, {plan.bytes_per_token} bytes per token "
              f"({mib:.1f} MiB, {plan.budget_source})")]
    if plan.window_size:
        shown = window_dtype if window_dtype is not None else model_dtype
        dtype = str(shown).replace("torch.", "") if shown is not None else "the model dtype"
        s = "s" if plan.window_seats != 1 else ""
        sinks = (f", and its first {plan.window_sinks} (attention sink{'s' if plan.window_sinks != 1 else ''}),"
                 if plan.window_sinks else "")
        lines.append(f"Recent-token window: the newest {plan.window_size} tokens of each sequence{sinks} also in "
                     f"{dtype},"
                     f" {plan.window_seats} seat{s} ({plan.window_bytes / 2**20:.1f} MiB of the budget)")
        if plan.window_seats < max_num_seqs:
            lines.append(f"note: the recent-token window has seats for {plan.window_seats} sequence{s}, fewer than "
                         f"max_num_seqs {max_num_seqs}; at most {plan.window_seats} run at once "
                         "(raise kv_cache_memory or lower kv_recent_window)")
    if plan.capacity_tokens < max_model_len:
        lines.append(f"warning: the KV cache holds {plan.capacity_tokens} tokens, fewer than max_model_len "
                     f"{max_model_len}; one long sequence may not fit (raise kv_cache_memory)")
    return lines
