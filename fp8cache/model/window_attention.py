"""Windowed prefill attention on CPU: a chunk's rows read FP8 keys up to their last N positions and
full-precision keys for those N. One dense-mask SDPA over [FP8 keys ; full-precision keys] would compute
every masked-out pair too (about 4x a causal SDPA), so the same softmax is computed here as three parts
(see WindowSplit) merged by log-sum-exp. fp8cache.model.attention picks this path on CPU and keeps the
dense mask for other devices; tests/test_recent_window.py holds the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class WindowSplit:
    """A windowed prefill chunk's attention as three parts of one softmax, merged by log-sum-exp, so that
    nothing is computed for masked-out keys (one dense-mask SDPA over [FP8 keys ; full keys] costs about 4x
    a causal one). Row r at position P_r reads FP8 keys [0, full_from_r) and full-precision keys
    [full_from_r, P_r], full_from_r = max(P_r - N + 1, floor); s = full_from_0. The parts:
      shared: FP8 keys [0, s), seen by every row;
      causal: FP8 keys [s, cached_len), row r sees the first r - causal_from + 1 of them (a causal SDPA
              over rows [causal_from, query_len));
      band:   full-precision keys [s, context_len), N per row: rows in blocks of B share a tile of
              B + N - 1 keys starting at index band_offset + first row (with N - 1 padding keys in front);
              band_mask [blocks, B, B + N - 1] keeps each row's keys at or past full_from_r."""

    shared_len: int
    causal_from: int
    band_offset: int
    band_mask: torch.Tensor


def window_split(window: int, q_len: int, prefix: int, shared_len: int, full_from: torch.Tensor,
                 device: torch.device) -> WindowSplit:
    """The WindowSplit of a chunk of q_len rows after `prefix` positions; full_from [q_len, 1] is each row's
    first full-precision position and shared_len the first row's."""
    # Row r has full_from_r - s causal FP8 keys = max(0, r - lag): rows past `lag` have some.
    lag = shared_len - (prefix - window + 1)
    rows = min(max(window // 2, 16), 128)
    num_blocks = -(-q_len // rows)
    row = torch.arange(num_blocks * rows, device=device).view(num_blocks, rows, 1)
    tile = torch.arange(rows + window - 1, device=device).view(1, 1, -1)
    # Tile entry w of row r (local row i) is position P_r - N + 1 + (w - i); row r reads it from full
    # precision when w - i is in [0, N) and the position is at or past full_from_r. Padding rows read one key.
    position = row + prefix - window + 1 + (tile - row % rows)
    in_band = (tile >= row % rows) & (tile < row % rows + window)
    full_from_rows = F.pad(full_from.view(-1), (0, num_blocks * rows - q_len), value=0).view(num_blocks, rows, 1)
    valid = in_band & (position >= full_from_rows)
    valid |= (row >= q_len) & (tile == row % rows)
    return WindowSplit(shared_len, lag + 1, prefix - shared_len, valid)


def split_window_attention(qs: torch.Tensor, cached: tuple[torch.Tensor, torch.Tensor] | None,
                           full_k: torch.Tensor, full_v: torch.Tensor, split: WindowSplit,
                           scaling: float) -> torch.Tensor:
    """[n, heads, q_len, d] float32: the WindowSplit parts, merged. cached: FP8 K/V [n, kv_heads, cached_len,
    d] read back from the cache; full_k/full_v: full-precision K/V [n, kv_heads, context_len - s, d]."""
    out, lse = _band_attention(qs, full_k, full_v, split, scaling)
    if cached is not None:
        group = qs.shape[1] // cached[0].shape[1]
        ck, cv = (t.repeat_interleave(group, 1) if group > 1 else t for t in cached)
        s, first = split.shared_len, split.causal_from
        if s:
            _merge_into(out, lse, *_flash(qs, ck[:, :, :s], cv[:, :, :s], False, scaling), first_row=0)
        if ck.shape[2] > s:  # rows before `first` have no causal keys
            _merge_into(out, lse, *_flash(qs[:, :, first:], ck[:, :, s:], cv[:, :, s:], True, scaling), first)
    return out


def _merge_into(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor,
                first_row: int) -> None:
    """Fold a softmax part over more keys into rows [first_row, ...) of (out, lse), in place."""
    rows_out, rows_lse = out[:, :, first_row:], lse[:, :, first_row:]
    total = torch.logaddexp(rows_lse, part_lse)
    rows_out.mul_(torch.exp(rows_lse - total).unsqueeze(-1))
    rows_out.add_(part_out * torch.exp(part_lse - total).unsqueeze(-1))
    rows_lse.copy_(total)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch's CPU flash attention, which also returns each row's log-sum-exp (top-left causal alignment)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q.contiguous(), k.contiguous(), v.contiguous(),
                                                                      0.0, causal, scale=scaling)


def _band_attention(qs: torch.Tensor, full_k: torch.Tensor, full_v: torch.Tensor, split: WindowSplit,
                    scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row against its own N full-precision keys. Rows go in blocks of B: block b's rows share the
    B + N - 1 keys that cover all their bands (a strided view of the keys), so the work is a batched matmul
    over small dense tiles, and band_mask keeps each row's N."""
    n, heads, q_len, d = qs.shape
    kv_heads, group = full_k.shape[1], heads // full_k.shape[1]
    num_blocks, rows, width = split.band_mask.shape
    # Padding N - 1 keys in front puts row r's band at [band_offset + r, + N); the back padding lets the
    # last (partial) block's tile exist.
    front, back = width - rows, num_blocks * rows - q_len
    tiles = [F.pad(t, (0, 0, front, back))[:, :, split.band_offset:].unfold(2, width, rows)[:, :, :num_blocks]
             for t in (full_k, full_v)]  # [n, kv, blocks, d, B + N - 1]
    q = (F.pad(qs, (0, 0, 0, back)) if back else qs).view(n, kv_heads, group, num_blocks, rows, d).transpose(2, 3)
    scores = q.reshape(n, kv_heads, num_blocks, group * rows, d) @ tiles[0] * scaling
    scores = scores.view(n, kv_heads, num_blocks, group, rows, width).masked_fill(~split.band_mask[:, None],
                                                                                    -torch.inf)
    # One exp for both the probabilities and the log-sum-exp (every row keeps at least one key).
    top = scores.amax(-1, keepdim=True)
    probs = torch.exp_(scores - top)
    total = probs.sum(-1, keepdim=True)
    lse = (top + torch.log(total)).squeeze(-1)
    probs = probs.div_(total).view(n, kv_heads, num_blocks, group * rows, width)
    out = (probs @ tiles[1].transpose(-1, -2)).view(n, kv_heads, num_blocks, group, rows, d).transpose(2, 3)
    out = out.reshape(n, heads, num_blocks * rows, d)[:, :, :q_len]
    return out, lse.transpose(2, 3).reshape(n, heads, num_blocks * rows)[:, :, :q_len]
