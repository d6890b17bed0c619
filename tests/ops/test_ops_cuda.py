"""The CUDA ops (csrc/cuda/) on a GPU against the same pure-torch reference as the CPU tests.

Each case is built on the CPU exactly as in test_ops_cpu.py / test_window_ops.py / test_hadamard_op.py (window
sinks: test_cuda_window_emulation.py), the reference runs there, and the op runs on copies of the inputs on the
GPU with the same strides (so strided inputs stay strided). Skipped where torch sees no GPU, which is every CI
machine: these tests are for a machine with one (`scripts/gpu_check.sh`).
"""

from __future__ import annotations

import pytest
import test_attention_features as feature_tests
import test_cuda_window_emulation as sink_tests
import test_dynamic_scales as dynamic_tests
import test_hadamard_op as hadamard_tests
import test_ops_cpu as paged_tests
import test_window_ops as window_tests
import torch
from numerics import attention_error

from fp8cache.kvcache import dynamic_scales
from fp8cache.ops import format_code
from fp8cache.ops import reference as ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible to torch (CUDA or ROCm)")

GPU = "cuda"


@pytest.fixture(scope="module")
def ops():
    from fp8cache.ops import _build, load

    ops = load()
    assert _build.last_build().with_cuda, "the op library was built without its CUDA sources"
    return ops


def on_gpu(value):
    """The same tensor on the GPU with the same sizes and strides; tuples mapped, anything else kept."""
    if isinstance(value, tuple):
        return tuple(on_gpu(v) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    copy = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=GPU)
    copy.copy_(value)
    return copy


def gpu_inputs(b: dict) -> dict:
    return {name: on_gpu(value) for name, value in b.items()}


# ---- reshape_and_cache + paged_attention ---------------------------------------------------------------

def gpu_takes(case) -> bool:
    """Whether the GPU kernels take a case's head size: multiples of 16 up to 256, and multiples of 8 up to 128
    for 16-bit caches on tensor cores (sm_80+). The CPU takes any."""
    if case.head_size % 16 == 0:
        return case.head_size <= 256
    sixteen_bit = case.kv == "auto" and case.dtype in (torch.bfloat16, torch.float16)
    return sixteen_bit and case.head_size % 8 == 0 and case.head_size <= 128 and \
        torch.cuda.get_device_capability()[0] >= 8 and not torch.version.hip


@pytest.mark.parametrize("case", paged_tests.CASES, ids=paged_tests.Case.id)
def test_paged_ops_match_reference(ops, case):
    b = paged_tests.build(case)
    g = gpu_inputs(b)
    ops.reshape_and_cache(g["key"], g["value"], *g["op_caches"], g["slot_mapping"], format_code(case.kv, g["key"].device), g["k_scale"],
                          g["v_scale"])
    for mine, theirs in zip(g["op_caches"], b["ref_caches"]):
        assert torch.equal(mine.cpu().view(torch.uint8), theirs.view(torch.uint8)), "cache bytes differ"
    if not gpu_takes(case):  # refused with the reason and the fix, never a wrong answer
        with pytest.raises(RuntimeError, match=f"head_size {case.head_size} is not supported by the GPU kernels"):
            paged_tests.attention(ops, case, g["op_caches"], g)
        return
    want = paged_tests.attention(ref, case, b["ref_caches"], b)
    got = paged_tests.attention(ops, case, g["op_caches"], g).cpu()
    assert got.dtype == case.dtype
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    err = attention_error(got, want)
    print(f"{case.id()}: max error {err:.2e} of the output scale")
    assert err <= paged_tests.tolerance(case.dtype), f"max error {err:.2e} of the output scale"


def test_out_of_range_slot_raises_and_skips_that_token(ops):
    """The GPU kernel cannot see the whole batch before writing: it skips the bad slot, writes the rest, and
    the op raises afterwards (csrc/cuda/torch_bindings_cuda.cu)."""
    case = paged_tests.Case("fp8_e4m3", 64, 16, 4, 2, seq_lens=(20,))
    b = paged_tests.build(case)
    g = gpu_inputs(b)
    g["slot_mapping"][-1] = g["op_caches"][0].shape[0] * case.block_size
    with pytest.raises(RuntimeError, match="slot_mapping holds a slot"):
        ops.reshape_and_cache(g["key"], g["value"], *g["op_caches"], g["slot_mapping"], format_code(case.kv, g["key"].device), g["k_scale"],
                              g["v_scale"])
    skipped = b["slot_mapping"].clone()
    skipped[-1] = -1
    ref.reshape_and_cache(b["key"], b["value"], *b["op_caches"], skipped, case.kv, b["k_scale"], b["v_scale"])
    for mine, theirs in zip(g["op_caches"], b["op_caches"]):
        assert torch.equal(mine.cpu(), theirs)


@pytest.mark.parametrize("bad_id", [-1, 10_000])
def test_out_of_range_block_id_raises(ops, bad_id):
    case = paged_tests.Case("fp8_e5m2", 64, 16, 4, 2, seq_lens=(40,))
    g = gpu_inputs(paged_tests.build(case))
    g["table"][0, 1] = bad_id
    with pytest.raises(RuntimeError, match="outside the cache's blocks"):
        paged_tests.attention(ops, case, g["ref_caches"], g)


def test_inputs_on_the_wrong_device_raise(ops):
    case = paged_tests.Case("fp8_e4m3", 64, 16, 4, 2, seq_lens=(10,))
    b = paged_tests.build(case)
    g = gpu_inputs(b)
    with pytest.raises(RuntimeError, match="is on cpu but the caches are on cuda"):
        ops.reshape_and_cache(b["key"], b["value"], *g["op_caches"], g["slot_mapping"], format_code(case.kv, g["key"].device), g["k_scale"],
                              g["v_scale"])


# ---- paged_attention_window -----------------------------------------------------------------------------

@pytest.mark.parametrize("case", window_tests.CASES, ids=window_tests.WindowCase.id)
def test_window_attention_matches_reference(ops, case):
    b = window_tests.build(case)
    want = window_tests.attention(ref, case, b)
    got = window_tests.attention(ops, case, gpu_inputs(b)).cpu()
    print(f"{case.id()}: max error {attention_error(got, want):.2e} of the output scale")
    window_tests.assert_close(got, want, case.dtype)


def test_window_start_out_of_range_raises(ops):
    g = gpu_inputs(window_tests.build(window_tests.SMALL))
    g["window_starts"][0] = 41
    with pytest.raises(RuntimeError, match="window_starts"):
        window_tests.attention(ops, window_tests.SMALL, g)


# ---- sliding windows, soft-capping, sinks ---------------------------------------------------------------

@pytest.mark.parametrize("case,features", feature_tests.CASES, ids=lambda c: c.id())
def test_features_match_the_reference(ops, case, features):
    """The CPU feature cases (test_attention_features.py) on the GPU kernels: windows around the tiles' edges,
    soft caps, sinks merged by the reduce kernel."""
    b = paged_tests.build(case)
    g = gpu_inputs(b)
    ops.reshape_and_cache(g["key"], g["value"], *g["op_caches"], g["slot_mapping"],
                          format_code(case.kv, g["key"].device), g["k_scale"], g["v_scale"])
    if not gpu_takes(case):
        with pytest.raises(RuntimeError, match=f"head_size {case.head_size} is not supported by the GPU kernels"):
            feature_tests.attend(ops, case, g["op_caches"], g, features)
        return
    want = feature_tests.attend(ref, case, b["ref_caches"], b, features)
    got = feature_tests.attend(ops, case, g["op_caches"], g, features).cpu()
    err = attention_error(got, want)
    print(f"{case.id()}-{features.id()}: max error {err:.2e} of the output scale")
    assert err <= paged_tests.tolerance(case.dtype), f"max error {err:.2e} of the output scale"


def test_blocks_before_a_sliding_window_are_never_read(ops):
    """-1 block ids before each sequence's window (an engine that freed them): never looked up on the GPU either."""
    case = paged_tests.Case("fp8_e4m3", 64, 16, 8, 2, torch.bfloat16, seq_lens=(50, 100), padding=0)
    window = 20
    b = paged_tests.build(case)
    want = feature_tests.attend(ref, case, b["ref_caches"], b, feature_tests.Features(window))
    for s, length in enumerate(case.seq_lens):
        b["table"][s, : (length - window) // case.block_size] = -1
    g = gpu_inputs(b)
    got = feature_tests.attend(ops, case, g["ref_caches"], g, feature_tests.Features(window)).cpu()
    assert attention_error(got, want) <= paged_tests.tolerance(case.dtype)
    with pytest.raises(RuntimeError, match="outside"):
        feature_tests.attend(ops, case, g["ref_caches"], g, feature_tests.Features())


@pytest.mark.parametrize("features", [feature_tests.Features(16), feature_tests.Features(48, 0.0, True),
                                      feature_tests.Features(40, 1.0, True)], ids=feature_tests.Features.id)
def test_features_with_the_recent_window_ring(ops, features):
    case = feature_tests.WINDOW_CASE
    b = window_tests.build(case)
    sinks = feature_tests.sinks_for(case.heads, 3) if features.sinks else None

    def run(impl, b):
        out = torch.full(b["query"].shape, 7.0, dtype=case.dtype, device=b["query"].device)
        (kc, vc), (wk, wv) = b["caches"], b["window_caches"]
        impl.paged_attention_window(out, b["query"], kc, vc, wk, wv, case.kv_heads, case.head_size ** -0.5,
                                    b["table"], b["window_table"], b["seq_lens"], b["window_starts"],
                                    case.window_size, case.block_size, max(case.lens()), b["alibi"],
                                    format_code(case.kv, b["query"].device), b["k_scale"], b["v_scale"],
                                    features.sliding_window, features.logit_softcap,
                                    None if sinks is None else sinks.to(b["query"].device))
        return out

    want, got = run(ref, b), run(ops, gpu_inputs(b)).cpu()
    err = attention_error(got, want)
    assert err <= paged_tests.tolerance(case.dtype), f"max error {err:.2e} of the output scale"


# ---- window sinks: the ring's first seats hold positions [0, window_sinks) (issue 54) -------------------------
# The host emulation's cases (test_cuda_window_emulation.py): sinks beside every window start, sequences shorter
# than the sinks, long sequences (several paged splits), a window of several ring splits, dynamic scales.

def sinks_attention(impl, case, b: dict, window_sinks: int | None = None) -> torch.Tensor:
    out = torch.full(b["query"].shape, 7.0, dtype=case.dtype, device=b["query"].device)
    (kc, vc), (wk, wv) = b["caches"], b["window_caches"]
    impl.paged_attention_window(out, b["query"], kc, vc, wk, wv, case.num_kv_heads, case.head_size ** -0.5,
                                b["table"], b["window_table"], b["seq_lens"], b["window_starts"], case.window_size,
                                case.block_size, max(case.lens()), b["alibi"],
                                format_code(case.kv_cache_dtype, b["query"].device), b["k_scale"], b["v_scale"],
                                b.get("sliding_window", 0), b.get("logit_softcap", 0.0), b.get("sinks"),
                                b["k_scale_cache"], b["v_scale_cache"],
                                case.window_sinks if window_sinks is None else window_sinks)
    return out


def assert_sinks_match_reference(ops, case, b: dict) -> None:
    want, got = sinks_attention(ref, case, b), sinks_attention(ops, case, gpu_inputs(b)).cpu()
    assert not torch.isnan(want).any() and not torch.isnan(got).any()
    # dynamic cases' outputs span their values' 1e-3 .. 1e3: each row on its own scale
    size = want.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-30) if case.dynamic else 1.0
    err = float(((got.float() - want.float()).abs() / size).max())
    assert err <= paged_tests.tolerance(case.dtype), f"max error {err:.2e} of the output scale"


@pytest.mark.parametrize("case", sink_tests.SINK_CASES, ids=sink_tests.WindowCase.id)
def test_window_sinks_match_reference(ops, case):
    assert_sinks_match_reference(ops, case, sink_tests.build(case))


@pytest.mark.parametrize("sliding_window", [38, 30, 12, 2])
def test_window_sinks_with_a_sliding_window(ops, sliding_window):
    """A sliding window that begins inside the sinks, between them and the window start, past the window start."""
    case = sink_tests.WindowCase("fp8_e4m3", torch.bfloat16, 16, 64, 8, 4, 2, torch.float32,
                                 seq_lens=(40, 40, 40, 20, 3), alibi=True, window_sinks=3)
    b = sink_tests.build(case)
    b["sliding_window"] = sliding_window
    assert_sinks_match_reference(ops, case, b)


def test_window_sinks_with_soft_capping_and_sink_logits(ops):
    case = sink_tests.WindowCase("fp8_e5m2", torch.bfloat16, 16, 64, 16, 6, 2, torch.float32,
                                 seq_lens=(300, 40, 20, 2), alibi=True, dynamic=True, window_sinks=3)
    b = sink_tests.build(case)
    b["sliding_window"], b["logit_softcap"] = 299, 2.0
    b["sinks"] = torch.randn(case.num_heads, generator=torch.Generator().manual_seed(1))
    assert_sinks_match_reference(ops, case, b)


def test_window_sinks_are_checked(ops):
    case = sink_tests.WindowCase("fp8_e4m3", torch.bfloat16, 16, 64, 16, 4, 2, torch.float32, seq_lens=(40, 10),
                                 window_sinks=3)
    g = gpu_inputs(sink_tests.build(case))
    with pytest.raises(RuntimeError, match="window_sinks = -1 must be >= 0"):
        sinks_attention(ops, case, g, window_sinks=-1)
    g["window_table"] = g["window_table"][:, :1].contiguous()  # room for 16 seats, not 3 + 16
    with pytest.raises(RuntimeError, match="window_sinks \\+ window_size = 3 \\+ 16 seats needs 2 blocks"):
        sinks_attention(ops, case, g)


# ---- hadamard_transform ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", hadamard_tests.DTYPES, ids=str)
@pytest.mark.parametrize("head_size", hadamard_tests.HEAD_SIZES + [8, 24, 512, 1024])
def test_hadamard_matches_reference(ops, head_size, dtype):
    x = hadamard_tests.activations(37, 4, head_size, dtype=dtype, seed=head_size)
    y = ops.hadamard_transform(on_gpu(x))
    assert y.is_cuda
    hadamard_tests.assert_matches_reference(y.cpu(), x)


@pytest.mark.parametrize("name", list(hadamard_tests.strided_views()))
def test_hadamard_non_contiguous_input(ops, name):
    x = hadamard_tests.strided_views()[name]
    hadamard_tests.assert_matches_reference(ops.hadamard_transform(on_gpu(x)).cpu(), x)


# ---- what the GPU kernels take beyond the CPU test cases ------------------------------------------------

# Any head size that is a multiple of 16 up to 256, any GQA group (the kernels group every ratio's heads).
MORE_CASES = [
    paged_tests.Case("fp8_e4m3", 32, 16, 6, 2, torch.bfloat16),
    paged_tests.Case("fp8_e5m2", 48, 8, 7, 1, torch.float16, per_head_scale=True),
    paged_tests.Case("fp8_e4m3", 160, 16, 12, 1, torch.bfloat16, seq_lens=(700, 3)),
    paged_tests.Case("auto", 192, 32, 4, 2, torch.float32, alibi=True),
    paged_tests.Case("fp8_e4m3fnuz", 128, 16, 28, 4, torch.bfloat16, seq_lens=(5000, 1, 64)),
]


@pytest.mark.parametrize("case", MORE_CASES, ids=paged_tests.Case.id)
def test_more_head_sizes_and_groups_match_reference(ops, case):
    test_paged_ops_match_reference(ops, case)


def test_deferred_error_flag_collects_without_a_wait(ops):
    """An engine's step hands the ops one flag (set_gpu_error_flag): a bad block id is skipped and reported there,
    and the op returns without reading it back."""
    case = paged_tests.Case("fp8_e5m2", 64, 16, 4, 2, seq_lens=(40,))
    g = gpu_inputs(paged_tests.build(case))
    g["table"][0, 1] = 10_000
    flag = torch.zeros(1, dtype=torch.int32, device=GPU)
    ops.set_gpu_error_flag(flag)
    try:
        paged_tests.attention(ops, case, g["ref_caches"], g)  # no raise
        assert int(flag.item()) & 2
    finally:
        ops.set_gpu_error_flag(None)
    with pytest.raises(RuntimeError, match="outside the cache's blocks"):
        paged_tests.attention(ops, case, g["ref_caches"], g)


def test_attention_replays_from_a_cuda_graph(ops):
    """Captured once for a max length, replayed with other lengths and cache contents: the eager op's results."""
    case = paged_tests.Case("fp8_e4m3", 64, 16, 9, 3, torch.bfloat16, seq_lens=(300, 17, 120))
    b = paged_tests.build(case)
    g = gpu_inputs(b)
    caches, out = g["op_caches"], torch.empty_like(g["query"])
    flag = torch.zeros(1, dtype=torch.int32, device=GPU)
    ops.set_gpu_error_flag(flag)
    try:
        def run():
            ops.paged_attention(out, g["query"], caches[0], caches[1], case.kv_heads, case.head_size ** -0.5,
                                g["table"], g["seq_lens"], case.block_size, 512, None,
                                format_code(case.kv, g["query"].device), g["k_scale"], g["v_scale"])

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        for lens in ((300, 17, 120), (1, 17, 64), (0, 5, 120), (299, 1, 1)):
            g["seq_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
            graph.replay()
            replayed = out.clone()
            run()
            assert torch.equal(replayed, out)
        assert int(flag.item()) == 0
    finally:
        ops.set_gpu_error_flag(None)


LAYER_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", LAYER_DTYPES, ids=str)
def test_layer_ops_match_reference(ops, dtype):
    """RMSNorm, residual add + RMSNorm, rotary and SiLU-and-mul on the GPU: transformers' formulas (the
    reference) up to float32 summation order, on the strided views the fused layer hands them."""
    gen = torch.Generator().manual_seed(3)
    tokens, hidden, heads, kv_heads, d = 37, 576, 9, 3, 64
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]

    def close(got, want):
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=tol, atol=tol)

    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    want = torch.empty_like(x)
    ref.rms_norm(want, x, weight, 1e-5)
    got = torch.empty_like(on_gpu(x))
    ops.rms_norm(got, on_gpu(x), on_gpu(weight), 1e-5)
    close(got, want)

    residual = torch.randn(tokens, hidden, generator=gen).to(dtype)
    want_x, want_r = x.clone(), residual.clone()
    ref.fused_add_rms_norm(want_x, want_r, weight, 1e-5)
    got_x, got_r = on_gpu(x), on_gpu(residual)
    ops.fused_add_rms_norm(got_x, got_r, on_gpu(weight), 1e-5)
    close(got_r, want_r)
    close(got_x, want_x)

    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)  # one projection's output
    angles = torch.rand(tokens, d // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    want_qkv = qkv.clone()
    ref.rotary_embedding_cos_sin(want_qkv[:, :heads * d].view(tokens, heads, d),
                                 want_qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d), cos, sin)
    got_qkv = on_gpu(qkv)
    ops.rotary_embedding_cos_sin(got_qkv[:, :heads * d].view(tokens, heads, d),
                                 got_qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d),
                                 on_gpu(cos), on_gpu(sin))
    close(got_qkv, want_qkv)

    gate_up = torch.randn(tokens, 2 * 1536, generator=gen).to(dtype)
    want = torch.empty(tokens, 1536, dtype=dtype)
    ref.silu_and_mul(want, gate_up[:, :1536], gate_up[:, 1536:])
    g = on_gpu(gate_up)
    got = torch.empty(tokens, 1536, dtype=dtype, device=GPU)
    ops.silu_and_mul(got, g[:, :1536], g[:, 1536:])
    close(got, want)


# ---- dynamic KV scales (issue 54) ----------------------------------------------------------------------------

def dynamic_write(impl, case, b: dict, code: int, device: str):
    caches = on_gpu(ref.allocate_kv_cache(b["num_blocks"], case.block_size, case.kv_heads, case.head_size, case.kv,
                                          case.dtype)) if device == GPU else \
        ref.allocate_kv_cache(b["num_blocks"], case.block_size, case.kv_heads, case.head_size, case.kv, case.dtype)
    scale_caches = dynamic_scales.allocate_scale_caches(b["num_blocks"], case.block_size, case.kv_heads, device)
    ones = torch.ones(1, device=device)
    impl.reshape_and_cache(b["key"], b["value"], *caches, b["slots"], code, ones, ones, *scale_caches)
    return caches, scale_caches


def dynamic_attention(impl, case, b: dict, code: int, caches, scale_caches) -> torch.Tensor:
    out = torch.full_like(b["query"], 7.0)
    device = b["query"].device
    # static scales far from 1: dynamic scales replace them, so they must not count
    k_scale, v_scale = torch.full((1,), 1e3, device=device), torch.full((case.kv_heads,), 1e-3, device=device)
    impl.paged_attention(out, b["query"], *caches, case.kv_heads, case.head_size ** -0.5, b["table"], b["seq_lens"],
                         case.block_size, max(case.seq_lens), b["alibi"], code, k_scale, v_scale, 0, 0.0, None,
                         *scale_caches)
    return out


@pytest.mark.parametrize("case", dynamic_tests.DYNAMIC_CASES, ids=paged_tests.Case.id)
def test_dynamic_scales_match_reference(ops, case):
    """The cache write's codes and scales bit for bit, and attention (CUDA cores or tensor cores) reading them."""
    code = format_code(case.kv, torch.device(GPU))  # "fp8" is E4M3FNUZ on ROCm: the reference codes the same
    b = dynamic_tests.build(case)
    g = gpu_inputs(b)
    want_caches, want_scales = dynamic_write(ref, case, b, code, "cpu")
    got_caches, got_scales = dynamic_write(ops, case, g, code, GPU)
    for got, want in zip((*got_caches, *got_scales), (*want_caches, *want_scales)):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), "cache or scale bytes differ"
    want = dynamic_attention(ref, case, b, code, want_caches, want_scales)
    got = dynamic_attention(ops, case, g, code, got_caches, got_scales).cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    err = attention_error(got, want)
    print(f"{case.id()} dynamic: max error {err:.2e} of the output scale")
    assert err <= paged_tests.tolerance(case.dtype), f"max error {err:.2e} of the output scale"


def test_bad_scale_caches_raise_on_the_gpu(ops):
    kc, vc = on_gpu(ref.allocate_kv_cache(4, 16, 2, 64, "fp8_e4m3", torch.float32))
    k_sc, v_sc = dynamic_scales.allocate_scale_caches(4, 16, 2, GPU)
    x, slots, one = torch.randn(3, 2, 64, device=GPU), torch.arange(3, device=GPU), torch.ones(1, device=GPU)
    code = format_code("fp8_e4m3", torch.device(GPU))
    with pytest.raises(RuntimeError, match="both k_scale_cache and v_scale_cache"):
        ops.reshape_and_cache(x, x, kc, vc, slots, code, one, one, k_sc, None)
    with pytest.raises(RuntimeError, match=r"k_scale_cache must be bfloat16 \[num_blocks=4"):
        ops.reshape_and_cache(x, x, kc, vc, slots, code, one, one, k_sc[:, :, :8].contiguous(), v_sc)
    with pytest.raises(RuntimeError, match="is on cpu but the caches are on"):
        ops.reshape_and_cache(x, x, kc, vc, slots, code, one, one, k_sc.cpu(), v_sc)
