"""The checkpoints users bring (issue 38): each quantization tool's layout, built here from a tiny model with
the tensor names and config keys the tool writes (llm-compressor / compressed-tensors, NVIDIA ModelOpt,
transformers' own `fp8` method, AMD Quark, vLLM's saved names, TGI), loaded by fp8kv without the tools'
packages: the scales checked against the values written, greedy tokens against transformers running the
same real weights with the same FP8 rounding of K and V (a reference built here, not by fp8cache).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil

import pytest
import torch
from conftest import build_tiny_model
from safetensors.torch import load_file, save_file

from fp8cache import LLM, SamplingParams
from fp8cache.config import EngineConfig
from fp8cache.kvcache import formats
from fp8cache.model import checkpoints, fp8_weights
from fp8cache.model.loader import ModelLoadError, load_model

E4M3 = formats.FP8_FORMATS["fp8_e4m3"]
LAYERS, KV_HEADS = 2, 2  # conftest's tiny model: 2 layers, 4 heads, 2 KV heads of 64, hidden 256, MLP 512
PROMPTS = [[5, 9, 13, 7, 21, 30], [40, 3, 17]]
MAX_NEW = 8
# Per layer and KV head; large enough that the tiny model's K/V (|x| up to ~4) use much of E4M3's range.
K_SCALES = [[0.011, 0.009], [0.013, 0.008]]
V_SCALES = [[0.006, 0.007], [0.005, 0.0045]]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("ckpt-source")))


# ---- what each tool writes ------------------------------------------------------------------------------

def e4m3(x: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x, -E4M3.max, E4M3.max).to(torch.float8_e4m3fn)


def quantize_weight(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) as the tools make them: per tensor [] , per channel [out, 1], per 128x128 block."""
    if kind == "tensor":
        s = w.abs().amax() / E4M3.max
        return e4m3(w / s), s.reshape(())
    if kind == "channel":
        s = w.abs().amax(dim=1, keepdim=True) / E4M3.max
        return e4m3(w / s), s
    out, inp = w.shape
    s = w.reshape(out // 128, 128, inp // 128, 128).abs().amax(dim=(1, 3)) / E4M3.max
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return e4m3(w / full), s


def real_weight(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The weight a quantized layer stands for, computed here: codes times the scale of their tensor, row or
    128x128 block."""
    c = codes.to(torch.float32)
    if scale.numel() == 1:
        return c * scale.float()
    if scale.shape[0] == c.shape[0] and scale.numel() == c.shape[0]:
        return c * scale.float().reshape(-1, 1)
    return c * scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)


def ct_args(strategy: str, dynamic: bool, **extra) -> dict:
    """compressed-tensors' QuantizationArgs as it serializes them (model_dump)."""
    return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": extra.get("group_size"),
            "strategy": strategy, "block_structure": extra.get("block_structure"), "dynamic": dynamic,
            "actorder": None, "scale_dtype": None, "zp_dtype": None, "observer": None if dynamic else "minmax",
            "observer_kwargs": {}}


def ct_config(kv: dict | None, scheme: str | None = None) -> dict:
    """quantization_config as llm-compressor's save_pretrained(save_compressed=True) writes it."""
    groups, fmt = {}, "dense"
    if scheme is not None:
        weights, acts = {"FP8": (ct_args("tensor", False), ct_args("tensor", False)),
                         "FP8_DYNAMIC": (ct_args("channel", False), ct_args("token", True)),
                         "FP8_BLOCK": (ct_args("block", False, block_structure=[128, 128]),
                                       ct_args("group", True, group_size=128))}[scheme]
        fmt = "float-quantized"
        groups = {"group_0": {"format": fmt, "input_activations": acts, "output_activations": None,
                              "targets": ["Linear"], "weights": weights}}
    return {"config_groups": groups, "format": fmt, "global_compression_ratio": None,
            "ignore": ["lm_head"] if scheme else [], "kv_cache_scheme": kv, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
            "version": "0.19.0"}


def quark_spec(**extra) -> dict:
    return {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "ch_axis": None, "group_size": None, "symmetric": True,
            "round_method": "half_even", "scale_type": "float", "is_dynamic": False, "observer_cls": "PerTensorMinMaxObserver",
            **extra}


def quark_config() -> dict:
    layer = {"weight": quark_spec(), "input_tensors": quark_spec(), "output_tensors": quark_spec(), "bias": None}
    return {"quant_method": "quark", "quant_mode": "eager_mode", "version": "0.9",
            "global_quant_config": {"weight": quark_spec(), "input_tensors": quark_spec(), "output_tensors": None,
                                    "bias": None, "target_device": None},
            "layer_quant_config": {"*k_proj": layer, "*v_proj": layer}, "layer_type_quant_config": {},
            "exclude": ["lm_head"], "algo_config": None,
            "export": {"kv_cache_group": ["*k_proj", "*v_proj"], "pack_method": "reorder", "weight_format": "real_quantized",
                       "min_kv_scale": 0.0}}


# layout -> how the tool writes it: quantization_config, KV scale names ("{}": k or v), weight scale layout, per-head
# KV scales, static input scales, a ModelOpt hf_quant_config.json, TGI's kv_cache_torch_dtype
LAYOUTS = {
    "llm-compressor kv_cache_scheme (tensor)": {"quant": ct_config(ct_args("tensor", False)), "kv": "self_attn.{}_scale"},
    "llm-compressor kv_cache_scheme (attn_head)": {"quant": ct_config(ct_args("attn_head", False)),
                                                      "kv": "self_attn.{}_scale", "per_head": True},
    "llm-compressor FP8_DYNAMIC + kv_cache_scheme": {"quant": ct_config(ct_args("tensor", False), "FP8_DYNAMIC"),
                                                        "kv": "self_attn.{}_scale", "weights": "channel"},
    "llm-compressor FP8_DYNAMIC": {"quant": ct_config(None, "FP8_DYNAMIC"), "weights": "channel"},
    "llm-compressor FP8 (static)": {"quant": ct_config(None, "FP8"), "weights": "tensor", "input_scale": True},
    "llm-compressor FP8_BLOCK": {"quant": ct_config(None, "FP8_BLOCK"), "weights": "block"},
    "ModelOpt FP8 (hf_quant_config.json)": {"modelopt_file": True, "kv": "self_attn.{0}_proj.{0}_scale", "weights": "tensor",
                                                "input_scale": True},
    "ModelOpt FP8 (config.json)": {"quant": {"quant_method": "modelopt", "quant_algo": "FP8",
                                              "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]},
                                       "kv": "self_attn.{0}_proj.{0}_scale", "weights": "tensor", "input_scale": True},
    "transformers fp8 (128x128 blocks)": {"quant": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                     "weight_block_size": [128, 128], "modules_to_not_convert": None},
                                              "weights": "block", "scale_name": "weight_scale_inv"},
    "AMD Quark FP8": {"quant": quark_config(), "kv": "self_attn.{0}_proj.output_scale", "weights": "tensor",
                          "input_scale": True},
    "vLLM saved": {"kv": "self_attn.attn.{}_scale"},
    "TGI": {"kv": "self_attn.kv_scale", "kv_dtype": "float8_e4m3fn"},
}


def kv_values(layout: dict, i: int, kind: str) -> list[float]:
    per_head = layout.get("per_head", False)
    if layout["kv"] == "self_attn.kv_scale":  # one scale for K and V: the larger, so that neither saturates
        return [max(K_SCALES[i] + V_SCALES[i])]
    values = (K_SCALES if kind == "k" else V_SCALES)[i]
    return values if per_head else [max(values)]


def build(layout_name: str, source: str, folder: str) -> tuple[str, str]:
    """(the tool's checkpoint, a plain checkpoint of the real weights it stands for) under folder."""
    layout = LAYOUTS[layout_name]
    out, plain = os.path.join(folder, "ckpt"), os.path.join(folder, "plain")
    shutil.copytree(source, out)
    shutil.copytree(source, plain)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    real = dict(tensors)
    dtype = tensors["model.embed_tokens.weight"].dtype
    if layout.get("weights"):
        for i in range(LAYERS):
            for linear in LINEARS:
                name = f"model.layers.{i}.{linear}"
                codes, scale = quantize_weight(tensors[f"{name}.weight"], layout["weights"])
                tensors[f"{name}.weight"] = codes
                tensors[f"{name}.{layout.get('scale_name', 'weight_scale')}"] = scale.to(dtype)
                real[f"{name}.weight"] = real_weight(codes, scale.to(dtype)).to(dtype)
                if layout.get("input_scale"):
                    tensors[f"{name}.input_scale"] = torch.tensor(0.02, dtype=dtype)
    if layout.get("kv"):
        for i in range(LAYERS):
            for kind in ("k", "v") if "{" in layout["kv"] else ("kv",):
                value = torch.tensor(kv_values(layout, i, kind[0]), dtype=dtype)
                value = value.reshape(-1, 1, 1) if layout.get("per_head") else value.reshape(())
                tensors[f"model.layers.{i}.{layout['kv'].format(kind)}"] = value
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    save_file(real, os.path.join(plain, "model.safetensors"), metadata={"format": "pt"})
    config_path = os.path.join(out, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    if layout.get("quant"):
        config["quantization_config"] = layout["quant"]
    if layout.get("kv_dtype"):
        config["kv_cache_torch_dtype"] = layout["kv_dtype"]
    with open(config_path, "w") as f:
        json.dump(config, f)
    if layout.get("modelopt_file"):
        with open(os.path.join(out, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "modelopt", "version": "0.19.0"},
                       "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                        "exclude_modules": ["lm_head"]}}, f)
    return out, plain


# ---- the reference: transformers on the real weights, K/V rounded to E4M3 with the written scales ---------

def reference_greedy(plain: str, k_scales: list[list[float]] | None, v_scales: list[list[float]] | None) -> list[list[int]]:
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fake_quant(x: torch.Tensor, s: list[float]) -> torch.Tensor:  # x [1, kv_heads, T, d]
        t = torch.tensor(s, dtype=torch.float32).reshape(1, -1, 1, 1)
        return torch.clamp(x / t, -E4M3.max, E4M3.max).to(torch.float8_e4m3fn).to(torch.float32) * t

    def attention(module, query, key, value, mask, **kwargs):
        if k_scales is not None:
            key = fake_quant(key, k_scales[module.layer_idx])
            value = fake_quant(value, v_scales[module.layer_idx])
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    AttentionInterface.register("test_checkpoint_fp8_kv", attention)
    model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32,
                                                 attn_implementation="test_checkpoint_fp8_kv").eval()
    out = []
    with torch.no_grad():
        for ids in PROMPTS:
            got = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, min_new_tokens=MAX_NEW,
                                 pad_token_id=0)
            out.append(got[0, len(ids):].tolist())
    return out


def fp8kv_greedy(path: str, kv_cache_dtype: str, log: list[str] | None = None, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=path, kv_cache_dtype=kv_cache_dtype, kv_recent_window=0, dtype="float32", device="cpu",
              kv_cache_memory="4MiB", log=(log.append if log is not None else lambda m: None), **kw)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)], llm


# ---- every layout ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_each_tools_checkpoint_loads_with_its_scales_and_decodes_as_transformers(layout_name, source, tmp_path):
    layout = LAYOUTS[layout_name]
    ckpt, plain = build(layout_name, source, str(tmp_path))
    has_kv = bool(layout.get("kv"))
    log: list[str] = []
    tokens, llm = fp8kv_greedy(ckpt, "fp8_e4m3" if has_kv else "auto", log)
    runner = llm.engine.runner
    if has_kv:
        assert runner.scales_source.startswith("checkpoint"), runner.scales_source
        for i in range(LAYERS):
            want_k = kv_values(layout, i, "k")
            want_v = kv_values(layout, i, "v") if "{" in layout["kv"] else want_k
            # Exactly the values written (in float32, the tiny model's dtype).
            assert torch.equal(runner.scales.k[i], torch.tensor(want_k, dtype=torch.float32))
            assert torch.equal(runner.scales.v[i], torch.tensor(want_v, dtype=torch.float32))
        heads = [t.tolist() * (KV_HEADS // t.numel()) for t in runner.scales.k], \
            [t.tolist() * (KV_HEADS // t.numel()) for t in runner.scales.v]
        assert tokens == reference_greedy(plain, *heads)
    else:
        assert tokens == reference_greedy(plain, None, None)
    if layout.get("weights"):
        line = next(m for m in log if m.startswith("FP8 weights"))
        assert f"{LAYERS * len(LINEARS)} layers dequantized once to float32" in line, line
    assert not [m for m in log if m.startswith("warning: the checkpoint holds")], log


def test_fp8_weights_run_as_transformers_runs_the_dequantized_model_in_bfloat16(source, tmp_path):
    """The CPU's packed bfloat16 linears take the dequantized weights like any other (no FP8 units here)."""
    ckpt, plain = build("llm-compressor FP8_DYNAMIC + kv_cache_scheme", source, str(tmp_path))
    log: list[str] = []
    llm = LLM(model=ckpt, dtype="bfloat16", device="cpu", kv_cache_memory="4MiB", log=log.append)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.bfloat16).eval()
    got = llm.engine.runner.model
    for i in range(LAYERS):
        for linear in ("self_attn.q_proj", "mlp.down_proj"):
            want = ref.get_submodule(f"model.layers.{i}.{linear}").weight
            x = torch.randn(3, want.shape[1], dtype=torch.bfloat16, generator=torch.Generator().manual_seed(i))
            module = got.get_submodule(f"model.layers.{i}.{linear}")
            torch.testing.assert_close(module(x).float(), (x.float() @ want.float().t()), rtol=2e-2, atol=2e-2)
    assert any("dequantized once to bfloat16" in m for m in log), log


# ---- the FP8 matmul itself ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, activations", [("tensor", "static-tensor"), ("tensor", "dynamic-tensor"),
                                               ("tensor", "dynamic-token"), ("channel", "dynamic-token"),
                                               ("channel", "static-tensor")])
def test_fp8_linear_is_the_dequantized_matmul_of_the_fp8_activations(kind, activations):
    """Fp8Linear on the CPU (torch._scaled_mm runs tensorwise and rowwise there too) against a pure-torch
    emulation: activations rounded to E4M3 with their scales, times the real weight."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 128, generator=gen) / 8
    codes, scale = quantize_weight(w, kind)
    x = torch.randn(5, 128, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    input_scale = torch.tensor(0.01) if activations == "static-tensor" else None
    layer = fp8_weights.make_fp8_linear(codes, scale, activations, input_scale, bias, torch.bfloat16)
    assert layer is not None and layer.mode == ("tensorwise" if kind == "tensor" and activations != "dynamic-token"
                                                else "rowwise")
    xf = x.float()
    if activations == "static-tensor":
        s = torch.tensor(0.01)
    elif activations == "dynamic-tensor":
        s = xf.abs().amax() / E4M3.max
    else:
        s = xf.abs().amax(dim=1, keepdim=True) / E4M3.max
    expected = (e4m3(xf / s).float() * s) @ real_weight(codes, scale).t() + bias.float()
    torch.testing.assert_close(layer(x).float(), expected, rtol=1e-2, atol=1e-2)


def test_fp8_block_activations_are_quantized_per_128_columns_of_a_token():
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    x[1, 130] = 50.0  # one large value: only its own group's scale grows
    codes, s = fp8_weights.quantize_activations(x, "group")
    assert s.shape == (3, 2) and float(s[1, 1]) == pytest.approx(50.0 / E4M3.max)
    assert float(s[1, 0]) == pytest.approx(float(x[1, :128].abs().max()) / E4M3.max)
    back = codes.float().view(3, 2, 128) * s.unsqueeze(-1)
    torch.testing.assert_close(back.view(3, 256), x, rtol=0.07, atol=1e-6)


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise", "block"])
def test_fp8_linear_keeps_to_cudas_scaled_mm_layouts(mode):
    """Under FakeTensorMode on a fake CUDA device, torch checks _scaled_mm's CUDA rules (row-major activations,
    column-major weight, sizes a multiple of 16, scale shapes of each recipe) without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    acts = {"tensorwise": "dynamic-tensor", "rowwise": "dynamic-token", "block": "dynamic-group"}[mode]
    scale_shape = {"tensorwise": (), "rowwise": (256, 1), "block": (2, 3)}[mode]
    with FakeTensorMode(allow_non_fake_inputs=True):
        codes = torch.empty(256, 384, dtype=torch.float8_e4m3fn, device="cuda")
        layer = fp8_weights.make_fp8_linear(codes, torch.ones(scale_shape, device="cuda"), acts, None,
                                            torch.empty(256, dtype=torch.bfloat16, device="cuda"), torch.bfloat16)
        assert layer.mode == mode
        y = layer(torch.empty(2, 7, 384, dtype=torch.bfloat16, device="cuda"))
        assert y.shape == (2, 7, 256) and y.dtype == torch.bfloat16 and y.device.type == "cuda"
        # The same weight in the layout CUDA refuses (row-major) is caught here, so the check is real.
        layer.weight = torch.empty(384, 256, dtype=torch.float8_e4m3fn, device="cuda").t()
        with pytest.raises(RuntimeError, match="col_major"):
            layer(torch.empty(2, 384, dtype=torch.bfloat16, device="cuda"))


def test_the_device_self_check_catches_a_kernel_that_reads_another_layout(monkeypatch):
    assert fp8_weights.probe(torch.device("cpu"), torch.bfloat16, {("tensorwise", "dynamic-tensor"),
                                                                   ("rowwise", "dynamic-token")}) is None
    real = torch._scaled_mm

    def transposed_scales(a, b, scale_a, scale_b, **kw):  # a kernel applying the weight scales to the wrong axis
        return real(a, b, scale_a=scale_a, scale_b=scale_b.flip(-1), **kw)

    monkeypatch.setattr(torch, "_scaled_mm", transposed_scales)
    failed = fp8_weights.probe(torch.device("cpu"), torch.bfloat16, {("rowwise", "dynamic-token")})
    assert failed is not None and "disagrees with the dequantized one" in failed


def test_fp8_weights_run_as_fp8_on_a_gpu_with_fp8_units(source, tmp_path, monkeypatch):
    """On the stand-in GPU (tests/fake_gpu.py) with FP8 units: the FP8 layers become Fp8Linear (FP8 codes on the
    device, no 16-bit copy), the GPU's lean layers call them, and every engine step keeps to the device."""
    from fake_gpu import fake_gpu

    from fp8cache.engine.llm_engine import LLMEngine
    from fp8cache.model.runner import ModelRunner

    # Without KV scales: the stand-in answers every read of a value with 0, which checkpoint scales would be.
    ckpt, _ = build("llm-compressor FP8_DYNAMIC", source, str(tmp_path))
    monkeypatch.setattr(fp8_weights, "fp8_matmul_support", lambda device: (True, "a stand-in GPU (sm_90)"))
    log: list[str] = []
    config = EngineConfig(model=ckpt, device="meta", dtype="bfloat16", kv_cache_dtype="fp8", kv_cache_memory="4MiB",
                          max_model_len=128)
    # Read from disk outside the stand-in (safetensors makes real tensors), as if on the GPU's host, then moved.
    loaded = load_model(dataclasses.replace(config, device="cpu"), progress=False)
    with fake_gpu():
        loaded.model.to("meta")
        engine = LLMEngine(config, log=log.append, runner=ModelRunner(config, log=log.append, loaded=loaded))
        fp8 = [m for m in loaded.model.modules() if isinstance(m, fp8_weights.Fp8Linear)]
        assert len(fp8) == LAYERS * len(LINEARS)
        assert all(m.weight.dtype == torch.float8_e4m3fn and m.mode == "rowwise" for m in fp8)
        engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True, temperature=0))
        for _ in range(10):
            engine.step()
            if not engine.has_unfinished_requests():
                break
        assert not engine.has_unfinished_requests()
    line = next(m for m in log if m.startswith("FP8 weights"))
    assert "14 linear layers run as FP8 matmuls (torch._scaled_mm, 14 rowwise) on a stand-in GPU" in line, line


def test_fp8_weights_are_dequantized_with_tensor_parallelism_or_float32(source, tmp_path, monkeypatch):
    ckpt, _ = build("llm-compressor FP8_DYNAMIC + kv_cache_scheme", source, str(tmp_path))
    monkeypatch.setattr(fp8_weights, "fp8_matmul_support", lambda device: (True, "a stand-in GPU"))
    loaded = load_model(EngineConfig(model=ckpt, dtype="float32"), progress=False)
    assert not any(isinstance(m, fp8_weights.Fp8Linear) for m in loaded.model.modules())
    assert "the model runs in float32" in loaded.notes[0]
    loaded = load_model(EngineConfig(model=ckpt, dtype="bfloat16"), progress=False, on_device=False)
    assert "tensor parallelism shards plain weights" in loaded.notes[0]


# ---- what is refused, and what is reported ---------------------------------------------------------------

def edit_config(folder: str, **quant_edits) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"].update(quant_edits)
    with open(path, "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize("edits, named", [
    ({"kv_cache_scheme": {**ct_args("tensor", False), "type": "int"}}, "kv_cache_scheme: type int"),
    ({"kv_cache_scheme": {**ct_args("channel", False)}}, "strategy 'channel'"),
    ({"kv_cache_scheme": {**ct_args("tensor", False), "num_bits": 4}}, "num_bits 4"),
    ({"config_groups": {"group_0": {"targets": ["Linear"], "weights": {**ct_args("group", False, group_size=128),
                                                                       "type": "int", "num_bits": 4},
                                    "input_activations": None}}, "format": "pack-quantized"}, "format"),
    ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config"),
])
def test_an_unsupported_scheme_is_one_line_at_start(edits, named, source, tmp_path):
    ckpt, _ = build("llm-compressor kv_cache_scheme (tensor)", source, str(tmp_path))
    edit_config(ckpt, **edits)
    with pytest.raises(ValueError) as err:
        LLM(model=ckpt, kv_cache_dtype="fp8", device="cpu", kv_cache_memory="4MiB", log=lambda m: None)
    message = str(err.value)
    assert named in message and "\n" not in message and "quantization_config" in message


def test_the_cli_says_so_in_one_line_with_exit_2(source, tmp_path):
    import subprocess
    import sys

    ckpt, _ = build("llm-compressor kv_cache_scheme (tensor)", source, str(tmp_path))
    edit_config(ckpt, kv_cache_scheme={**ct_args("tensor", False), "type": "int"})
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "generate", ckpt, "the", "--kv-cache-dtype", "fp8",
                           "--device", "cpu", "--max-tokens", "2"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "kv_cache_scheme: type int" in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_dynamic_kv_scheme_means_calculated_scales(source, tmp_path):
    ckpt, _ = build("llm-compressor kv_cache_scheme (tensor)", source, str(tmp_path))
    edit_config(ckpt, kv_cache_scheme=ct_args("tensor", True))
    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.endswith(("k_scale", "v_scale"))},
              os.path.join(ckpt, "model.safetensors"), metadata={"format": "pt"})
    _, llm = fp8kv_greedy(ckpt, "fp8_e4m3")
    assert llm.engine.runner.scales_source.startswith("calculated"), llm.engine.runner.scales_source


def test_a_static_scheme_without_its_scales_is_refused(source, tmp_path):
    ckpt, _ = build("llm-compressor kv_cache_scheme (tensor)", source, str(tmp_path))
    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.endswith(("k_scale", "v_scale"))},
              os.path.join(ckpt, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="declares a static compressed-tensors KV cache scheme, per tensor, but"):
        fp8kv_greedy(ckpt, "fp8_e4m3")


def test_scale_tensors_nothing_uses_are_named_in_a_warning(source, tmp_path):
    ckpt, _ = build("llm-compressor kv_cache_scheme (tensor)", source, str(tmp_path))
    path = os.path.join(ckpt, "model.safetensors")
    tensors = load_file(path)
    for i in range(LAYERS):
        tensors[f"model.layers.{i}.self_attn.q_scale"] = torch.tensor([0.1])  # attention quantization: not ours
        tensors[f"model.layers.{i}.self_attn.k_cache_scale"] = torch.tensor([0.2])  # an unknown convention
        tensors[f"model.layers.{i}.self_attn.k_zero_point"] = torch.zeros(1)  # symmetric: nothing to say
    save_file(tensors, path, metadata={"format": "pt"})
    log: list[str] = []
    fp8kv_greedy(ckpt, "fp8_e4m3", log)
    warnings = [m for m in log if m.startswith("warning: the checkpoint holds")]
    assert len(warnings) == 2, log
    assert "model.layers.{0..1}.self_attn.q_scale (2)" in warnings[0]
    assert "model.layers.{0..1}.self_attn.k_cache_scale (2)" in warnings[1]
    assert "--quantization-param-path" in warnings[1]


def test_asymmetric_kv_zero_points_are_refused(source, tmp_path):
    ckpt, _ = build("llm-compressor kv_cache_scheme (tensor)", source, str(tmp_path))
    path = os.path.join(ckpt, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.1.self_attn.v_zero_point"] = torch.tensor([3.0])
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.self_attn.v_zero_point holds non-zero"):
        fp8kv_greedy(ckpt, "fp8_e4m3")


def test_fp8_weights_without_their_scale_are_refused(source, tmp_path):
    ckpt, _ = build("llm-compressor FP8_DYNAMIC + kv_cache_scheme", source, str(tmp_path))
    path = os.path.join(ckpt, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.0.mlp.up_proj.weight_scale"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight is stored as float8 but has no"):
        load_model(EngineConfig(model=ckpt), progress=False)


def test_missing_weights_are_refused_not_run_random(source, tmp_path):
    folder = str(tmp_path / "partial")
    shutil.copytree(source, folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lacks 1 weights .*model.layers.1.mlp.up_proj.weight"):
        load_model(EngineConfig(model=folder), progress=False)


def test_describe_reads_each_tools_config_without_its_package(source, tmp_path):
    ckpt, _ = build("ModelOpt FP8 (hf_quant_config.json)", source, str(tmp_path))
    quant = checkpoints.describe(checkpoints.read_config(ckpt))
    assert quant.method == "modelopt" and quant.weights.activations == "static-tensor"
    assert quant.kv.tool == "ModelOpt" and not quant.kv.dynamic
    block = checkpoints.describe({"quantization_config": ct_config(None, "FP8_BLOCK")})
    assert block.weights.block == (128, 128) and block.weights.activations == "dynamic-group"
    quark = checkpoints.describe({"quantization_config": quark_config()})
    assert quark.kv.tool == "Quark" and quark.weights.activations == "static-tensor"
    assert checkpoints.describe({"quantization_config": {"quant_method": "gptq", "bits": 4}}).own is False


def test_scale_shapes_name_their_layout():
    assert fp8_weights.scale_kind(torch.ones(()), 256, 512) == "tensor"
    assert fp8_weights.scale_kind(torch.ones(256, 1), 256, 512) == "channel"
    assert fp8_weights.scale_kind(torch.ones(2, 4), 256, 512) == "block"
    assert fp8_weights.scale_kind(torch.ones(3, 4), 300, 512) == "block"  # ceil(300 / 128) row blocks
    with pytest.raises(fp8_weights.Fp8WeightsError, match=r"shape \[5, 5\] fits no FP8 layout"):
        fp8_weights.scale_kind(torch.ones(5, 5), 256, 512)
    codes = e4m3(torch.randn(300, 256))
    scale = torch.rand(3, 2) + 0.5
    got = fp8_weights.dequantize(codes, scale, torch.float32)
    assert torch.equal(got[299, 255], codes[299, 255].float() * scale[2, 1])
    assert math.isclose(float(got[0, 0]), float(codes[0, 0].float() * scale[0, 0]))
