"""A step's integer metadata (slots, block tables, lengths, token ids), built on the host and sent to the
device in one copy.

Every small tensor a step needs could be its own `torch.tensor(..., device=gpu)`: one blocking copy from
pageable memory each, a wait for the GPU every time. Here they are packed into one buffer (pinned on CUDA),
copied without blocking, and the device tensors are views of that one copy. On the CPU the arrays are used
in place.
"""

from __future__ import annotations

import numpy as np
import torch

from fp8cache.model.batch import StepBatch

_ALIGN = 16  # every array starts 16-byte aligned, so an int64 view of the byte buffer is legal
_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


def to_device(arrays: dict[str, np.ndarray], device: torch.device | str,
              into: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Device tensors of the same shapes and dtypes (int32 / int64) as `arrays`.

    into: a device uint8 buffer to copy into (CUDA-graph steps keep theirs), else a new one. It must hold
    packed_size(arrays) bytes."""
    device = torch.device(device)
    if device.type == "cpu" and into is None:
        return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}
    offsets, size = _layout(arrays)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
    raw = host.numpy() if not _is_fake(host) else None
    if raw is not None:
        for name, a in arrays.items():
            raw[offsets[name]:offsets[name] + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    if into is None:
        buffer = host.to(device, non_blocking=True)
    else:
        if into.numel() < size:
            raise ValueError(f"metadata buffer of {into.numel()} bytes cannot hold {size}")
        buffer = into
        buffer[:size].copy_(host, non_blocking=True)
    return {name: _view(buffer, offsets[name], a) for name, a in arrays.items()}


def future_arrays(batch: StepBatch) -> dict[str, np.ndarray]:
    """The step's input-id rows that take a token the previous step sampled (StepBatch.future_rows), and
    which of its rows: to ride along in the step's one copy."""
    if not batch.future_rows:
        return {}
    return {"future_rows": np.asarray(batch.future_rows, dtype=np.int64),
            "future_src": np.asarray(batch.future_src, dtype=np.int64)}


def feed_tokens(input_ids: torch.Tensor, views: dict[str, torch.Tensor], prev_tokens: torch.Tensor | None) -> None:
    """Copy the previous step's sampled tokens into this step's input ids, on the device (the overlapped loop:
    the host never sees them first)."""
    if "future_rows" not in views:
        return
    if prev_tokens is None:
        raise ValueError("the step feeds tokens of the previous step, but no previous tokens were given")
    picked = prev_tokens.index_select(0, views["future_src"]).to(input_ids.dtype)
    input_ids.view(-1).index_copy_(0, views["future_rows"], picked)


def packed_size(arrays: dict[str, np.ndarray]) -> int:
    return _layout(arrays)[1]


def _layout(arrays: dict[str, np.ndarray]) -> tuple[dict[str, int], int]:
    offsets, size = {}, 0
    for name, a in arrays.items():
        if a.dtype not in _TORCH:
            raise TypeError(f"step metadata {name!r} is {a.dtype}; only int32 and int64 are packed")
        offsets[name] = size
        size += -(-a.nbytes // _ALIGN) * _ALIGN
    return offsets, max(size, _ALIGN)


def _view(buffer: torch.Tensor, offset: int, a: np.ndarray) -> torch.Tensor:
    return buffer[offset:offset + a.nbytes].view(_TORCH[a.dtype]).view(a.shape)


def _is_fake(t: torch.Tensor) -> bool:
    # Under FakeTensorMode (tests standing in for a GPU) host tensors carry no data to fill.
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)
