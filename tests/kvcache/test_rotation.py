"""Hadamard kv rotation: the matrix against an independent closed form, exactness without quantization
(runner logits, LLM greedy tokens), FP8 end to end against a torch float8 fake-quant reference, and less error on real activations."""

from __future__ import annotations

import json

import pytest
import torch
from hadamard_reference import reference_hadamard, walsh_hadamard
from numerics import assert_logits_close

from fp8cache import LLM, SamplingParams
from fp8cache.config import EngineConfig
from fp8cache.kvcache import formats
from fp8cache.kvcache.rotation import hadamard_matrix, rotate, rotation_matrix
from fp8cache.model.loader import load_model
from fp8cache.model.runner import ModelRunner
from fp8cache.ops import reference
from fp8cache.quality.eval import window_batch

TEXT = ("The tower is 324 metres tall, about the same height as an 81-storey building, and the tallest "
        "structure in Paris. Its base is square, measuring 125 metres on each side. During its construction "
        "it surpassed the Washington Monument to become the tallest man-made structure in the world.")
TINY_TEXT = "the city of the river was the first new school in the world and the people of the state had a house"


def make_runner(loaded, kv_cache_dtype: str = "auto", **overrides) -> ModelRunner:
    config = EngineConfig(model=loaded.model_path, kv_cache_dtype=kv_cache_dtype, kv_cache_memory="32MiB",
                          **overrides)
    return ModelRunner(config, log=lambda msg: None, loaded=loaded)


@pytest.fixture(scope="module")
def loaded(default_loaded):
    return default_loaded  # the session's, shared with the other modules' runners


@pytest.fixture(scope="module")
def text_ids(loaded):
    return loaded.tokenizer(TEXT)["input_ids"]


# ---- the matrix ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_size, block", [(64, 64), (128, 128), (256, 256), (80, 16), (96, 32), (112, 16)])
def test_hadamard_matrix_is_the_walsh_orthonormal_block_diagonal(head_size, block):
    h = hadamard_matrix(head_size)
    assert h.dtype == torch.float32 and h.shape == (head_size, head_size)
    torch.testing.assert_close(h.double(), reference_hadamard(head_size, block), rtol=0, atol=1e-7)
    torch.testing.assert_close(h.double() @ h.double(), torch.eye(head_size, dtype=torch.float64),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 8, 64, 256])
def test_the_reference_is_a_normalized_hadamard_matrix(n):
    # What makes it a valid reference, whatever fp8cache does: +-1 entries, orthogonal rows, first row and
    # column all +1, and each size holding the half size in Sylvester's [[H, H], [H, -H]] layout.
    h = walsh_hadamard(n)
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))
    assert bool((h[0] == 1).all()) and bool((h[:, 0] == 1).all())
    if n > 1:
        half = walsh_hadamard(n // 2)
        assert torch.equal(h, torch.cat([torch.cat([half, half], 1), torch.cat([half, -half], 1)], 0))


@pytest.mark.parametrize("head_size", [100, 36, 44])
def test_head_sizes_without_a_block_of_8_are_refused(head_size):
    with pytest.raises(ValueError, match=rf"head size {head_size}.*kv rotation 'none'"):
        hadamard_matrix(head_size)


def test_rotation_names():
    assert rotation_matrix("none", 64) is None
    with pytest.raises(ValueError, match="unknown kv rotation 'givens'; valid: none, hadamard"):
        rotation_matrix("givens", 64)


# ---- exact without quantization --------------------------------------------------------------------------

def test_runner_logits_with_rotation_equal_without_on_auto_cache(loaded, text_ids):
    plain, rotated = make_runner(loaded), make_runner(loaded)
    rotated.kv_rotation = "hadamard"
    n = len(text_ids)
    prefill = window_batch(text_ids[:n - 2], plain.block_size)
    assert_logits_close(rotated.execute(prefill, all_logits=True), plain.execute(prefill, all_logits=True))
    for pos in (n - 2, n - 1):  # decode steps read the rotated prefix from the cache
        decode = window_batch(text_ids[:pos + 1], plain.block_size)
        decode.token_ids, decode.positions = decode.token_ids[-1:], decode.positions[-1:]
        decode.slot_mapping = decode.slot_mapping[-1:]
        decode.seqs[0].query_len = 1
        assert_logits_close(rotated.execute(decode), plain.execute(decode))


def test_block_diagonal_rotation_is_exact_for_head_size_80(make_tiny_model):
    path = make_tiny_model("llama", head_dim=80)
    tiny = load_model(EngineConfig(model=path), progress=False)
    ids = tiny.tokenizer(TINY_TEXT)["input_ids"]
    plain, rotated = make_runner(tiny), make_runner(tiny)
    rotated.kv_rotation = "hadamard"
    batch = window_batch(ids, plain.block_size)
    assert_logits_close(rotated.execute(batch, all_logits=True), plain.execute(batch, all_logits=True))


def test_llm_greedy_tokens_with_rotation_equal_without(default_model_path):
    llm = LLM(model=default_model_path, kv_cache_memory="32MiB", enable_prefix_caching=False, log=lambda m: None)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    prompt = "London is the capital of"
    plain = llm.generate(prompt, greedy)[0].outputs[0].token_ids
    llm.llm_engine.runner.kv_rotation = "hadamard"
    rotated = llm.generate(prompt, greedy)[0].outputs[0].token_ids
    assert rotated == plain


# ---- FP8 end to end ------------------------------------------------------------------------------------

def post_rope_kv(model_path: str, ids: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own post-RoPE K and V [T, kv_heads, d] of one layer, unquantized."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    captured = {}

    def record(module, query, key, value, mask, **kwargs):
        captured[module.layer_idx] = key[0].transpose(0, 1).clone(), value[0].transpose(0, 1).clone()
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    AttentionInterface.register("test_record_kv", record)
    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="test_record_kv").eval()
    with torch.no_grad():
        model(torch.tensor([ids]))
    return captured[layer]


def fake_quant_logits(model_path: str, ids: list[int], scales: dict, fmt: formats.Fp8Format,
                      rotate_kv: bool) -> torch.Tensor:
    """transformers' own forward with K/V (optionally rotated by the reference Hadamard) rounded through torch's
    float8 dtype with per-head scales: what the cache should hold, computed without fp8cache."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fake_quant(x: torch.Tensor, s: list[float]) -> torch.Tensor:  # x [1, heads, T, d]
        s = torch.tensor(s, dtype=torch.float32).reshape(1, -1, 1, 1)
        return torch.clamp(x / s, -fmt.max, fmt.max).to(fmt.torch_dtype).to(torch.float32) * s

    def attention(module, query, key, value, mask, **kwargs):
        h = reference_hadamard(query.shape[-1], query.shape[-1]).to(torch.float32)
        if rotate_kv:
            query, key, value = query @ h, key @ h, value @ h
        layer = str(module.layer_idx)
        key = fake_quant(key, scales["k_scaling_factor"]["0"][layer])
        value = fake_quant(value, scales["v_scaling_factor"]["0"][layer])
        out, weights = sdpa_attention_forward(module, query, key, value, mask, **kwargs)
        return (out @ h if rotate_kv else out), weights  # out: [1, T, heads, d]

    AttentionInterface.register("test_fake_quant", attention)
    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="test_fake_quant").eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def raw_cache(runner: ModelRunner, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored codes of positions [0, n) written by window_batch (slot = position): [n, kv_heads, d]."""
    key_cache, value_cache = runner.kv_caches[layer]
    blocks, offsets = torch.arange(n) // runner.block_size, torch.arange(n) % runner.block_size
    k = key_cache[blocks, :, :, offsets, :].reshape(n, runner.num_kv_heads, runner.head_size)
    return k, value_cache[blocks, :, :, offsets]


def test_fp8_rotation_and_per_head_scales_from_the_file_reach_the_cache_and_logits(loaded, text_ids, tmp_path):
    num_layers, heads = loaded.hf_config.num_hidden_layers, loaded.hf_config.num_key_value_heads
    gen = torch.Generator().manual_seed(0)
    # Per-head scales of the size real ones have (K |x| ~ 10, V ~ 3 after E4M3's 448).
    k = {str(i): (0.02 + 0.02 * torch.rand(heads, generator=gen)).tolist() for i in range(num_layers)}
    v = {str(i): (0.01 + 0.01 * torch.rand(heads, generator=gen)).tolist() for i in range(num_layers)}
    doc = {"model_type": "llama", "kv_rotation": "hadamard", "kv_cache": {
        "dtype": "float8_e4m3fn", "scaling_factor": {"0": {i: max(k[i] + v[i]) for i in k}},
        "k_scaling_factor": {"0": k}, "v_scaling_factor": {"0": v}}}
    path = tmp_path / "rotated.json"
    path.write_text(json.dumps(doc))
    # kv_recent_window=0: every position in FP8, as the fake-quant references below assume.
    runner = make_runner(loaded, "fp8_e4m3", quantization_param_path=str(path), kv_recent_window=0)
    assert runner.kv_rotation == "hadamard" and runner.scales.per_head()
    logits = runner.execute(window_batch(text_ids, runner.block_size), all_logits=True)

    # Layer 0 sees the same input in both models: its cache holds exactly Q(K H / s), Q(V H / s) per head.
    fmt = formats.FP8_FORMATS["fp8_e4m3"]
    key, value = post_rope_kv(loaded.model_path, text_ids, 0)
    h = reference_hadamard(runner.head_size, runner.head_size).to(torch.float32)
    k_codes, v_codes = raw_cache(runner, 0, len(text_ids))
    assert torch.equal(k_codes, reference.quantize(key @ h, torch.tensor(k["0"]), fmt))
    assert torch.equal(v_codes, reference.quantize(value @ h, torch.tensor(v["0"]), fmt))

    # Logits: FP8 rounding flips cascade through 30 layers, so the two float32 paths drift apart a little,
    # but they stay far closer to the rotated reference than to the unrotated one.
    near = (logits - fake_quant_logits(loaded.model_path, text_ids, doc["kv_cache"], fmt, True)).abs().mean()
    far = (logits - fake_quant_logits(loaded.model_path, text_ids, doc["kv_cache"], fmt, False)).abs().mean()
    assert near < far / 3, (float(near), float(far))


# ---- rotation spreads outliers on real activations -------------------------------------------------------

@pytest.fixture(scope="module")
def activations(default_model_path):
    """Post-RoPE Q, K, V [T, heads, d] of every layer of the default model on TEXT (transformers' own)."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    captured = {}

    def record(module, query, key, value, mask, **kwargs):
        captured[module.layer_idx] = tuple(t[0].transpose(0, 1).clone() for t in (query, key, value))
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    AttentionInterface.register("test_record", record)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, attn_implementation="test_record").eval()
    ids = AutoTokenizer.from_pretrained(default_model_path)(TEXT * 3)["input_ids"]
    with torch.no_grad():
        model(torch.tensor([ids]))
    return [captured[i] for i in range(len(captured))]


def fake_quant_per_head(x: torch.Tensor, fmt: formats.Fp8Format) -> torch.Tensor:
    s = (x.abs().amax(dim=(0, 2)) / fmt.max).reshape(1, -1, 1)
    return torch.clamp(x / s, -fmt.max, fmt.max).to(fmt.torch_dtype).to(torch.float32) * s


def attention_errors(activations, fmt: formats.Fp8Format, rotated: bool) -> tuple[float, float, float]:
    """Relative squared error, over all layers, of the scores Q K^T (K quantized), of P V (V quantized) and
    of the causal attention output (both quantized)."""
    score_err = score_ref = pv_err = out_err = out_ref = 0.0
    for q, k, v in activations:
        if rotated:
            h = hadamard_matrix(q.shape[-1])
            q, k, v = rotate(q, h), rotate(k, h), rotate(v, h)
        kq, vq = fake_quant_per_head(k, fmt), fake_quant_per_head(v, fmt)
        group = q.shape[1] // k.shape[1]
        qs = q.transpose(0, 1)
        ks, kqs, vs, vqs = (t.transpose(0, 1).repeat_interleave(group, 0) for t in (k, kq, v, vq))
        scores, scores_q = qs @ ks.transpose(1, 2), qs @ kqs.transpose(1, 2)
        score_err += (scores_q - scores).pow(2).sum().item()
        score_ref += scores.pow(2).sum().item()
        causal = torch.ones_like(scores, dtype=torch.bool).tril()
        probs = torch.softmax((scores * q.shape[-1] ** -0.5).masked_fill(~causal, float("-inf")), dim=-1)
        pv_err += (probs @ vqs - probs @ vs).pow(2).sum().item() / (probs @ vs).pow(2).sum().item()
        ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        out = torch.nn.functional.scaled_dot_product_attention(qs, kqs, vqs, is_causal=True)
        out_err += (out - ref).pow(2).sum().item()
        out_ref += ref.pow(2).sum().item()
    return score_err / score_ref, pv_err / len(activations), out_err / out_ref


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_rotation_lowers_fp8_attention_error_on_real_activations(activations, name):
    fmt = formats.FP8_FORMATS[name]
    score, pv, out = attention_errors(activations, fmt, rotated=False)
    score_rot, pv_rot, out_rot = attention_errors(activations, fmt, rotated=True)
    # K: large channels of K meet large channels of Q; spread out, their rounding errors cancel more.
    assert score_rot < 0.85 * score, (score_rot, score)
    assert out_rot < 0.85 * out, (out_rot, out)
    # V's error is already spread by the averaging in P V: the rotation must at least not make it worse.
    assert pv_rot < 1.05 * pv, (pv_rot, pv)
