"""The embedded default model: where it is cached, how a bad wheel is refused, and that it answers like
transformers' own greedy generation when run through the model runner."""

from __future__ import annotations

import os
import zipfile

import pytest
import torch

from fp8cache.config import EngineConfig
from fp8cache.model import default_model
from fp8cache.model.batch import SeqChunk, StepBatch
from fp8cache.model.loader import load_model, resolve_model_path
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


def test_greedy_chat_answer_matches_transformers_generate(default_model_path):
    from transformers import AutoModelForCausalLM

    config = EngineConfig(model=default_model_path, kv_cache_memory="32MiB")
    loaded = load_model(config, progress=False)
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
