"""--help as a new user reads it (issue 53 item 5): every command listed with its whole summary, without importing
any command (torch least of all), and the engine commands' options in sections, the most used first."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from launcher.cli import bench, main
from launcher.help_sections import OTHER, SECTIONS

REPO = Path(__file__).resolve().parents[2]


def _listed(output: str) -> dict[str, str]:
    """{command: its summary} from a group's --help, a summary's wrapped lines joined."""
    listed: dict[str, str] = {}
    name = None
    for line in output.split("Commands:\n", 1)[1].splitlines():
        match = re.match(r"  (\S+)\s+(.*)", line)
        if match and not line.startswith("   "):
            name = match.group(1)
            listed[name] = match.group(2).strip()
        elif name and line.strip():
            listed[name] += " " + line.strip()
    return listed


@pytest.mark.parametrize(("group", "args"), [(main, []), (bench, [])])
def test_every_command_is_listed_with_its_whole_summary(group, args):
    done = CliRunner().invoke(group, [*args, "--help"])
    assert done.exit_code == 0, done.output
    listed = _listed(done.output)
    assert sorted(listed) == sorted(group.list_commands(click.Context(group)))
    for name, summary in listed.items():
        assert "..." not in summary and summary.endswith("."), f"{name}: {summary!r} is cut short"
        assert summary[0].isupper() and len(summary) <= 72, f"{name}: {summary!r} is not one short sentence"
        command = group.get_command(click.Context(group), name)
        assert command is not None and command.get_short_help_str(limit=45) == summary  # nested help agrees


def test_top_level_help_imports_no_command():
    """What makes `fp8kv --help` take a tenth of a second rather than two: no command's file, so no torch."""
    probe = ("import sys\nfrom launcher.cli import main\n"
             "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'rich')"
             " or m.startswith(('launcher.', 'fp8cache.model', 'fp8cache.quality'))))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    loaded = done.stdout.split("LOADED", 1)[1].strip()
    assert loaded == "['launcher.cli']", loaded


def _sections(output: str) -> dict[str, list[str]]:
    """{section title: [long option names]} of a command's --help, in the order shown."""
    sections: dict[str, list[str]] = {}
    title = None
    for line in output.splitlines():
        if line and not line.startswith(" ") and line.endswith(":") and not line.startswith("Usage"):
            title = line[:-1]
            sections[title] = []
        elif title and re.match(r"  -", line):
            sections[title].append(re.findall(r"--[\w-]+", line)[0] if "--" in line else line.split()[0])
    return sections


@pytest.mark.parametrize("command", ["run", "generate", "systemd-unit"])
def test_engine_commands_list_their_options_in_sections(command):
    done = CliRunner().invoke(main, [command, "--help"])
    assert done.exit_code == 0, done.output
    sections = _sections(done.output)
    titles = list(sections)
    assert titles == [t for t in (*SECTIONS, OTHER) if t in titles]  # the one order, most used first
    assert sections[OTHER] == ["--help"], "an option without a section: give it section=... where it is declared"
    first = {"run": "Model", "generate": "Model", "systemd-unit": "Unit"}[command]
    assert titles[0] == first and {"Model", "KV cache", "Device"} <= set(titles)
    cmd = main.get_command(click.Context(main), command)
    options = [p for p in cmd.params if isinstance(p, click.Option)]
    shown = [name for names in sections.values() for name in names if name != "--help"]
    assert sorted(shown) == sorted(p.opts[0] for p in options)  # every option, once


def test_a_flag_is_in_the_same_section_in_every_command():
    seen: dict[str, tuple[str, str]] = {}
    for command in ("run", "generate", "systemd-unit"):
        sections = _sections(CliRunner().invoke(main, [command, "--help"]).output)
        for title, names in sections.items():
            for name in names:
                assert seen.setdefault(name, (title, command))[0] == title, (name, command, seen[name])
    assert seen["--kv-cache-dtype"][0] == "KV cache" and seen["--port"][0] == "Server"
    assert seen["--temperature"][0] == "Sampling" and seen["--num-shard"][0] == "Device"


def test_an_unknown_section_is_refused_where_the_option_is_declared():
    from launcher.options import option

    with pytest.raises(ValueError, match="'KV' is not one of"):
        click.command()(option("--x", section="KV", help="x.")(lambda x: None))
