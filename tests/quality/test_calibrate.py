"""`fp8kv calibrate`: scales against an independent capture of transformers' K/V, the file against the docs/design.md
schema and a reader that knows only vLLM's schema, checkpoint round trips, datasets, and held-out quality."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hadamard_reference import walsh_hadamard
from safetensors.torch import load_file, save_file

from fp8cache.config import EngineConfig
from fp8cache.kvcache import formats, scale_files
from fp8cache.kvcache.scale_files import load_scales_file, scales_from_checkpoint
from fp8cache.model.loader import load_model, read_config_dict
from fp8cache.model.runner import ModelRunner
from fp8cache.quality import calibrate as cal
from fp8cache.quality.eval import evaluate, locate_eval_text, read_text
from launcher.calibrate import calibrate as calibrate_command

SAMPLES, SEQ_LEN = 2, 96
E4M3 = formats.FP8_FORMATS["fp8_e4m3"]


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> tuple[str, str]:
    """(calibration file, evaluation file): the second half of WikiText-2 test and its first 20k chars."""
    text = read_text(locate_eval_text())
    folder = tmp_path_factory.mktemp("texts")
    calib, held_out = folder / "calib.txt", folder / "eval.txt"
    calib.write_text(text[len(text) // 2:], encoding="utf-8", newline="")
    held_out.write_text(text[:20000], encoding="utf-8", newline="")
    return str(calib), str(held_out)


@pytest.fixture(scope="module")
def loaded(default_loaded):
    return default_loaded  # the session's, shared with the other modules' runners


def independent_kv(model_path: str, samples: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, post-RoPE K and V [tokens, kv_heads, d] of all samples, from forward hooks on k_proj/v_proj
    and transformers' own rotary embedding (not through any attention function)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    out: dict[int, list] = {i: [[], []] for i in range(cfg.num_hidden_layers)}
    proj: dict[tuple[str, int], torch.Tensor] = {}

    def keep(kind: str, i: int):
        return lambda module, args, output: proj.__setitem__((kind, i), output)

    for i, layer in enumerate(model.model.layers):
        layer.self_attn.k_proj.register_forward_hook(keep("k", i))
        layer.self_attn.v_proj.register_forward_hook(keep("v", i))
    for ids in samples:
        x = torch.tensor([ids])
        with torch.no_grad():
            model(x)
            cos, sin = model.model.rotary_emb(x.float(), torch.arange(len(ids))[None])
        for i in range(cfg.num_hidden_layers):
            k = proj[("k", i)].view(1, len(ids), -1, d).transpose(1, 2)
            k, _ = apply_rotary_pos_emb(k, k, cos, sin)
            out[i][0].append(k[0].transpose(0, 1))
            out[i][1].append(proj[("v", i)].view(len(ids), -1, d))
    return [(torch.cat(k), torch.cat(v)) for k, v in (out[i] for i in range(cfg.num_hidden_layers))]


def read_json(path: str) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def vllm_schema_scales(path: str, num_layers: int) -> list[float]:
    """What a reader that knows only the vLLM/aphrodite schema takes from the file: kv_cache.dtype and one
    positive float per layer in scaling_factor[tp_rank 0]."""
    doc = read_json(path)
    kv = doc["kv_cache"]
    assert kv["dtype"] in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2")
    table = kv["scaling_factor"]["0"]
    assert sorted(table, key=int) == [str(i) for i in range(num_layers)]
    values = [table[str(i)] for i in range(num_layers)]
    assert all(isinstance(x, float) and math.isfinite(x) and x > 0 for x in values)
    return values


@pytest.fixture(scope="module")
def head_amax(default_model_path, texts, tmp_path_factory):
    """A per-head, amax calibration and the file `fp8kv calibrate` writes for it."""
    result = cal.calibrate(default_model_path, texts[0], "fp8_e4m3", SAMPLES, SEQ_LEN, granularity="head",
                           statistic="amax")
    path = str(tmp_path_factory.mktemp("scales") / "head.json")
    cal.write_scales(result, path)
    return result, path


# ---- scales against independent K/V ---------------------------------------------------------------------

def test_amax_scales_are_the_per_head_maxima_of_transformers_k_and_v(head_amax, default_model_path, texts,
                                                                    loaded):
    result, _ = head_amax
    ids = loaded.tokenizer(read_text(texts[0]))["input_ids"][:SAMPLES * SEQ_LEN]
    samples = [ids[i:i + SEQ_LEN] for i in range(0, len(ids), SEQ_LEN)]
    assert (result.num_samples, result.num_tokens) == (SAMPLES, SAMPLES * SEQ_LEN)
    for i, (k, v) in enumerate(independent_kv(default_model_path, samples)):
        torch.testing.assert_close(result.scales.k[i], k.abs().amax(dim=(0, 2)) / E4M3.max, rtol=1e-5, atol=0)
        torch.testing.assert_close(result.scales.v[i], v.abs().amax(dim=(0, 2)) / E4M3.max, rtol=1e-5, atol=0)


def test_hadamard_tensor_scales_are_maxima_of_rotated_k_and_v(default_model_path, texts, loaded, tmp_path):
    result = cal.calibrate(default_model_path, texts[0], "fp8_e5m2", 1, SEQ_LEN, granularity="tensor",
                           kv_rotation="hadamard", statistic="amax")
    ids = loaded.tokenizer(read_text(texts[0]))["input_ids"][:SEQ_LEN]
    h = walsh_hadamard(64).to(torch.float32) / 8
    e5m2 = formats.FP8_FORMATS["fp8_e5m2"]
    for i, (k, v) in enumerate(independent_kv(default_model_path, [ids])):
        torch.testing.assert_close(result.scales.k[i], (k @ h).abs().max().reshape(1) / e5m2.max, rtol=1e-5, atol=0)
        torch.testing.assert_close(result.scales.v[i], (v @ h).abs().max().reshape(1) / e5m2.max, rtol=1e-5, atol=0)
    path = str(tmp_path / "rotated.json")
    cal.write_scales(result, path)
    assert read_json(path)["kv_rotation"] == "hadamard"
    assert load_scales_file(path, 30, 3, "fp8_e5m2").rotation == "hadamard"


def test_rotated_file_gives_vllm_readers_the_unrotated_scale(default_model_path, texts, loaded, tmp_path):
    """A reader that ignores kv_rotation applies scaling_factor to UNROTATED K/V: it must be their statistic,
    while fp8kv reads the rotated scales from k_/v_scaling_factor."""
    result = cal.calibrate(default_model_path, texts[0], "fp8_e4m3", 1, SEQ_LEN, granularity="head",
                           kv_rotation="hadamard", statistic="amax")
    path = str(tmp_path / "rotated.json")
    cal.write_scales(result, path)
    ids = loaded.tokenizer(read_text(texts[0]))["input_ids"][:SEQ_LEN]
    plain = vllm_schema_scales(path, 30)
    doc = read_json(path)
    h = walsh_hadamard(64).to(torch.float32) / 8
    saturated_before = 0
    for i, (k, v) in enumerate(independent_kv(default_model_path, [ids])):
        unrotated_amax = max(float(k.abs().max()), float(v.abs().max()))
        assert plain[i] == pytest.approx(unrotated_amax / E4M3.max, rel=1e-5)
        for name, x in (("k_scaling_factor", k), ("v_scaling_factor", v)):  # per head, of the rotated K/V
            want = ((x @ h).abs().amax(dim=(0, 2)) / E4M3.max).tolist()
            assert doc["kv_cache"][name]["0"][str(i)] == pytest.approx(want, rel=1e-5)
        old_plain = max(doc["kv_cache"]["k_scaling_factor"]["0"][str(i)] + doc["kv_cache"]["v_scaling_factor"]["0"][str(i)])
        saturated_before += old_plain < plain[i] * (1 - 1e-6)
    # The rotation spreads outliers, so rotated maxima are smaller: a plain scale taken from them (as files
    # had before) saturates unrotated K/V in a vLLM reader. This data shows it, so the check above has teeth.
    assert saturated_before > 0
    back = load_scales_file(path, 30, 3, "fp8_e4m3")
    assert back.rotation == "hadamard"
    assert all(torch.equal(a, b) for a, b in zip(back.k + back.v, result.scales.k + result.scales.v))
    assert back.unrotated_scales == pytest.approx(plain, rel=1e-7)
    assert load_scales_file(path, 30, 3, "fp8_e4m3fnuz").unrotated_scales == pytest.approx([2 * s for s in plain],
                                                                                          rel=1e-7)


def test_rotated_files_and_scales_without_both_kinds_of_scale_are_refused(tmp_path):
    rotated = cal.kv_scales.KVScales([torch.tensor([0.02])] * 2, [torch.tensor([0.01])] * 2, "fp8_e4m3", "x",
                                     "hadamard")
    with pytest.raises(ValueError, match="need unrotated_scales .* plain vLLM scaling_factor"):
        scale_files.write_scales_file(tmp_path / "a.json", rotated, "llama", 1)
    with pytest.raises(ValueError, match="unrotated_scales are for rotated scales only"):
        cal.kv_scales.KVScales(rotated.k, rotated.v, "fp8_e4m3", "x", "none", [0.03, 0.03])
    with pytest.raises(ValueError, match="unrotated_scales has 1 layers"):
        cal.kv_scales.KVScales(rotated.k, rotated.v, "fp8_e4m3", "x", "hadamard", [0.03])
    # A rotated file whose only scales are the plain (unrotated) ones cannot be used for the rotated cache.
    path = tmp_path / "plain-only.json"
    path.write_text(json.dumps({"model_type": "llama", "kv_rotation": "hadamard", "kv_cache": {
        "dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 0.03, "1": 0.03}}}}))
    with pytest.raises(cal.kv_scales.ScalesFileError,
                       match=r"key kv_cache.k_scaling_factor: is missing.*kv_rotation 'hadamard'.*"
                             r"fp8kv calibrate --kv-rotation hadamard"):
        load_scales_file(str(path), 2, 1, "fp8_e4m3")


# ---- the file ----------------------------------------------------------------------------------------

def test_file_follows_the_schema_and_loads_back(head_amax):
    result, path = head_amax
    doc = read_json(path)
    assert doc["model_type"] == "llama" and doc["kv_cache"]["dtype"] == "float8_e4m3fn"
    assert "kv_rotation" not in doc  # no rotation: the file stays a plain vLLM file plus optional keys
    for name, tensors in (("k_scaling_factor", result.scales.k), ("v_scaling_factor", result.scales.v)):
        table = doc["kv_cache"][name]["0"]
        assert len(table) == 30 and all(len(table[str(i)]) == 3 for i in range(30))
        assert [table[str(i)] for i in range(30)] == [t.tolist() for t in tensors]
    back = load_scales_file(path, 30, 3, "fp8_e4m3")
    assert all(torch.equal(a, b) for a, b in zip(back.k + back.v, result.scales.k + result.scales.v))


def test_a_vllm_schema_reader_gets_a_scale_that_never_saturates(head_amax):
    result, path = head_amax
    plain = vllm_schema_scales(path, 30)
    for i, s in enumerate(plain):
        assert s == pytest.approx(max(float(result.k_amax[i].max()), float(result.v_amax[i].max())) / E4M3.max,
                                  rel=1e-6)
    # Our own loader reads such a plain file (only scaling_factor) as the same scale for K and V.
    stripped = read_json(path)
    del stripped["kv_cache"]["k_scaling_factor"], stripped["kv_cache"]["v_scaling_factor"]
    plain_path = path.replace(".json", "-plain.json")
    Path(plain_path).write_text(json.dumps(stripped))
    back = load_scales_file(plain_path, 30, 3, "fp8_e4m3")
    assert [float(t) for t in back.k] == pytest.approx(plain) and [float(t) for t in back.v] == pytest.approx(plain)


def test_runner_uses_the_per_head_file(head_amax, loaded):
    result, path = head_amax
    runner = ModelRunner(EngineConfig(model=loaded.model_path, kv_cache_dtype="fp8_e4m3", kv_cache_memory="16MiB",
                                      quantization_param_path=path), log=lambda m: None, loaded=loaded)
    assert runner.scales_source == f"file {path}" and runner.kv_rotation == "none"
    assert all(t.shape == (3,) for t in runner.scales.k + runner.scales.v)
    assert torch.equal(torch.stack(runner.scales.k), torch.stack(result.scales.k))


# ---- checkpoint ----------------------------------------------------------------------------------------

# What llm-compressor 0.14 (compressed-tensors 0.19) writes into config.json for a kv_cache_scheme-only
# checkpoint of the default model (save_pretrained(save_compressed=True)), key for key: the layout fp8kv's
# --write-checkpoint follows so that vLLM, SGLang and llm-compressor read it.
LLM_COMPRESSOR_QUANTIZATION_KEYS = {"config_groups", "format", "global_compression_ratio", "ignore", "kv_cache_scheme",
                                    "quant_method", "quantization_status", "sparsity_config", "transform_config",
                                    "version"}
LLM_COMPRESSOR_KV_SCHEME_KEYS = {"actorder", "block_structure", "dynamic", "group_size", "num_bits", "observer",
                                 "observer_kwargs", "scale_dtype", "strategy", "symmetric", "type", "zp_dtype"}


@pytest.mark.parametrize("made_for, run_with, factor", [("fp8_e4m3", "fp8_e4m3", 1.0),
                                                        ("fp8_e4m3fnuz", "fp8_e4m3", 0.5)])
def test_checkpoint_carries_the_scales(head_amax, loaded, tmp_path, made_for, run_with, factor):
    result, _ = head_amax
    scales = result.scales.for_format(made_for)
    made = cal.CalibrationResult(**{**result.__dict__, "scales": scales})
    written = cal.write_checkpoint(made, str(tmp_path / "ckpt"))
    out = written.path
    config = read_config_dict(out)
    quant = config["quantization_config"]
    assert set(quant) == LLM_COMPRESSOR_QUANTIZATION_KEYS and quant["quant_method"] == "compressed-tensors"
    kv = quant["kv_cache_scheme"]
    assert set(kv) == LLM_COMPRESSOR_KV_SCHEME_KEYS
    assert (kv["type"], kv["num_bits"], kv["strategy"], kv["dynamic"], kv["symmetric"]) == \
        ("float", 8, "attn_head", False, True)
    # The scales are inside the indexed weights, at compressed-tensors' names and attn_head shape.
    with open(Path(out) / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    assert not (Path(out) / "model.safetensors").exists()  # transformers would read it and skip the index
    files = sorted(set(weight_map.values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    stored = load_file(str(Path(out) / "model-00002-of-00002.safetensors"))
    assert sorted(stored) == sorted(f"model.layers.{i}.self_attn.{kind}_scale" for i in range(30) for kind in "kv")
    assert all(t.shape == (3, 1, 1) and t.dtype == torch.float32 for t in stored.values())
    assert all(weight_map[n] == "model-00002-of-00002.safetensors" for n in stored)
    assert sorted(written.linked + written.copied) == ["chat_template.jinja", "generation_config.json",
                                                       "model-00001-of-00002.safetensors", "tokenizer.json",
                                                       "tokenizer_config.json"]
    with_scales = load_model(EngineConfig(model=out), progress=False)
    assert len(with_scales.checkpoint_scale_tensors) == 60
    e4m3 = scales.for_format("fp8_e4m3")  # compressed-tensors' float 8-bit scheme means E4M3FN
    back = scales_from_checkpoint(with_scales.checkpoint_scale_tensors, 30, 3, config, "fp8_e4m3")
    assert all(torch.equal(a, b) for a, b in zip(back.k + back.v, e4m3.k + e4m3.v))
    runner = ModelRunner(EngineConfig(model=out, kv_cache_dtype=run_with, kv_cache_memory="16MiB"),
                         log=lambda m: None, loaded=with_scales)
    assert runner.scales_source == "checkpoint (compressed-tensors KV cache scheme, per KV head)"
    for got, want in zip(runner.scales.k + runner.scales.v, scales.k + scales.v):
        torch.testing.assert_close(got, want * factor, rtol=0, atol=0)


def test_checkpoint_links_weight_files_and_keeps_a_sharded_index(tmp_path):
    """A sharded model keeps its shard names; the scales join the index in a file of their own. The shards are
    hard links to the model's (one file system here), the small files copies."""
    from conftest import build_tiny_model

    from fp8cache.model import checkpoints

    src = build_tiny_model(str(tmp_path / "src"))
    tensors = load_file(str(Path(src) / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:8], "model-00002-of-00002.safetensors": names[8:]}
    (Path(src) / "model.safetensors").unlink()
    for shard, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(Path(src) / shard), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (Path(src) / "model.safetensors.index.json").write_text(json.dumps(index))
    k = [torch.tensor([0.01 * (i + 1)]) for i in range(2)]
    result = cal.CalibrationResult(cal.kv_scales.KVScales(k, [t / 2 for t in k], "fp8_e4m3", "t"), k, k, "amax",
                                   "tensor", 1, 1, src, "llama", 2)
    written = cal.write_checkpoint(result, str(tmp_path / "out"))
    assert sorted(written.linked) == sorted(shards)
    for shard in shards:
        assert (Path(written.path) / shard).stat().st_ino == (Path(src) / shard).stat().st_ino
    assert "tokenizer.json" in written.copied
    assert (Path(written.path) / "tokenizer.json").stat().st_ino != (Path(src) / "tokenizer.json").stat().st_ino
    weight_map = json.loads((Path(written.path) / "model.safetensors.index.json").read_text())["weight_map"]
    assert {n: weight_map[n] for n in names} == index["weight_map"]
    assert weight_map["model.layers.1.self_attn.v_scale"] == cal.SCALES_FILE_IN_CHECKPOINT
    assert set(checkpoints.inventory(written.path)) == set(weight_map)
    loaded = load_model(EngineConfig(model=written.path), progress=False)
    assert torch.equal(loaded.checkpoint_scale_tensors["model.layers.1.self_attn.v_scale"], torch.tensor([0.01]))


def test_per_tensor_checkpoint_scales_have_shape_one(head_amax, tmp_path):
    result, _ = head_amax
    per_tensor = cal.kv_scales.KVScales([k.max().reshape(1) for k in result.scales.k],
                                        [v.max().reshape(1) for v in result.scales.v], "fp8_e4m3", "t")
    written = cal.write_checkpoint(cal.CalibrationResult(**{**result.__dict__, "scales": per_tensor}),
                                   str(tmp_path / "ckpt"))
    config = read_config_dict(written.path)
    assert config["quantization_config"]["kv_cache_scheme"]["strategy"] == "tensor"
    stored = load_file(str(Path(written.path) / "model-00002-of-00002.safetensors"))
    assert all(t.shape == (1,) for t in stored.values())
    assert torch.equal(stored["model.layers.7.self_attn.v_scale"], per_tensor.v[7])


def test_checkpoint_refusals(head_amax, tmp_path):
    result, _ = head_amax
    rotated = cal.CalibrationResult(**{**result.__dict__, "scales": cal.kv_scales.KVScales(
        result.scales.k, result.scales.v, "fp8_e4m3", "x", "hadamard")})
    with pytest.raises(cal.CalibrationError, match="--write-checkpoint cannot carry .*--kv-rotation hadamard"):
        cal.write_checkpoint(rotated, str(tmp_path / "a"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(cal.CalibrationError, match="exists and is not an empty folder"):
        cal.write_checkpoint(result, str(tmp_path / "full"))
    with pytest.raises(cal.CalibrationError, match="is the model folder itself"):
        cal.write_checkpoint(result, result.model_path)
    e5m2 = cal.CalibrationResult(**{**result.__dict__, "scales": cal.kv_scales.KVScales(
        result.scales.k, result.scales.v, "fp8_e5m2", "x")})
    with pytest.raises(cal.CalibrationError, match="means E4M3 scales; calibrate the checkpoint with --kv-cache-dtype"):
        cal.write_checkpoint(e5m2, str(tmp_path / "b"))


# ---- statistics ----------------------------------------------------------------------------------------

def quant_error(x: torch.Tensor, s: float, fmt: formats.Fp8Format) -> float:
    stored = torch.clamp(x / s, -fmt.max, fmt.max).to(fmt.torch_dtype).to(torch.float32)
    return float((stored * s - x).double().pow(2).sum())


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz"])
def test_mse_scale_is_no_worse_than_amax_or_any_grid_scale(name):
    fmt = formats.FP8_FORMATS[name]
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.01, 3, 4096)
    amax = float(x.abs().max())
    best = cal.mse_scale(amax, x, fmt)
    assert quant_error(x, best, fmt) <= quant_error(x, amax / fmt.max, fmt)
    for j in range(-cal.SEARCH_STEPS, 2 * cal.SEARCH_STEPS + 1, 5):
        assert quant_error(x, best, fmt) <= quant_error(x, amax / fmt.max * 2 ** (-j / cal.SEARCH_STEPS), fmt)


def test_percentile_and_granularity_of_choose_scale():
    x = torch.randn(20000, 2, 8, generator=torch.Generator().manual_seed(2))
    x[0, 1, 0] = 100.0  # one outlier in head 1
    amax = x.abs().amax(dim=(0, 2))
    per_head = cal.choose_scale(amax, x, E4M3, "head", "amax")
    torch.testing.assert_close(per_head, amax / E4M3.max)
    assert cal.choose_scale(amax, x, E4M3, "tensor", "amax").tolist() == pytest.approx([100.0 / E4M3.max])
    pct = cal.choose_scale(amax, x, E4M3, "head", "percentile")
    expected = [float(torch.quantile(x[:, h].abs().reshape(-1), cal.PERCENTILE / 100)) / E4M3.max for h in (0, 1)]
    assert pct.tolist() == pytest.approx(expected, rel=1e-6)
    assert float(pct[1]) < float(per_head[1]) / 10  # the outlier is clipped, not followed
    zero = cal.choose_scale(torch.zeros(2), torch.zeros(10, 2, 8), E4M3, "head", "mse")
    assert zero.tolist() == pytest.approx([cal.kv_scales.MIN_SCALE] * 2)


# ---- datasets ------------------------------------------------------------------------------------------

def test_jsonl_text_and_chat_messages(loaded, tmp_path):
    tok = loaded.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is Paris."}]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join([json.dumps({"text": "Paris is a city in France " * 8}), "",
                               json.dumps({"messages": messages}), json.dumps({"text": "unused"})]) + "\n")
    samples = cal.read_samples(str(path), tok, 2, 20)
    assert samples[0] == tok("Paris is a city in France " * 8)["input_ids"][:20]
    chat = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    assert samples[1] == chat[:20] and len(samples) == 2


def test_text_file_is_cut_into_consecutive_windows(loaded, texts):
    ids = loaded.tokenizer(read_text(texts[1]))["input_ids"]
    assert cal.read_samples(texts[1], loaded.tokenizer, 3, 50) == [ids[0:50], ids[50:100], ids[100:150]]


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 2: not valid JSON"),
    ('{"prompt": "x"}', "line 2: expected an object with a \"text\" string or a \"messages\" list"),
    ('{"messages": [{"role": "user"}]}', "line 2: each message must be"),
])
def test_bad_jsonl_lines_are_named(loaded, tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "fine text here"}) + "\n" + line + "\n")
    with pytest.raises(cal.CalibrationError, match=message.replace("[", r"\[")):
        cal.read_samples(str(path), loaded.tokenizer, 5, 32)


def test_unusable_datasets_are_refused(loaded, tmp_path):
    empty, binary = tmp_path / "empty.txt", tmp_path / "weights.bin"
    empty.write_text("")
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(cal.CalibrationError, match="holds no text"):
        cal.read_samples(str(empty), loaded.tokenizer, 2, 32)
    with pytest.raises(cal.CalibrationError, match="is not UTF-8 text"):
        cal.read_samples(str(binary), loaded.tokenizer, 2, 32)
    with pytest.raises(cal.CalibrationError, match="does not exist"):
        cal.read_samples(str(tmp_path / "missing.txt"), loaded.tokenizer, 2, 32)


def test_a_json_file_is_read_as_a_list_of_records(loaded, tmp_path):
    tok = loaded.tokenizer
    records = [{"text": "Paris is a city in France " * 8}, {"text": "Berlin is a city in Germany " * 8}]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(records))
    assert cal.read_samples(str(path), tok, 2, 40) == [tok(r["text"])["input_ids"][:40] for r in records]


@pytest.mark.parametrize("content, message", [
    ("Paris is a city in France. " * 40, "not valid JSON"),
    ("\n".join([json.dumps({"text": "Paris is a city in France " * 8})] * 4), "rename the file"),  # JSON lines
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (json.dumps([{"prompt": "Paris is a city in France " * 8}]), 'item 0: expected an object with a "text"'),
])
def test_a_json_file_that_is_not_json_records_is_refused(loaded, tmp_path, content, message):
    path = tmp_path / "data.json"
    path.write_text(content)
    with pytest.raises(cal.CalibrationError, match=re.escape(message)) as err:
        cal.read_samples(str(path), loaded.tokenizer, 4, 32)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".json"])
def test_too_little_data_is_refused_unless_that_little_was_asked_for(loaded, tmp_path, suffix):
    tok = loaded.tokenizer
    text = "Paris is in France."
    ids = tok(text)["input_ids"]
    path = tmp_path / f"tiny{suffix}"
    path.write_text({".txt": text, ".jsonl": json.dumps({"text": text}) + "\n",
                     ".json": json.dumps([{"text": text}])}[suffix])
    with pytest.raises(cal.CalibrationError) as err:
        cal.read_samples(str(path), tok, 32, 512)
    assert f"only {len(ids)} tokens" in str(err.value) and str(path) in str(err.value)
    assert f"at least {cal.MIN_CALIBRATION_TOKENS}" in str(err.value)
    assert cal.read_samples(str(path), tok, 1, len(ids)) == [ids]  # a request this small is a choice


def test_without_a_dataset_the_second_half_of_the_shipped_text_is_used(loaded, monkeypatch):
    import fp8cache

    monkeypatch.delenv("FP8KV_EVAL_TEXT", raising=False)
    raw = (Path(fp8cache.__file__).parent / "data" / "wikitext-2-raw" / "wiki.test.raw").read_bytes()
    text = raw.decode("utf-8")
    samples = cal.read_samples(None, loaded.tokenizer, 3, 64)
    assert [len(s) for s in samples] == [64, 64, 64]
    joined = loaded.tokenizer.decode([t for s in samples for t in s], skip_special_tokens=True)
    # Consecutive windows of one stretch of the second half: never what eval and bench cut from the start.
    assert text.find(joined) >= len(text) // 2


def _flat(output: str) -> str:
    return output.replace("\n", "")  # rich folds long lines (paths) at 80 columns


def test_command_checks_the_output_before_calibrating(tiny_llama_path, tmp_path, monkeypatch):
    def no_calibration(*args, **kwargs):
        raise AssertionError("calibrated before the output was checked")

    monkeypatch.setattr(cal, "calibrate", no_calibration)
    data = tmp_path / "data.txt"
    data.write_text("the city of the river " * 40)
    missing = tmp_path / "no-such-folder" / "scales.json"
    run = CliRunner().invoke(calibrate_command, [tiny_llama_path, "--dataset", str(data), "-o", str(missing)])
    assert run.exit_code == 2, run.output
    # the message may shorten a long folder's middle to "/.../": its own name stays
    assert f"/{missing.parent.name} does" in _flat(run.output) and "not exist" in _flat(run.output)
    existing = tmp_path / "scales.json"
    existing.write_text("keep me")
    run = CliRunner().invoke(calibrate_command, [tiny_llama_path, "--dataset", str(data), "-o", str(existing)])
    assert run.exit_code == 2, run.output
    assert "--force" in _flat(run.output) and str(existing) in _flat(run.output)
    assert existing.read_text() == "keep me"


def test_command_replaces_an_output_with_force_and_defaults_to_the_shipped_text(tiny_llama_path, tmp_path,
                                                                               monkeypatch):
    monkeypatch.delenv("FP8KV_EVAL_TEXT", raising=False)
    out = tmp_path / "scales.json"
    out.write_text("old")
    run = CliRunner().invoke(calibrate_command, [tiny_llama_path, "--num-samples", "2", "--max-seq-len", "64",
                                                 "-o", str(out), "--force"])
    assert run.exit_code == 0, run.output
    assert load_scales_file(str(out), 2, 2, "fp8_e4m3").num_layers == 2
    assert "2 samples, 128 tokens" in _flat(run.output)


# ---- the command and held-out quality ----------------------------------------------------------------------

def test_command_writes_the_file_and_prints_the_table(tiny_llama_path, tmp_path):
    words = "the city of the river was the first new school in the world and the people of the state had a house"
    data = tmp_path / "tiny.txt"
    data.write_text(" ".join([words] * 7))  # 147 tokens: the 128 that 2 x 64 asks for
    out = tmp_path / "tiny.json"
    run = CliRunner().invoke(calibrate_command, [tiny_llama_path, "--dataset", str(data), "--num-samples", "2",
                                                 "--max-seq-len", "64", "--kv-cache-dtype", "fp8_e5m2",
                                                 "--output", str(out)], terminal_width=200)
    assert run.exit_code == 0, run.output
    assert "KV scales (fp8_e5m2" in run.output and "│     1 │" in run.output
    assert load_scales_file(str(out), 2, 2, "fp8_e5m2").per_head()
    assert load_scales_file(str(out), 2, 2, "fp8_e5m2").recent_window is None
    assert "vLLM scale" not in run.output
    windowed = CliRunner().invoke(calibrate_command, [tiny_llama_path, "--dataset", str(data), "--num-samples", "1",
                                                      "--max-seq-len", "32", "--kv-cache-dtype", "fp8_e5m2",
                                                      "--kv-recent-window", "16", "--output", str(out), "--force"])
    assert windowed.exit_code == 0, windowed.output
    assert load_scales_file(str(out), 2, 2, "fp8_e5m2").recent_window == 16
    rotated = CliRunner().invoke(calibrate_command, [tiny_llama_path, "--dataset", str(data), "--num-samples", "1",
                                                     "--max-seq-len", "32", "--kv-rotation", "hadamard", "--output",
                                                     str(out), "--force"], terminal_width=200)
    assert rotated.exit_code == 0, rotated.output
    assert "vLLM scale" in rotated.output
    assert load_scales_file(str(out), 2, 2, "fp8_e4m3").unrotated_scales == pytest.approx(
        vllm_schema_scales(str(out), 2), rel=1e-7)
    bad = CliRunner().invoke(calibrate_command, [tiny_llama_path, "--dataset", str(data), "--kv-rotation",
                                                 "hadamard", "--output", str(out), "--force", "--write-checkpoint",
                                                 str(tmp_path / "ckpt")])
    assert bad.exit_code == 2 and "cannot carry" in bad.output
    ckpt = tmp_path / "ckpt"
    made = CliRunner().invoke(calibrate_command, [tiny_llama_path, "--dataset", str(data), "--num-samples", "1",
                                                  "--max-seq-len", "32", "--output", str(out), "--force",
                                                  "--write-checkpoint", str(ckpt)], terminal_width=400)
    assert made.exit_code == 0, made.output
    assert "compressed-tensors kv_cache_scheme, attn_head; 1 weight files linked" in _flat(made.output)
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]["num_bits"] == 8


@pytest.mark.slow
def test_scales_calibrated_on_one_text_help_on_another(default_model_path, texts, tmp_path):
    calib, held_out = texts
    assert read_text(held_out) not in read_text(calib)
    result = cal.calibrate(default_model_path, calib, "fp8_e4m3", 4, 128, granularity="head",
                           kv_rotation="hadamard")
    path = str(tmp_path / "calibrated.json")
    cal.write_scales(result, path)
    config = EngineConfig(model=default_model_path, kv_cache_dtype="fp8_e4m3")
    calibrated = evaluate(EngineConfig(**{**config.__dict__, "quantization_param_path": path}), held_out,
                          windows=1, window_len=512, progress=False)
    unit = evaluate(config, held_out, windows=1, window_len=512, progress=False)
    assert calibrated["scales_source"] == f"file {path}" and unit["scales_source"] == "default 1.0"
    assert calibrated["kl"] < 0.75 * unit["kl"], (calibrated["kl"], unit["kl"])
    assert calibrated["top1_agreement"] > 0.9
