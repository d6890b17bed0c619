"""The fused decoder-layer forward (fp8cache/model/fused_layer.py) and its compiled elementwise ops, against
transformers' own layers and the pure-torch reference ops (transformers' formulas)."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_logits_close
from test_model_runner import Seq, hf_logits, step

from fp8cache import ops
from fp8cache.config import EngineConfig
from fp8cache.model import fused_layer
from fp8cache.model.loader import load_model
from fp8cache.model.runner import ModelRunner
from fp8cache.ops import reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def close_or_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """bfloat16 / float16: the same rounding as transformers' ops, bit for bit; float32: summation order."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    else:
        assert torch.equal(got, want), f"max difference {(got.float() - want.float()).abs().max().item()}"


def rotary_tables(tokens: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(tokens, dtype=torch.float32)[:, None] * 10000 ** (-torch.arange(d // 2) / (d // 2))
    emb = torch.cat([angles, angles], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norms_match_reference(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 200, generator=g) * 3).to(dtype)
    weight = (torch.rand(200, generator=g) + 0.5).to(dtype)
    got, want = torch.empty_like(x), torch.empty_like(x)
    ops.rms_norm(got, x, weight, 1e-5)
    reference.rms_norm(want, x, weight, 1e-5)
    close_or_equal(got, want)
    residual = torch.randn(37, 200, generator=g).to(dtype)
    got_x, got_r, want_x, want_r = x.clone(), residual.clone(), x.clone(), residual.clone()
    ops.fused_add_rms_norm(got_x, got_r, weight, 1e-6)
    reference.fused_add_rms_norm(want_x, want_r, weight, 1e-6)
    assert torch.equal(got_r, want_r)  # the residual sum is one rounding on both sides
    close_or_equal(got_x, want_x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_and_silu_on_views_of_one_matmul_output(dtype):
    """q/k/v and gate/up as column views of one packed output, as the fused layer hands them over."""
    g = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, d = 11, 6, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    cos, sin = rotary_tables(tokens, d, dtype)
    results = []
    for impl in (ops, reference):
        t = qkv.clone()
        q, k = t[:, :heads * d].view(tokens, heads, d), t[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d)
        impl.rotary_embedding_cos_sin(q, k, cos, sin)
        results.append(t)
    close_or_equal(*results)
    assert torch.equal(results[0][:, (heads + kv_heads) * d:], qkv[:, (heads + kv_heads) * d:])  # v untouched
    assert not torch.equal(results[0][1:, :heads * d], qkv[1:, :heads * d])  # position 0 is the identity

    gate_up = (torch.randn(13, 2 * 100, generator=g) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp overflow / underflow and zeros
    got, want = torch.empty(13, 100, dtype=dtype), torch.empty(13, 100, dtype=dtype)
    ops.silu_and_mul(got, gate_up[:, :100], gate_up[:, 100:])
    reference.silu_and_mul(want, gate_up[:, :100], gate_up[:, 100:])
    close_or_equal(got, want)


def test_layer_ops_refuse_bad_inputs():
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="out and input shapes differ"):
        ops.rms_norm(torch.empty(4, 32), x, torch.ones(64), 1e-5)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.empty_like(x), x, torch.ones(32), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous last dimension"):
        ops.silu_and_mul(torch.empty(64, 4), x.t(), x.t())
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.rms_norm(torch.empty(4, 64, dtype=torch.int32), x.int(), torch.ones(64), 1e-5)
    cos, sin = rotary_tables(4, 64, torch.float32)
    with pytest.raises(RuntimeError, match="cos must be"):
        ops.rotary_embedding_cos_sin(x.view(4, 1, 64), x.clone().view(4, 1, 64), cos[:3], sin[:3])
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.rotary_embedding_cos_sin(x.view(4, 1, 64), x.clone().view(4, 1, 64), cos.bfloat16(), sin.bfloat16())


# ---- the fused forward in the runner ----------------------------------------------------------------

def runner_for(path: str, monkeypatch, fused: bool, dtype: str = "float32") -> ModelRunner:
    """A runner with fp8kv's fused layers, or (fused=False) with transformers' own: the reference."""
    loaded = load_model(EngineConfig(model=path, dtype=dtype), progress=False)  # its own layers
    config = EngineConfig(model=path, dtype=dtype, kv_cache_dtype="auto", block_size=16, kv_cache_memory="16MiB",
                          max_model_len=64)
    with monkeypatch.context() as patch:
        if not fused:
            patch.setattr(fused_layer, "install", lambda model: 0)
        return ModelRunner(config, log=lambda msg: None, loaded=loaded)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in fused_layer.SUPPORTED_LAYERS]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_fused_layers_compute_what_transformers_layers_compute(make_tiny_model, monkeypatch, model_type):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(model_type)
    fused, plain = runner_for(path, monkeypatch, True), runner_for(path, monkeypatch, False)
    layers = decoder_layers(fused.model)
    assert layers and all(isinstance(m.__dict__.get("forward"), fused_layer.FusedDecoderLayer) for m in layers)
    assert not any("forward" in m.__dict__ for m in decoder_layers(plain.model))
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    seq = Seq([(5 * i) % 50 + 3 for i in range(21)], [2, 0])
    got = fused.execute(step([(seq, 0, 20)]), all_logits=True)
    assert_logits_close(got, plain.execute(step([(seq, 0, 20)]), all_logits=True))
    assert_logits_close(got, hf_logits(hf, seq.ids[:20]))
    assert_logits_close(fused.execute(step([(seq, 20, 21)]))[0], hf_logits(hf, seq.ids)[-1])


def test_bfloat16_fused_layers_stay_with_transformers(tiny_llama_path, monkeypatch):
    fused = runner_for(tiny_llama_path, monkeypatch, True, "bfloat16")
    plain = runner_for(tiny_llama_path, monkeypatch, False, "bfloat16")
    seq = Seq([(3 * i) % 50 + 3 for i in range(24)], [1, 3])
    got = fused.execute(step([(seq, 0, 24)]), all_logits=True)
    want = plain.execute(step([(seq, 0, 24)]), all_logits=True)
    assert_logits_close(got, want, atol=0.02 * want.abs().max().item())  # bfloat16: a few rounding flips


def test_installing_twice_wraps_transformers_forward_once(tiny_llama_path):
    loaded = load_model(EngineConfig(model=tiny_llama_path), progress=False)
    assert fused_layer.install(loaded.model) == loaded.hf_config.num_hidden_layers
    assert fused_layer.install(loaded.model) == loaded.hf_config.num_hidden_layers  # again: once
    layer = decoder_layers(loaded.model)[0]
    assert layer.forward.original.__func__ is type(layer).forward

