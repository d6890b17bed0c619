"""EngineConfig is the one place an engine setting's type, default and check live (issue 55): every field has the
flag of its name with the field's default and choices (or a reason it has none), the flags make the config field
by field, and a wrong value is refused where the config is made, naming the field and what is valid."""

from __future__ import annotations

import dataclasses
import os

import click
import pytest

from fp8cache.config import EngineConfig, field_choices
from fp8cache.kvcache.dtype_names import KV_CACHE_DTYPES
from launcher.options import CLI_LESS, engine_config
from launcher.run import run


def _options(command: click.Command) -> dict[str, click.Option]:
    return {p.name: p for p in command.params if isinstance(p, click.Option)}


def test_every_field_has_its_flag_with_the_fields_default_or_a_reason():
    options = _options(run)
    for field in dataclasses.fields(EngineConfig):
        if field.name in CLI_LESS:
            assert field.name not in options, f"{field.name} is listed as CLI-less but has a flag"
            continue
        assert field.name in options, (f"EngineConfig.{field.name} has no --{field.name.replace('_', '-')}: add "
                                       "an engine_option in launcher/options.py, or list it in CLI_LESS")
        assert options[field.name].default == field.default, field.name
        if field.name in field_choices():
            assert tuple(options[field.name].type.choices) == field_choices()[field.name], field.name


@pytest.fixture
def no_flag_variables(monkeypatch):
    for name in [n for n in os.environ if n.startswith("FP8KV_")]:
        monkeypatch.delenv(name)


def test_no_flags_make_the_default_config(no_flag_variables):
    ctx = run.make_context("run", [])
    assert engine_config(None, ctx.params) == EngineConfig()


def test_flags_reach_their_fields_by_name(no_flag_variables, monkeypatch):
    monkeypatch.setenv("FP8KV_MAX_NUM_SEQS", "7")
    ctx = run.make_context("run", ["--kv-cache-dtype", "fp8_e5m2", "--block-size", "32", "--kv-cache-memory",
                                   "1048576", "--no-enable-prefix-caching", "--kv-recent-window", "0"])
    config = engine_config("m", ctx.params)
    assert (config.model, config.kv_cache_dtype, config.block_size, config.kv_cache_memory) == \
        ("m", "fp8_e5m2", 32, 2**20)
    assert (config.enable_prefix_caching, config.kv_recent_window, config.max_num_seqs) == (False, 0, 7)
    assert engine_config(None, {**ctx.params, "kv_cache_memory": "2GiB"}).kv_cache_memory == "2GiB"


def test_the_kv_cache_dtype_literal_is_the_command_lines_list():
    assert field_choices()["kv_cache_dtype"] == KV_CACHE_DTYPES


@pytest.mark.parametrize(("settings", "says"), [
    ({"kv_cache_dtype": "fp8_e3m4"}, "kv_cache_dtype='fp8_e3m4' is not known; valid choices: auto, fp8, fp8_e4m3"),
    ({"dtype": "half"}, "dtype='half' is not known; valid choices: auto, float32, bfloat16, float16"),
    ({"load_format": "pt"}, "load_format='pt' is not known; valid choices: auto, dummy"),
    ({"max_num_seqs": 0}, "max_num_seqs=0 must be an integer >= 1"),
    ({"max_model_len": 2.5}, "max_model_len=2.5 must be an integer >= 1 (or None)"),
    ({"kv_recent_window": -1}, "kv_recent_window=-1 must be an integer >= 0 (or None)"),
    ({"block_size": True}, "block_size=True must be an integer >= 1"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization=1.5 must be a share in (0, 1]"),
    ({"kv_cache_memory_fraction": 0}, "kv_cache_memory_fraction=0 must be a share in (0, 1]"),
])
def test_a_wrong_setting_is_refused_naming_the_field_and_what_is_valid(settings, says):
    with pytest.raises(ValueError) as refused:
        EngineConfig(**settings)
    assert str(refused.value).startswith(says)
    with pytest.raises(ValueError):  # replace() checks again
        dataclasses.replace(EngineConfig(), **settings)


def test_every_valid_choice_and_none_where_allowed_is_taken():
    for name, choices in field_choices().items():
        for value in choices:
            assert getattr(EngineConfig(**{name: value}), name) == value
    assert EngineConfig(max_model_len=None, kv_recent_window=None, seed=-1).kv_recent_window is None
