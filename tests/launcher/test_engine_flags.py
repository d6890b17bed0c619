"""EngineConfig is the one place an engine setting's type, default, check and --help words live (issue 55): the
engine flags are made from its fields, so every field has the flag of its name with the field's default, choices,
help and section (or a reason it has none), a new field is a new flag with nothing else to edit, the flags make
the config field by field, and a wrong value is refused where the config is made, naming the field and what is
valid."""

from __future__ import annotations

import dataclasses
import os
import typing

import click
import pytest

from fp8cache.config import EngineConfig, field_choices, setting
from fp8cache.kvcache.dtype_names import KV_CACHE_DTYPES
from launcher.generate import generate
from launcher.options import CLI_LESS, engine_config, engine_flag
from launcher.run import run
from launcher.systemd_unit import systemd_unit


def _options(command: click.Command) -> dict[str, click.Option]:
    return {p.name: p for p in command.params if isinstance(p, click.Option)}


@pytest.mark.parametrize("command", [run, generate, systemd_unit], ids=lambda c: c.name)
def test_every_field_has_its_flag_with_the_fields_default_help_and_section_or_a_reason(command):
    options = _options(command)
    for field in dataclasses.fields(EngineConfig):
        assert "no_flag" in field.metadata, f"EngineConfig.{field.name} is not declared with setting()"
        if field.name in CLI_LESS:
            assert field.name not in options, f"{field.name} is listed as CLI-less but has a flag"
            assert CLI_LESS[field.name] == field.metadata["no_flag"]
            continue
        flag = options.get(field.name)
        assert flag is not None, f"EngineConfig.{field.name} has no --{field.name.replace('_', '-')}"
        assert flag.opts[0] == "--" + field.name.replace("_", "-"), field.name
        assert flag.default == field.default, field.name
        assert flag.help.startswith(field.metadata["help"].split("{shapes}")[0]), field.name
        assert flag.section == field.metadata["section"], field.name
        assert flag.envvar == "FP8KV_" + field.name.upper(), field.name
        if field.name in field_choices():
            assert tuple(flag.type.choices) == field_choices()[field.name], field.name


def test_the_flags_come_in_field_order():
    """--help lists a section's flags, and systemd-unit writes them back, in the fields' order."""
    flagged = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in CLI_LESS]
    assert [name for name in _options(run) if name in flagged] == flagged


@dataclasses.dataclass
class _NewSettings:  # what a new EngineConfig field declares: its flag follows from it alone
    max_widgets: int | None = setting(None, section="Scheduling", at_least=2, help="Most widgets.")
    widget_mode: typing.Literal["fast", "slow"] = setting("fast", section="Device", help="How widgets run.")
    use_widgets: bool = setting(True, section="Device", help="Whether widgets run.")
    widget_file: str | None = setting(None, section="Model", path="existing file", metavar="FILE", help="Widgets.")


def _new_flags_command() -> click.Command:
    def command(**kw):
        return kw

    hints = typing.get_type_hints(_NewSettings)
    for field in reversed(dataclasses.fields(_NewSettings)):
        command = engine_flag(field, hints[field.name])(command)
    return click.command(command)


def test_a_new_field_is_a_flag_of_its_name_type_default_and_help(no_flag_variables, monkeypatch, tmp_path):
    command = _new_flags_command()
    assert command.main([], standalone_mode=False) == {"max_widgets": None, "widget_mode": "fast",
                                                       "use_widgets": True, "widget_file": None}
    monkeypatch.setenv("FP8KV_WIDGET_MODE", "slow")
    given = tmp_path / "w.json"
    given.write_text("{}")
    assert command.main(["--max-widgets", "3", "--no-use-widgets", "--widget-file", str(given)],
                        standalone_mode=False) == {"max_widgets": 3, "widget_mode": "slow", "use_widgets": False,
                                                   "widget_file": str(given)}
    for wrong in (["--max-widgets", "1"], ["--widget-mode", "medium"], ["--widget-file", str(tmp_path / "none")]):
        with pytest.raises(click.BadParameter):
            command.main(wrong, standalone_mode=False)
    help_text = command.get_help(click.Context(command))
    assert "Most widgets. [env: FP8KV_MAX_WIDGETS]" in help_text
    assert "--use-widgets / --no-use-widgets" in help_text


def test_a_setting_without_help_needs_a_reason_for_having_no_flag():
    with pytest.raises(ValueError, match="no_flag"):
        setting(1, section="Device")


@pytest.fixture
def no_flag_variables(monkeypatch):
    for name in [n for n in os.environ if n.startswith("FP8KV_")]:
        monkeypatch.delenv(name)


def test_no_flags_make_the_default_config(no_flag_variables):
    ctx = run.make_context("run", [])
    assert engine_config(None, ctx.params) == EngineConfig()


def test_flags_reach_their_fields_by_name(no_flag_variables, monkeypatch):
    monkeypatch.setenv("FP8KV_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("FP8KV_KV_RECENT_WINDOW_SINKS", "4")
    ctx = run.make_context("run", ["--kv-cache-dtype", "fp8_e5m2", "--block-size", "32", "--kv-cache-memory",
                                   "1048576", "--no-enable-prefix-caching", "--kv-recent-window", "0"])
    config = engine_config("m", ctx.params)
    assert (config.model, config.kv_cache_dtype, config.block_size, config.kv_cache_memory) == \
        ("m", "fp8_e5m2", 32, 2**20)
    assert (config.enable_prefix_caching, config.kv_recent_window, config.max_num_seqs) == (False, 0, 7)
    assert config.kv_recent_window_sinks == 4
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
    ({"kv_recent_window_sinks": -1}, "kv_recent_window_sinks=-1 must be an integer >= 0"),
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
