"""The window ring's attention sinks (window_sinks S > 0) in the CPU ops, held to the pure-torch reference
(fp8cache.ops.reference.paged_attention_window): positions [0, min(S, window_start)) are read from the ring's own
S seats in the model dtype, the rest of the old positions from the paged FP8 cache, the newest from the ring.

Batches come from test_window_ops.build: the ring holds K/V drawn independently of the paged cache's and
every seat no token was written to holds NaN, so a position read from the wrong cache or seat shows. (A sequence
shorter than window_size + S leaves its ring seats [S, 2S) unwritten, before the first recent one: the kernels, whose
tiles start at block boundaries, must zero those values, not only their weights.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from numerics import attention_error
from test_attention_features import Features, sinks_for
from test_dynamic_scales import write_dynamic
from test_ops_cpu import tolerance
from test_window_ops import WindowCase, assert_close, attention, build

from fp8cache.ops import format_code
from fp8cache.ops import reference as ref


@pytest.fixture(scope="module")
def ops():
    from fp8cache.ops import load

    return load()


bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
EDGES = ("low", "high", "mid", "low+1", "high-1")  # window starts, cycled over the sequences
# Lengths below, at and past S, window_size + S and block multiples, so that window_start falls below S (the sinks
# then lie inside the recent part), on it and past it, and the paged run starts and ends around block edges.
CASES = [
    WindowCase("fp8_e4m3", bf16, 32, 64, 16, 8, 2, f32, seq_lens=(1, 2, 5, 32, 33, 34, 47, 48, 49, 100, 1300),
               starts=EDGES, window_sinks=1),
    WindowCase("fp8_e5m2", f32, 7, 128, 8, 4, 4, bf16, seq_lens=(1, 2, 3, 4, 8, 9, 10, 11, 12, 17, 600),
               starts=EDGES, per_head_scale=True, window_sinks=3),
    WindowCase("auto", bf16, 16, 64, 16, 8, 1, bf16, seq_lens=(15, 16, 17, 31, 32, 33, 40, 48, 49, 700),
               starts=EDGES, window_sinks=16),
    WindowCase("fp8_e4m3fnuz", f16, 33, 80, 32, 8, 2, f16, seq_lens=(16, 17, 18, 49, 50, 51, 64, 65, 1030),
               starts=EDGES, alibi=True, window_sinks=17),
    WindowCase("fp8", bf16, 16, 64, 16, 6, 2, f32, seq_lens=(14, 15, 16, 30, 31, 32, 47, 90), starts=EDGES,
               alibi=True, strided_query=True, window_sinks=15),
    WindowCase("fp8_e5m2", bf16, 3, 96, 16, 9, 3, f32, seq_lens=(1, 2, 3, 4, 5, 6, 19, 20, 21), starts=EDGES,
               window_sinks=2),
    # a window longer than a partition (the ring runs are split), and more sinks than a partition holds
    WindowCase("fp8_e4m3", bf16, 700, 128, 16, 8, 2, bf16, seq_lens=(1300, 703, 704, 1401),
               starts=("low", "mid", "low+1", "high-1"), alibi=True, window_sinks=3),
    WindowCase("fp8_e4m3", f32, 16, 64, 16, 4, 2, f32, seq_lens=(5, 600, 601, 620, 1300), starts=EDGES,
               window_sinks=600),
]


@pytest.mark.parametrize("case", CASES, ids=WindowCase.id)
def test_sinks_match_the_reference(ops, case):
    b = build(case)
    assert_close(attention(ops, case, b), attention(ref, case, b), case.dtype)


@pytest.mark.parametrize("case", [c for c in CASES if c.kv != "auto"][:5], ids=WindowCase.id)
def test_sinks_with_dynamic_scales(ops, case):
    b = build(case)
    k_scales, v_scales = write_dynamic(case, b)
    features = {"k_scale_cache": k_scales, "v_scale_cache": v_scales}
    assert_close(attention(ops, case, b, **features), attention(ref, case, b, **features), case.dtype)


SLIDING = WindowCase("fp8_e4m3", bf16, 32, 64, 16, 8, 2, f32, seq_lens=(5, 31, 32, 33, 47, 48, 49, 90, 600),
                     starts=EDGES, window_sinks=3)


# Sliding windows of 2 (every sequence's first position is past the sinks but for the shortest), 40 (the first
# position is before the sinks' end for the short sequences, after it for the long ones) and 700 (always before).
@pytest.mark.parametrize("features", [Features(2), Features(40, 0.0, True), Features(0, 2.5), Features(700, 1.0, True),
                                      Features(0, 0.0, True)], ids=Features.id)
@pytest.mark.parametrize("alibi", [False, True], ids=["", "alibi"])
def test_sinks_with_model_features(ops, features, alibi):
    case = dataclasses.replace(SLIDING, alibi=alibi)
    b = build(case)
    extra = {"sliding_window": features.sliding_window, "logit_softcap": features.logit_softcap,
             "sinks": sinks_for(case.heads, 3) if features.sinks else None}
    want = attention(ref, case, b, **extra)
    assert attention_error(want, attention(ref, case, b)) > 3 * tolerance(case.dtype), "the features change nothing"
    assert_close(attention(ops, case, b, **extra), want, case.dtype)


def test_sink_seats_are_what_the_kernel_reads(ops):
    """New values in the ring's sink seats change the output (as much as the reference says): the positions
    below S come from there, not from the paged cache, whose copies of them are untouched."""
    case = CASES[1]
    b = build(case)
    before = attention(ops, case, b)
    g = torch.Generator().manual_seed(11)
    seats = torch.cat([ref.window_slots(b["window_table"][s], torch.arange(min(case.window_sinks, n)),
                                        case.window_size, case.block_size, case.window_sinks)
                       for s, n in enumerate(case.lens())])
    shape = (len(seats), case.kv_heads, case.head_size)
    new_k, new_v = (torch.randn(shape, generator=g).mul(3).to(case.window_dtype) for _ in range(2))
    ref.reshape_and_cache(new_k, new_v, *b["window_caches"], seats, "auto", b["k_scale"], b["v_scale"])
    after, want = attention(ops, case, b), attention(ref, case, b)
    assert_close(after, want, case.dtype)
    changed = [s for s in range(len(case.lens())) if attention_error(after[s:s + 1], before[s:s + 1])
               > 3 * tolerance(case.dtype)]
    assert changed == [s for s in range(len(case.lens())) if case.lens()[s] > 0], changed


SMALL = WindowCase("fp8_e4m3", bf16, 16, 64, 16, 4, 2, f32, seq_lens=(40, 10), window_sinks=1)


def test_negative_sinks_raise(ops):
    b = build(SMALL)
    with pytest.raises(RuntimeError, match="window_sinks = -1 must be >= 0"):
        attention(ops, dataclasses.replace(SMALL, window_sinks=-1), b)


def test_window_table_without_room_for_the_sinks_raises(ops):
    b = build(dataclasses.replace(SMALL, window_sinks=0))  # a ring of 16 seats: one block of 16
    b["window_table"] = b["window_table"][:, :1].contiguous()
    with pytest.raises(RuntimeError, match=r"window_sinks \+ window_size = 1 \+ 16 = 17 seats needs 2 blocks"):
        attention(ops, SMALL, b)


def test_out_of_range_sink_seat_block_raises(ops):
    case = dataclasses.replace(SMALL, window_sinks=20)  # seats 0..19: blocks 0 and 1 of the ring
    b = build(case)
    b["window_table"][0, 1] = 10_000
    with pytest.raises(RuntimeError, match=r"window_block_tables\[0, 1\] = 10000 is outside the window cache's"):
        attention(ops, case, b)


def layer_weights(hidden_size: int, heads: int, kv_heads: int, d: int, intermediate: int, g: torch.Generator):
    """decode_layer's weights (fp8kv float32 panels) and the plain float32 matrices behind them."""
    def matrix(rows, cols):
        return torch.randn(rows, cols, generator=g) * cols ** -0.5

    plain = [torch.rand(hidden_size, generator=g) + 0.5, matrix((heads + 2 * kv_heads) * d, hidden_size),
             matrix(hidden_size, heads * d), torch.rand(hidden_size, generator=g) + 0.5,
             matrix(2 * intermediate, hidden_size), matrix(hidden_size, intermediate)]
    pack = torch.ops.fp8kv.linear_f32_pack
    return [plain[0], pack(plain[1]), pack(plain[2]), plain[3], pack(plain[4]), pack(plain[5])]


def layer_from_ops(ops, hidden, weights, dims, eps, cos, sin, scale, attention_args, window_sinks):
    """decode_layer.cpp's steps, one op call each (hidden updated in place): its reference."""
    heads, kv_heads, d, intermediate = dims
    (key_cache, value_cache, slots, fmt, k_scale, v_scale, table, seq_lens, max_len, window, window_slots,
     window_table, window_starts, window_size, k_scale_cache, v_scale_cache) = attention_args
    tokens, hidden_size = hidden.shape
    q_size, kv_size = heads * d, kv_heads * d
    h = torch.empty_like(hidden)
    ops.rms_norm(h, hidden, weights[0], eps[0])
    qkv = ops.linear_f32(h, weights[1], q_size + 2 * kv_size, None)
    q = qkv[:, :q_size].view(tokens, heads, d)
    k = qkv[:, q_size:q_size + kv_size].view(tokens, kv_heads, d)
    v = qkv[:, q_size + kv_size:].view(tokens, kv_heads, d)
    ops.rotary_embedding_cos_sin(q, k, cos, sin)
    ops.reshape_and_cache(k, v, key_cache, value_cache, slots, fmt, k_scale, v_scale, k_scale_cache, v_scale_cache)
    ops.reshape_and_cache(k, v, *window, window_slots, format_code("auto", "cpu"), k_scale, v_scale, None, None)
    attn = torch.empty(tokens, heads, d)
    ops.paged_attention_window(attn, q.contiguous(), key_cache, value_cache, *window, kv_heads, scale, table,
                               window_table, seq_lens, window_starts, window_size, key_cache.shape[3], max_len, None,
                               fmt, k_scale, v_scale, 0, 0.0, None, k_scale_cache, v_scale_cache, window_sinks)
    o = ops.linear_f32(attn.view(tokens, q_size), weights[2], hidden_size, None)
    ops.fused_add_rms_norm(o, hidden, weights[3], eps[1])
    gate_up = ops.linear_f32(o, weights[4], 2 * intermediate, None)
    act = torch.empty(tokens, intermediate)
    ops.silu_and_mul(act, gate_up[:, :intermediate], gate_up[:, intermediate:])
    hidden.add_(ops.linear_f32(act, weights[5], hidden_size, None))


@pytest.mark.parametrize("kv,dynamic", [("fp8_e4m3", False), ("fp8_e5m2", True)], ids=["e4m3", "e5m2-dynamic"])
def test_decode_layer_reads_the_sinks(ops, kv, dynamic):
    """decode_layer with S > 0 is bitwise its steps run one op at a time (paged_attention_window with the same S,
    held to the reference above), on a decode step of sequences whose window starts lie below, at and past S; and
    not what the same steps give with S = 0 (so the layer really passes S on)."""
    case = WindowCase(kv, f32, 8, 64, 16, 4, 2, f32, seq_lens=(2, 3, 9, 19, 40), starts=("low", "mid", "low+1"),
                      window_sinks=3)
    b = build(case)
    scale_caches = write_dynamic(case, b) if dynamic else (None, None)
    g = torch.Generator().manual_seed(5)
    hidden_size, intermediate, lens = 96, 160, case.lens()
    dims = (case.heads, case.kv_heads, case.head_size, intermediate)
    weights = layer_weights(hidden_size, *dims[:3], intermediate, g)
    hidden = torch.randn(len(lens), hidden_size, generator=g)
    angles = torch.rand(len(lens), case.head_size // 2, generator=g) * 6.3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    newest = torch.tensor(lens) - 1  # each sequence's token of this step
    bs, w, s = case.block_size, case.window_size, case.window_sinks
    slots = torch.stack([b["table"][i, p // bs].long() * bs + p % bs for i, p in enumerate(newest.tolist())])
    window_slots = torch.cat([ref.window_slots(b["window_table"][i], newest[i:i + 1], w, bs, s)
                              for i in range(len(lens))])
    eps, scale = [1e-5, 1e-6], case.head_size ** -0.5

    def state():
        caches = [c.clone() for c in (*b["caches"], *b["window_caches"])]
        scales = [c.clone() if c is not None else None for c in scale_caches]
        args = (caches[0], caches[1], slots, format_code(kv, "cpu"), b["k_scale"], b["v_scale"], b["table"],
                b["seq_lens"], max(lens), caches[2:], window_slots, b["window_table"], b["window_starts"], w, *scales)
        return hidden.clone(), caches, args

    got, got_caches, args = state()
    ops.decode_layer(got, weights, [None] * 4, [*dims, 0], eps, cos, sin, scale, *args, False, s)
    want, want_caches, args = state()
    layer_from_ops(ops, want, weights, dims, eps, cos, sin, scale, args, s)
    assert torch.equal(got, want), f"max difference {(got - want).abs().max().item()}"
    for mine, theirs in zip(got_caches, want_caches):
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
    plain, _, args = state()
    layer_from_ops(ops, plain, weights, dims, eps, cos, sin, scale, args, 0)
    assert not torch.isnan(got).any() and attention_error(got, plain) > 3 * tolerance(f32)
