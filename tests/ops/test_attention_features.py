"""Sliding windows, logit soft-capping and attention sinks in the CPU attention ops, held to the pure-torch
reference (fp8cache.ops.reference.attend).

The GPU kernels' twins of these cases run in tests/ops/test_cuda_tensor_core_emulation.py (both kernels, host
emulation) and, on a GPU, tests/ops/test_ops_cuda.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import test_ops_cpu as paged_tests
import test_window_ops as window_tests
import torch
from numerics import attention_error

from fp8cache.ops import format_code
from fp8cache.ops import reference as ref


@pytest.fixture(scope="module")
def ops():
    from fp8cache.ops import load

    return load()


@dataclasses.dataclass(frozen=True)
class Features:
    sliding_window: int = 0
    logit_softcap: float = 0.0
    sinks: bool = False

    def id(self) -> str:
        return "-".join(bit for bit, on in ((f"w{self.sliding_window}", self.sliding_window),
                                           (f"cap{self.logit_softcap:g}", self.logit_softcap),
                                           ("sinks", self.sinks)) if on) or "none"


def sinks_for(num_heads: int, seed: int) -> torch.Tensor:
    # Around the logits' own size (soft caps too, below), so that each takes a visible share of the softmax.
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2.0


def attend(impl, case, caches, b, f: Features) -> torch.Tensor:
    out = torch.full_like(b["query"], 7.0)  # every row must be written
    sinks = sinks_for(case.heads, case.seed).to(b["query"].device) if f.sinks else None
    impl.paged_attention(out, b["query"], caches[0], caches[1], case.kv_heads, case.head_size ** -0.5,
                         b["table"], b["seq_lens"], case.block_size, max(case.seq_lens), b["alibi"],
                         format_code(case.kv, b["query"].device), b["k_scale"], b["v_scale"], f.sliding_window,
                         f.logit_softcap, sinks)
    return out


# Lengths around a window of 16 (under, at, over, two windows and a bit, a partition and more) and a window of
# 700 that crosses the CPU kernels' 512-position partitions; every cache format and path.
CASES = [
    (paged_tests.Case("fp8_e4m3", 64, 16, 8, 2, torch.float32, seq_lens=(15, 16, 17, 35, 600)), Features(16)),
    (paged_tests.Case("fp8_e5m2", 128, 8, 4, 4, torch.bfloat16, seq_lens=(1, 9, 23, 700)), Features(16, 0.0, True)),
    (paged_tests.Case("fp8_e4m3fnuz", 64, 32, 8, 1, torch.float16, seq_lens=(40, 1500)), Features(700)),
    (paged_tests.Case("auto", 128, 16, 8, 2, torch.bfloat16, seq_lens=(5, 300)), Features(0, 2.0)),
    (paged_tests.Case("auto", 64, 16, 4, 2, torch.float32, seq_lens=(33, 530), alibi=True), Features(16, 1.5)),
    (paged_tests.Case("fp8_e4m3", 128, 16, 16, 2, torch.bfloat16, seq_lens=(2, 77, 1100), per_head_scale=True),
     Features(0, 0.0, True)),
    (paged_tests.Case("fp8_e4m3", 80, 16, 6, 2, torch.float32, seq_lens=(20, 64, 65, 97)), Features(32, 3.0, True)),
]


@pytest.mark.parametrize("case,features", CASES, ids=lambda c: c.id())
def test_features_match_the_reference(ops, case, features):
    b = paged_tests.build(case)
    ops.reshape_and_cache(b["key"], b["value"], *b["op_caches"], b["slot_mapping"], format_code(case.kv, "cpu"),
                          b["k_scale"], b["v_scale"])
    want = attend(ref, case, b["ref_caches"], b, features)
    got = attend(ops, case, b["op_caches"], b, features)
    plain = attend(ref, case, b["ref_caches"], b, Features())
    assert attention_error(want, plain) > 3 * paged_tests.tolerance(case.dtype), "the features change nothing here"
    err = attention_error(got, want)
    assert err <= paged_tests.tolerance(case.dtype), f"max error {err:.2e} of the output scale"


def test_blocks_before_a_sliding_window_are_never_read(ops):
    """Blocks wholly before each sequence's window hold -1 in the block table, as an engine that frees them
    leaves it (an id the op would refuse if it read it): the output is the reference's over the window. (The
    positions before the window in its first block are the sequence's own K/V, read with weight 0.)"""
    case = paged_tests.Case("fp8_e4m3", 64, 16, 8, 2, torch.bfloat16, seq_lens=(50, 100), padding=0)
    window = 20
    b = paged_tests.build(case)
    ops.reshape_and_cache(b["key"], b["value"], *b["op_caches"], b["slot_mapping"], format_code(case.kv, "cpu"),
                          b["k_scale"], b["v_scale"])
    want = attend(ref, case, b["op_caches"], b, Features(window))
    table = b["table"].clone()
    for s, length in enumerate(case.seq_lens):
        table[s, : (length - window) // case.block_size] = -1
    assert (table == -1).sum() == 1 + 5
    b["table"] = table
    got = attend(ops, case, b["op_caches"], b, Features(window))
    assert attention_error(got, want) <= paged_tests.tolerance(case.dtype)
    with pytest.raises(RuntimeError, match="outside"):  # without the window those ids are read, and refused
        attend(ops, case, b["op_caches"], b, Features())


WINDOW_CASE = window_tests.WindowCase("fp8_e4m3", torch.bfloat16, 32, 64, 16, 8, 2, torch.float32,
                                      seq_lens=(5, 31, 32, 33, 47, 48, 49, 90, 600))


@pytest.mark.parametrize("features", [Features(16), Features(48, 0.0, True), Features(0, 2.5), Features(40, 1.0, True)],
                         ids=Features.id)
def test_features_with_the_recent_window_ring(ops, features):
    """A sliding window shorter and longer than the full-precision ring of the newest tokens
    (--kv-recent-window): both sources agree on which positions count."""
    case = WINDOW_CASE
    b = window_tests.build(case)
    sinks = sinks_for(case.heads, 3) if features.sinks else None
    extra = (features.sliding_window, features.logit_softcap, sinks)

    def run(impl):
        out = torch.full(b["query"].shape, 7.0, dtype=case.dtype)
        (kc, vc), (wk, wv) = b["caches"], b["window_caches"]
        impl.paged_attention_window(out, b["query"], kc, vc, wk, wv, case.kv_heads, case.head_size ** -0.5,
                                    b["table"], b["window_table"], b["seq_lens"], b["window_starts"],
                                    case.window_size, case.block_size, max(case.lens()), b["alibi"],
                                    format_code(case.kv, "cpu"), b["k_scale"], b["v_scale"], *extra)
        return out

    want, got = run(ref), run(ops)
    err = attention_error(got, want)
    assert err <= paged_tests.tolerance(case.dtype), f"max error {err:.2e} of the output scale"


@pytest.mark.parametrize("bad,message", [({"sliding_window": -1}, "sliding_window"),
                                         ({"logit_softcap": float("nan")}, "logit_softcap"),
                                         ({"logit_softcap": -2.0}, "logit_softcap"),
                                         ({"sinks": torch.zeros(3)}, "sinks")])
def test_bad_feature_arguments_are_refused(ops, bad, message):
    case = paged_tests.Case("fp8_e4m3", 64, 16, 8, 2, torch.float32, seq_lens=(10,))
    b = paged_tests.build(case)
    args = {"sliding_window": 0, "logit_softcap": 0.0, "sinks": None} | bad
    out = torch.empty_like(b["query"])
    with pytest.raises(RuntimeError, match=message):
        ops.paged_attention(out, b["query"], *b["op_caches"], case.kv_heads, 0.125, b["table"], b["seq_lens"],
                            case.block_size, 10, None, format_code(case.kv, "cpu"), b["k_scale"], b["v_scale"],
                            args["sliding_window"], args["logit_softcap"], args["sinks"])
