"""`fp8kv run` and `fp8kv generate` take the same --num-shard flag (alias --tensor-parallel-size, FP8KV_NUM_SHARD,
an integer >= 1), each with its own help."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from launcher.cli import main


@pytest.mark.parametrize(("command", "says"), [("run", "slice of the model's heads"), ("generate", "rank 0")])
def test_num_shard_is_one_flag_with_its_commands_help(command, says):
    params = {p.name: p for p in main.get_command(None, command).params}
    flag = params["num_shard"]
    assert flag.opts == ["--num-shard", "--tensor-parallel-size"] and flag.default == 1
    assert flag.envvar == "FP8KV_NUM_SHARD" and says in flag.help


@pytest.mark.parametrize("command", ["run", "generate"])
def test_num_shard_refuses_zero(command):
    result = CliRunner().invoke(main, [command, "--tensor-parallel-size", "0"])
    assert result.exit_code == 2 and "--num-shard" in result.output and "0" in result.output
