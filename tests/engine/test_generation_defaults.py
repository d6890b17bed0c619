"""Request defaults from a model's generation_config.json (vLLM's --generation-config auto|vllm|FOLDER and
--override-generation-config), and LLM.get_default_sampling_params. The files are written by transformers'
own GenerationConfig, the reference for what a model folder holds."""

from __future__ import annotations

import json
import shutil

import pytest

from fp8cache import SamplingParams
from fp8cache.engine.generation_defaults import (
    GenerationDefaults,
    check_generation_flags,
    default_max_tokens,
    describe_cap,
    load_generation_defaults,
)

RECOMMENDED = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2,
               "max_new_tokens": 50}


def write_generation_config(folder, **fields) -> str:
    from transformers import GenerationConfig

    GenerationConfig(do_sample=True, bos_token_id=1, eos_token_id=2, **fields).save_pretrained(str(folder))
    return str(folder)


@pytest.fixture
def model_folder(tmp_path):
    return write_generation_config(tmp_path / "model", **RECOMMENDED)


def test_the_models_fields_become_the_defaults(model_folder):
    defaults = load_generation_defaults("auto", model_folder)
    params = defaults.sampling_params()
    got = {name: getattr(params, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    assert got == {k: v for k, v in RECOMMENDED.items() if k != "max_new_tokens"}
    assert params.max_tokens == defaults.max_new_tokens == 50
    assert "generation_config.json" in defaults.describe() and "temperature=0.6" in defaults.describe()


def test_a_given_field_wins_over_the_models(model_folder):
    params = load_generation_defaults("auto", model_folder).sampling_params(temperature=0.0, max_tokens=3)
    assert (params.temperature, params.max_tokens, params.top_k) == (0.0, 3, 20)


def test_overrides_replace_single_fields(model_folder):
    defaults = load_generation_defaults("auto", model_folder, '{"temperature": 0, "max_new_tokens": 7}')
    params = defaults.sampling_params()
    assert (params.temperature, params.max_tokens, params.top_k, params.top_p) == (0.0, 7, 20, 0.9)
    assert "--override-generation-config" in defaults.describe()
    assert load_generation_defaults("auto", model_folder, {"top_k": 5}).sampling_params().top_k == 5  # LLM's dict


@pytest.mark.parametrize("choice", ["vllm", "none"])
def test_vllm_ignores_the_models_file_but_keeps_overrides(model_folder, choice):
    assert load_generation_defaults(choice, model_folder).sampling_params() == SamplingParams()
    defaults = load_generation_defaults(choice, model_folder, '{"top_p": 0.5}')
    assert defaults.sampling_params() == SamplingParams(top_p=0.5)
    assert defaults.max_new_tokens is None


def test_a_folder_choice_reads_that_folders_file(tmp_path, model_folder):
    other = write_generation_config(tmp_path / "other", temperature=0.3)
    defaults = load_generation_defaults(other, model_folder)
    assert defaults.sampling == {"temperature": 0.3}
    with pytest.raises(ValueError, match=r"--generation-config .*no generation_config.json in that folder"):
        check_generation_flags(str(tmp_path / "nowhere"), None)


def test_a_model_without_the_file_gets_neutral_defaults(tmp_path, model_folder):
    bare = tmp_path / "bare"
    shutil.copytree(model_folder, bare)
    (bare / "generation_config.json").unlink()
    defaults = load_generation_defaults("auto", str(bare))
    assert defaults == GenerationDefaults(source=defaults.source)
    assert "no generation_config.json" in defaults.describe()


@pytest.mark.parametrize(("override", "named"), [
    ('{"temprature": 0.5}', "unknown field(s) temprature"),
    ("{temperature: 0.5}", "not valid JSON"),
    ("[0.5]", "must be a JSON object"),
    ('{"temperature": -1}', "temperature=-1 is invalid"),
    ('{"max_new_tokens": 0}', "max_new_tokens=0 is invalid"),
])
def test_bad_overrides_fail_naming_the_problem(model_folder, override, named):
    with pytest.raises(ValueError, match="override-generation-config") as info:
        load_generation_defaults("auto", model_folder, override)
    assert named in str(info.value)


def test_a_bad_value_in_the_models_file_names_the_file(tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ValueError, match=r"bad/generation_config.json: top_p=1.5 is invalid"):
        load_generation_defaults("auto", str(folder))


@pytest.mark.parametrize(("room", "cap", "model", "want"), [
    (4000, 1024, None, 1024),  # the server's cap
    (500, 1024, None, 500),  # never past the context
    (4000, 1024, 256, 256),  # the model's max_new_tokens when smaller
    (4000, 100, 256, 100),
    (4000, 0, None, 4000),  # 0: the room left
    (4000, 0, 256, 256),
])
def test_the_default_cap_on_new_tokens(room, cap, model, want):
    assert default_max_tokens(room, cap, model) == want


def test_the_cap_is_described_for_the_start_line():
    assert describe_cap(0, None) == "the room left in the context"
    assert "1024 (--default-max-tokens)" in describe_cap(1024, None)
    assert "256 (the generation config's max_new_tokens)" in describe_cap(0, 256)


def test_llm_generates_with_the_models_defaults(make_tiny_model):
    """A model that recommends top_k=1 samples greedily when generate() gets no SamplingParams, as in vLLM."""
    from fp8cache import LLM

    path = make_tiny_model()
    write_generation_config(path, temperature=1.0, top_k=1, max_new_tokens=50)
    llm = LLM(model=path, kv_cache_memory="2MiB", max_model_len=64, override_generation_config={"max_new_tokens": 6},
              log=lambda message: None)
    with llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (1.0, 1, 6)
        prompt = "the city of the river"
        got = llm.generate(prompt)[0].outputs[0]
        want = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
        sampled = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=6, seed=0, ignore_eos=True))
        assert got.token_ids == want.token_ids
        assert (len(got.token_ids), got.finish_reason) == (6, "length")  # the override's max_new_tokens
        assert sampled[0].outputs[0].token_ids != want.token_ids  # without top_k=1 the model does not sample greedily
