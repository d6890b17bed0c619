"""Dynamic KV scales (issue 54) through the engine: attention over a step's prefix, chunks and decodes against the
reference ops with scale caches; the runner's decode path (the CPU's whole-layer op) against its prefill path;
prefix caching and the recent window with dynamic scales; what is refused with them and why."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from numerics import assert_logits_close, attention_error
from test_model_runner import BLOCK, TEXT, Seq, make_runner, step

from fp8cache import LLM, SamplingParams, ops
from fp8cache.kvcache import dynamic_scales, sizing
from fp8cache.kvcache.spec import DYNAMIC_SOURCE, KVCacheSpec
from fp8cache.model import attention, forward_context
from fp8cache.model.runner import ModelRunner
from fp8cache.ops import reference


@pytest.fixture(scope="module")
def loaded(default_loaded):
    return default_loaded


@pytest.fixture(scope="module")
def text_ids(loaded):
    return loaded.tokenizer(TEXT)["input_ids"]


@pytest.mark.parametrize("use_compiled", [True, False], ids=["compiled", "reference"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_attention_reads_dynamic_scales_of_prefix_and_chunks(kv_cache_dtype, use_compiled):
    """Every query row of a mixed step equals reference decode attention over the cache and its scale caches, and
    the step writes its own tokens' codes and scales as the reference does."""
    torch.manual_seed(0)
    heads, kv_heads, d, scale = 4, 2, 64, 64 ** -0.5
    caches = [reference.allocate_kv_cache(12, BLOCK, kv_heads, d, kv_cache_dtype, torch.float32)]
    scale_caches = [dynamic_scales.allocate_scale_caches(12, BLOCK, kv_heads)]
    ones = torch.ones(1)
    seqs = [(Seq([0] * 40, [3, 0, 5]), 25, 40), (Seq([0] * 20, [7, 2]), 19, 20), (Seq([0] * 10, [9]), 0, 10)]
    for seq, cached, _ in seqs:  # cached tokens of very different sizes
        size = torch.exp(torch.randn(cached, 1, 1) * 3)
        k, v = torch.randn(cached, kv_heads, d) * size, torch.randn(cached, kv_heads, d) * size
        slots = torch.tensor([seq.slot(p) for p in range(cached)], dtype=torch.long)
        reference.reshape_and_cache(k, v, *caches[0], slots, kv_cache_dtype, ones, ones, *scale_caches[0])
    batch = step(seqs)
    n = len(batch.token_ids)
    q, k, v = torch.randn(n, heads, d), torch.randn(n, kv_heads, d) * 50, torch.randn(n, kv_heads, d) * 0.01
    want_caches = [tuple(t.clone() for t in (*caches[0], *scale_caches[0]))]
    reference.reshape_and_cache(k, v, *want_caches[0][:2], torch.tensor(batch.slot_mapping), kv_cache_dtype, ones,
                                ones, *want_caches[0][2:])
    spec = KVCacheSpec.build(kv_cache_dtype, torch.float32, BLOCK, 1, kv_heads, d, None, dynamic=True)
    ctx = forward_context.build_forward_context(batch, ops if use_compiled else reference, caches, spec,
                                                scale_caches=scale_caches)
    out, _ = attention.paged_attention_forward(
        SimpleNamespace(layer_idx=0), q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        None, scaling=scale, **{forward_context.CONTEXT_KWARG: ctx})
    for got, want in zip((*caches[0], *scale_caches[0]), want_caches[0]):
        assert torch.equal(got, want)
    row = 0
    for seq, start, end in seqs:
        table = torch.tensor([seq.blocks], dtype=torch.int32)
        for pos in range(start, end):
            want = torch.empty(1, heads, d)
            reference.paged_attention(want, q[row][None], *caches[0], kv_heads, scale, table,
                                      torch.tensor([pos + 1], dtype=torch.int32), BLOCK, pos + 1, None,
                                      kv_cache_dtype, ones, ones, 0, 0.0, None, *scale_caches[0])
            assert attention_error(out[0, row], want[0]) <= 2e-5  # of the output's scale, as tests/ops hold it
            row += 1


@pytest.mark.parametrize("kv_rotation", ["auto", "none"])
def test_decode_and_prefix_cache_agree_with_prefill(loaded, text_ids, kv_rotation):
    """With dynamic scales, the decode path (the whole-layer op without rotation, the lean layers with it), a prefix
    read from another sequence's blocks and prefill all read the same codes and scales: their logits match."""
    runner = make_runner(loaded, "fp8_e4m3", kv_scales="dynamic", kv_rotation=kv_rotation)
    assert runner.kv_spec.dynamic_scales and runner.scales_source == DYNAMIC_SOURCE
    assert runner.kv_rotation == ("hadamard" if kv_rotation == "auto" else "none")  # d64: a power of two
    n = 40
    whole = runner.execute(step([(Seq(text_ids[:n], [0, 1, 2]), 0, n)]), all_logits=True)
    decoded = Seq(text_ids[:n], [3, 4, 5])
    runner.execute(step([(decoded, 0, n - 3)]))
    rows = [runner.execute(step([(decoded, p, p + 1)]), all_logits=True)[0] for p in range(n - 3, n)]
    assert_logits_close(torch.stack(rows), whole[n - 3:], atol=1e-3)
    shared = Seq(text_ids[:n], [0, 1, 6])  # blocks 0 and 1 hold its first 32 tokens already
    cached = runner.execute(step([(shared, 2 * BLOCK, n)]), all_logits=True)
    assert_logits_close(cached, whole[2 * BLOCK:], atol=1e-3)


def test_dynamic_scales_stay_close_to_auto_and_count_their_bytes(loaded, text_ids):
    seq = Seq(text_ids, list(range(8)))
    auto = make_runner(loaded).execute(step([(seq, 0, len(seq.ids))]), all_logits=True)
    runner = make_runner(loaded, "fp8_e4m3", kv_scales="dynamic")
    fp8 = runner.execute(step([(seq, 0, len(seq.ids))]), all_logits=True)
    assert (auto.argmax(-1) == fp8.argmax(-1)).float().mean().item() >= 0.9
    layers, heads, d = runner.num_layers, runner.num_kv_heads, runner.head_size
    assert runner.bytes_per_token == 2 * layers * heads * d + 2 * layers * heads * 2  # a bfloat16 scale each
    assert runner.bytes_per_token == sizing.bytes_per_token(layers, heads, d, "fp8_e4m3", torch.float32,
                                                            dynamic=True)
    assert [tuple(t.shape) for t in runner.scale_caches[0]] == [(runner.num_blocks, heads, BLOCK)] * 2


def test_recent_window_with_dynamic_scales(loaded, text_ids):
    """The window's handover: positions that leave the ring are read from FP8 with their own scales."""
    runner = make_runner(loaded, "fp8_e4m3", kv_scales="dynamic", kv_recent_window=8, max_num_seqs=2)
    plain = make_runner(loaded, "fp8_e4m3", kv_scales="dynamic", kv_recent_window=0)
    assert runner.kv_spec.window_size == 8
    from fp8cache.quality.eval import runner_batch

    ids = text_ids[:48]
    windowed = runner.execute(runner_batch(ids, runner), all_logits=True)
    fp8_only = plain.execute(runner_batch(ids, plain), all_logits=True)
    auto = make_runner(loaded).execute(runner_batch(ids, plain), all_logits=True)
    # the window reads the newest 8 tokens in full precision: closer to auto than FP8 alone
    assert float((windowed - auto).abs().mean()) < float((fp8_only - auto).abs().mean())
    assert_logits_close(windowed[:1], auto[:1], atol=1e-3)  # position 0 reads only itself, from the window


@pytest.mark.parametrize("flag,kw", [("--quantization-param-path", "quantization_param_path"),
                                     ("--calculate-kv-scales", "calculate_kv_scales")])
def test_static_scale_sources_are_refused_with_dynamic_scales(loaded, tmp_path, flag, kw):
    value = True
    if kw == "quantization_param_path":
        value = str(tmp_path / "scales.json")
        (tmp_path / "scales.json").write_text('{"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {}}}')
    with pytest.raises(ValueError, match=f"--kv-scales dynamic .*{flag}.*--kv-scales static"):
        make_runner(loaded, "fp8_e4m3", kv_scales="dynamic", **{kw: value})


def test_dynamic_scales_with_auto_cache_are_a_note_and_unknown_values_an_error(loaded):
    notes = []
    config_runner = make_runner(loaded, "auto", kv_scales="dynamic")
    assert not config_runner.kv_spec.dynamic_scales and config_runner.scale_caches is None
    with pytest.raises(ValueError, match="kv_scales='per-token' is not known; valid choices: static, dynamic"):
        make_runner(loaded, "fp8_e4m3", kv_scales="per-token")
    runner = SimpleNamespace(config=SimpleNamespace(kv_scales="dynamic"), log=notes.append,
                             device=torch.device("cpu"))
    assert not ModelRunner._resolve_dynamic_scales(runner, "auto") and "ignored" in notes[0]


def test_rotation_is_for_dynamic_scales_and_refuses_what_it_cannot_rotate():
    notes = []
    runner = SimpleNamespace(config=SimpleNamespace(kv_rotation="hadamard"), log=notes.append, dynamic_scales=False,
                             head_size=64)
    assert ModelRunner._resolve_dynamic_rotation(runner) == "none" and "scales file" in notes[0]
    runner.dynamic_scales, runner.head_size = True, 36  # 36 = 4 x 9: no Hadamard block of 8 or more
    with pytest.raises(ValueError, match="none"):
        ModelRunner._resolve_dynamic_rotation(runner)
    runner.config.kv_rotation = "auto"
    assert ModelRunner._resolve_dynamic_rotation(runner) == "none"  # auto: rotate only where it can
    runner.config.kv_rotation = "sideways"
    with pytest.raises(ValueError, match="not one of auto, none, hadamard"):
        ModelRunner._resolve_dynamic_rotation(runner)


def test_gpu_device_takes_dynamic_scales():
    """The CUDA/HIP kernels read and write the scale caches (tests/ops/test_cuda_*_emulation.py, test_ops_cuda.py)."""
    runner = SimpleNamespace(config=SimpleNamespace(kv_scales="dynamic", quantization_param_path=None,
                                                    calculate_kv_scales=False),
                             log=print, device=torch.device("cuda", 0))
    assert ModelRunner._resolve_dynamic_scales(runner, "fp8_e4m3") is True


def test_prefix_cache_fingerprint_tells_dynamic_from_static():
    from fp8cache.kvcache import scales

    static = KVCacheSpec.build("fp8_e4m3", torch.float32, BLOCK, 2, 2, 64, scales.ones(2, "fp8_e4m3"))
    dynamic = KVCacheSpec.build("fp8_e4m3", torch.float32, BLOCK, 2, 2, 64, None, dynamic=True)
    assert static.fingerprint != dynamic.fingerprint and not dynamic.scales_pending
    with pytest.raises(ValueError, match="dynamic KV scales replace static ones"):
        KVCacheSpec.build("fp8_e4m3", torch.float32, BLOCK, 2, 2, 64, scales.ones(2, "fp8_e4m3"), dynamic=True)


def test_llm_generates_with_dynamic_scales(default_model_path):
    llm = LLM(model=default_model_path, kv_cache_dtype="fp8", kv_scales="dynamic", dtype="float32",
              max_model_len=128, max_num_seqs=2, kv_recent_window=0, log=lambda msg: None)
    auto = LLM(model=default_model_path, dtype="float32", max_model_len=128, max_num_seqs=2, log=lambda msg: None)
    prompt = ["The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy"]
    params = SamplingParams(temperature=0, max_tokens=4)
    assert llm.generate(prompt, params)[0].outputs[0].text == auto.generate(prompt, params)[0].outputs[0].text
