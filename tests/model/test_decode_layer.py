"""torch.ops.fp8kv.decode_layer: a decoder layer of a decode step in one compiled call. It must give bitwise the
logits of the Python fused-layer sequence (the same kernels in the same order), agree with transformers' own
forward, and run only where it applies (decode-only steps, packed layers)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from numerics import assert_logits_close
from test_model_runner import hf_logits
from test_recent_window import RingSeq, merged, prompt_ids

from fp8cache.config import EngineConfig
from fp8cache.kvcache.formats import CacheFormat
from fp8cache.model import fused_layer
from fp8cache.model.cpu import decode_layer, packed_linear
from fp8cache.model.loader import load_model
from fp8cache.model.runner import ModelRunner

BLOCK = 16


LAYOUTS = ["panels-float32", "panels-bfloat16", "onednn-float32", "onednn-bfloat16"]


@pytest.fixture
def panels(monkeypatch):
    """Every float32 projection packed into fp8kv's panels (the probe would decide by speed; the kernels'
    portable paths keep this correct on any CPU)."""
    use_layout(monkeypatch, "panels-float32")


def use_layout(monkeypatch, layout: str) -> str:
    """Packs every projection in `layout`'s way; returns the model dtype. Skips where oneDNN cannot."""
    monkeypatch.setattr(packed_linear, "packing_pays", lambda *a: True)
    packing, dtype = layout.split("-")
    monkeypatch.setattr(packed_linear, "panels_available", lambda *dtype: packing == "panels")
    if packing == "onednn" and not packed_linear.packing_works(getattr(torch, dtype)):
        pytest.skip(f"this torch build or CPU cannot run oneDNN's packed {dtype} linear")
    return dtype


def make_runner(path: str, monkeypatch, native: bool, kv_cache_dtype: str, window: int,
                dtype: str = "float32", **options) -> ModelRunner:
    """native=False: the fused layers' Python sequence of ops instead of the one decode_layer call. options: more
    EngineConfig fields (kv_scales, kv_rotation)."""
    # Its own layers: runners do not share them.
    loaded = load_model(EngineConfig(model=path, dtype=dtype), progress=False)
    config = EngineConfig(model=path, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=BLOCK,
                          kv_cache_memory="16MiB", kv_recent_window=window, max_num_seqs=4, **options)
    with monkeypatch.context() as patch:
        if not native:
            patch.setattr(decode_layer, "_weight_args", lambda layer: None)
        return ModelRunner(config, log=lambda msg: None, loaded=loaded)


def count_native_calls(runner: ModelRunner) -> list[int]:
    """Wraps every layer's decode_layer op with a counter; returns the (live) count."""
    count = [0]
    for layer in runner.model.modules():
        fused = layer.__dict__.get("forward")
        if isinstance(fused, fused_layer.FusedDecoderLayer) and fused.whole_layer is not None:
            op = fused.whole_layer.op

            def counted(*args, _op=op):
                count[0] += 1
                return _op(*args)

            fused.whole_layer = dataclasses.replace(fused.whole_layer, op=counted)
    return count


def sequences(runner: ModelRunner, lengths: tuple[int, ...]) -> list[RingSeq]:
    seqs, first_block = [], 0
    for seat, n in enumerate(lengths):
        seq = RingSeq(runner, prompt_ids(n, seed=seat), first_block=first_block, seat=seat)
        first_block += len(seq.blocks)
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("model_type,config", [("llama", {}), ("qwen2", {}),
                                               ("llama", {"attention_bias": True, "mlp_bias": True}),
                                               ("mistral", {})], ids=["llama", "qwen2", "llama-biases", "mistral"])
@pytest.mark.parametrize("kv_cache_dtype,window", [("fp8_e4m3", 8), ("fp8_e5m2", 0), ("auto", 0)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_layer_is_bitwise_the_python_layer(make_tiny_model, monkeypatch, model_type, config, kv_cache_dtype,
                                                  window, layout):
    """Prefill three sequences (lengths crossing block and window boundaries), then decode them together:
    every decode step's logits equal the Python sequence's bit for bit, and the compiled layer ran for every
    layer of every decode step."""
    dtype = use_layout(monkeypatch, layout)
    path = make_tiny_model(model_type, **config)
    runners = {native: make_runner(path, monkeypatch, native, kv_cache_dtype, window, dtype)
               for native in (False, True)}
    calls = {native: count_native_calls(r) for native, r in runners.items()}
    layers = runners[True].num_layers
    logits = {}
    for native, runner in runners.items():
        seqs = sequences(runner, (21, 40, 17))
        steps = [runner.execute(merged([s.chunk(0, len(s.ids) - 12) for s in seqs]))]
        for back in range(12, 0, -1):
            steps.append(runner.execute(merged([s.chunk(len(s.ids) - back, len(s.ids) - back + 1) for s in seqs])))
        logits[native] = steps
    assert calls[False][0] == 0
    assert calls[True][0] == 12 * layers
    for got, want in zip(logits[True], logits[False]):
        assert torch.equal(got, want), f"max difference {(got - want).abs().max().item()}"
    if kv_cache_dtype == "auto" and dtype == "float32":  # independent: transformers' forward over the sequence
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        for i, n in enumerate((21, 40, 17)):
            assert_logits_close(logits[True][-1][i], hf_logits(hf, prompt_ids(n, seed=i))[-1])


@pytest.mark.parametrize("kv_scales", ["static", "dynamic"])
@pytest.mark.parametrize("kv_cache_dtype,window", [("fp8_e4m3", 8), ("fp8_e5m2", 0)])
@pytest.mark.parametrize("head_dim", [64, 80], ids=["head64", "head80-blocks16"])
@pytest.mark.parametrize("layout", ["panels-float32", "panels-bfloat16"])
def test_decode_layer_rotates_kv_as_the_python_layer(make_tiny_model, monkeypatch, kv_scales, kv_cache_dtype, window,
                                                     head_dim, layout):
    """With the Hadamard kv rotation the compiled layer runs every decode step (it used to fall back) and its
    logits equal the Python layers' (which rotate in attention.attend) bit for bit: the cache the prefill wrote
    rotated is read in the same basis, and the decode tokens are cached rotated as the Python layer caches them."""
    dtype = use_layout(monkeypatch, layout)
    path = make_tiny_model("llama", head_dim=head_dim)
    options = {"kv_scales": kv_scales, "kv_rotation": "hadamard"}
    runners = {native: make_runner(path, monkeypatch, native, kv_cache_dtype, window, dtype, **options)
               for native in (False, True)}
    calls = {native: count_native_calls(r) for native, r in runners.items()}
    logits, caches = {}, {}
    for native, runner in runners.items():
        seqs = sequences(runner, (21, 40))
        steps = [runner.execute(merged([s.chunk(0, len(s.ids) - 6) for s in seqs]))]
        for back in range(6, 0, -1):
            steps.append(runner.execute(merged([s.chunk(len(s.ids) - back, len(s.ids) - back + 1) for s in seqs])))
        logits[native], caches[native] = steps, [c.clone() for c in runner.kv_caches[0]]
    assert calls[False][0] == 0
    assert calls[True][0] == 6 * runners[True].num_layers
    for got, want in zip(logits[True], logits[False]):
        assert torch.equal(got, want), f"max difference {(got - want).abs().max().item()}"
    for got, want in zip(caches[True], caches[False]):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_steps_with_a_prefill_keep_the_python_layer(tiny_llama_path, monkeypatch, panels):
    """A step mixing a prefill chunk with decodes goes through attend() (the compiled layer is for
    decode-only steps) and still matches the runner without the compiled layer."""
    results = []
    for native in (False, True):
        runner = make_runner(tiny_llama_path, monkeypatch, native, "fp8_e4m3", 8)
        calls = count_native_calls(runner)
        a, b = sequences(runner, (30, 25))
        runner.execute(a.chunk(0, 29))
        results.append(runner.execute(merged([a.chunk(29, 30), b.chunk(0, 25)])))
        assert calls[0] == 0
    assert torch.equal(results[0], results[1])


def test_decode_layer_refuses_bad_arguments(tiny_llama_path, monkeypatch, panels):
    runner = make_runner(tiny_llama_path, monkeypatch, True, "fp8_e4m3", 0)
    fused = next(m.__dict__["forward"] for m in runner.model.modules()
                 if isinstance(m.__dict__.get("forward"), fused_layer.FusedDecoderLayer))
    weights, biases, shape, eps = fused.whole_layer.weight_args
    key_cache, value_cache = runner.kv_caches[0]
    hidden = torch.zeros(1, weights[0].shape[0])
    cos = sin = torch.ones(1, runner.head_size)
    rest = (key_cache, value_cache, torch.zeros(1, dtype=torch.long), CacheFormat.E4M3FN, torch.ones(1), torch.ones(1),
            torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1, [], None, None, None, 0)
    op = torch.ops.fp8kv.decode_layer
    with pytest.raises(RuntimeError, match=r"weights must be \[input_norm, qkv, o, post_norm, gate_up, down\]"):
        op(hidden, weights[:5], biases, shape, eps, cos, sin, 0.125, *rest)
    with pytest.raises(RuntimeError, match="hidden must be a contiguous float32 or bfloat16"):
        op(hidden.half(), weights, biases, shape, eps, cos, sin, 0.125, *rest)
    with pytest.raises(RuntimeError, match="the packed weights are Float but hidden is BFloat16"):
        op(hidden.bfloat16(), weights, biases, shape, eps, cos, sin, 0.125, *rest)
    with pytest.raises(RuntimeError, match="packing must be 0"):
        op(hidden, weights, biases, [*shape[:4], 7], eps, cos, sin, 0.125, *rest)
    with pytest.raises(RuntimeError, match="a window needs window_slot_mapping"):
        op(hidden, weights, biases, shape, eps, cos, sin, 0.125, *rest[:9], [key_cache, value_cache], None, None,
           None, 8)
