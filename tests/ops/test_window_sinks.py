"""The window ring's attention sinks (window_sinks S > 0) in the CPU ops, held to the pure-torch reference
(fp8cache.ops.reference.paged_attention_window): positions [0, min(S, window_start)) are read from the ring's own
S seats in the model dtype, the rest of the old positions from the paged FP8 cache, the newest from the ring.

Batches come from test_window_ops.build: the ring holds K/V drawn independently of the paged cache's and
every seat no token was written to holds NaN, so a position read from the wrong cache or seat shows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from numerics import attention_error
from test_attention_features import Features, sinks_for
from test_dynamic_scales import write_dynamic
from test_ops_cpu import tolerance
from test_window_ops import WindowCase, attention, build

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


def assert_matches(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(want).any() and not torch.isnan(got).any()
    err = attention_error(got, want)
    assert err <= tolerance(dtype), f"max error {err:.2e} of the output scale"


@pytest.mark.parametrize("case", CASES, ids=WindowCase.id)
def test_sinks_match_the_reference(ops, case):
    b = build(case)
    assert_matches(attention(ops, case, b), attention(ref, case, b), case.dtype)


@pytest.mark.parametrize("case", [c for c in CASES if c.kv != "auto"][:5], ids=WindowCase.id)
def test_sinks_with_dynamic_scales(ops, case):
    b = build(case)
    k_scales, v_scales = write_dynamic(case, b)
    features = {"k_scale_cache": k_scales, "v_scale_cache": v_scales}
    assert_matches(attention(ops, case, b, **features), attention(ref, case, b, **features), case.dtype)


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
    assert_matches(attention(ops, case, b, **extra), want, case.dtype)


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
    assert_matches(after, want, case.dtype)
    changed = [s for s in range(len(case.lens())) if attention_error(after[s:s + 1], before[s:s + 1])
               > 3 * tolerance(case.dtype)]
    assert changed == [s for s in range(len(case.lens())) if case.lens()[s] > 0], changed


def test_zero_sinks_is_the_plain_window(ops):
    """window_sinks = 0 passed explicitly is bitwise the call without it."""
    case = dataclasses.replace(CASES[0], window_sinks=0)
    b = build(case)
    assert torch.equal(attention(ops, case, b, window_sinks=0), attention(ops, case, b))


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
