"""What a new user reads first: the README's two set-up commands come first and its test command is the one CI
runs; every `fp8kv` command and flag the README and the docs show exists; every link leads to a file and heading
that exist; the curl examples send valid JSON that answers the same way every time."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import click
import pytest

from launcher.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
# docs/benchmarks.md keeps old records as they were run, flags since renamed included.
CURRENT_DOCS = [README, *(d for d in DOCS if d.name != "benchmarks.md")]


def readme_commands() -> list[str]:
    """The commands of the README's first code block, without their comments."""
    block = re.search(r"```bash\n(.*?)```", README.read_text(), re.DOTALL).group(1)
    return [line.split("   #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def ci_command() -> str:
    return [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()][-1]


def test_the_two_setup_commands_come_first_in_a_fresh_venv():
    text = README.read_text()
    assert text.index("```bash") < text.index("\n## "), "the set-up commands must come before every section"
    run, tests = readme_commands()
    for command in (run, tests):
        assert command.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ")
    assert run.endswith("fp8kv run --kv-cache-dtype fp8")
    assert "python -m pytest " in tests


def test_the_readme_test_command_is_what_ci_runs():
    assert readme_commands()[1] == ci_command()
    copies = [line for line in README.read_text().splitlines() if "python -m pytest -q -rs" in line]
    assert len(copies) == 2 and all(line.split("   #", 1)[0] == ci_command() for line in copies)


def code_snippets(text: str) -> list[str]:
    """Shell lines of fenced bash blocks (continuations joined) and inline code spans."""
    snippets, rest, lines = [], [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if lines[i].strip() == "```bash":
                snippets += "\n".join(lines[i + 1:end]).replace("\\\n", " ").splitlines()
            i = end + 1
            continue
        rest.append(lines[i])
        i += 1
    snippets += re.findall(r"`([^`\n]+)`", "\n".join(rest))
    return snippets


def fp8kv_invocations(snippet: str) -> list[list[str]]:
    """Each `fp8kv ...` in a snippet as its words, split at &&, ; and a spaced pipe; comments dropped."""
    found = []
    for piece in re.split(r"&&|;| \| ", snippet):
        piece = piece.strip()
        if piece.startswith("fp8kv "):
            try:
                found.append(shlex.split(piece, comments=True))
            except ValueError:  # an unbalanced quote in prose: not a command
                continue
    return found


def command_options(words: list[str]) -> set[str] | None:
    """The options the command named by `fp8kv WORDS...` takes (every alternative of `a|b`), None when the words
    name no command (a placeholder such as <command>)."""
    ctx = click.Context(main)
    names = words[1].split("|")
    if words[1] == "bench" and len(words) > 2:
        bench = main.get_command(ctx, "bench")
        commands = [bench.get_command(ctx, name) for name in words[2].split("|")]
    else:
        commands = [main.get_command(ctx, name) for name in names]
    if not commands or any(c is None for c in commands):
        return None
    options = {"-h", "--help"}
    for command in commands:
        options |= {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    return options


def unknown_flags(text: str) -> list[str]:
    bad = []
    for snippet in code_snippets(text):
        for words in fp8kv_invocations(snippet):
            if len(words) < 2:
                continue
            options = command_options(words)
            if options is None:
                continue
            bad += [f"{' '.join(words[:2])} {w}" for w in words[2:]
                    if w.startswith("--") and w.split("=")[0] not in options]
    return bad


def every_option() -> set[str]:
    ctx = click.Context(main)
    options, groups = {"-h", "--help"}, [main]
    while groups:
        group = groups.pop()
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            if isinstance(command, click.Group):
                groups.append(command)
            else:
                options |= {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    return options


def unknown_flag_names(text: str) -> list[str]:
    """Code spans that start with a flag (`--dtype`, `--num-shard N`) naming no option of any fp8kv command."""
    options = every_option()
    return [s for s in code_snippets(text) if s.startswith("--") and re.split(r"[ =]", s)[0] not in options]


@pytest.mark.parametrize("doc", CURRENT_DOCS, ids=lambda p: p.name)
def test_every_flag_shown_exists(doc):
    bad = unknown_flags(doc.read_text())
    assert not bad, f"{doc.name} shows flags fp8kv does not have: {bad}"


# The user's pages name flags alone too (the README's table); development.md and design.md also name the
# scripts' and compilers' flags.
@pytest.mark.parametrize("doc", [README, ROOT / "docs" / "usage.md"], ids=lambda p: p.name)
def test_every_flag_named_alone_exists(doc):
    bad = unknown_flag_names(doc.read_text())
    assert not bad, f"{doc.name} names flags no fp8kv command has: {bad}"


def test_the_flag_check_sees_a_wrong_flag():
    text = ("`fp8kv run --kv-cache-dtype fp8 --no-such-flag`\n\n```bash\nfp8kv bench kernels|capacity \\\n"
            "  --repeats 3 --no-such-bench-flag   # --not-a-flag\n```\n`fp8kv run --gone`\n")
    assert sorted(unknown_flags(text)) == ["fp8kv bench --no-such-bench-flag", "fp8kv run --gone",
                                           "fp8kv run --no-such-flag"]
    assert unknown_flag_names("`--dtype` `--num-shard N` `--no-such-flag X`\n") == ["--no-such-flag X"]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.DOTALL)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.MULTILINE)}


def broken_links(doc: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.DOTALL)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
            bad.append(target)
    return bad


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_every_link_leads_to_a_file_and_heading(doc):
    assert not broken_links(doc), f"{doc.name} links to what does not exist: {broken_links(doc)}"


def test_the_link_check_sees_a_missing_file_and_heading(tmp_path):
    (tmp_path / "a.md").write_text("# A\n\n## Run as a service (`x`)\n\n[ok](#run-as-a-service-x) [no](#gone) "
                                   "[file](b.md) [web](https://example.com)\n")
    assert broken_links(tmp_path / "a.md") == ["#gone", "b.md"]


def curl_bodies(text: str) -> list[tuple[str, str]]:
    """(route, JSON body) of each curl example, its continuation lines joined."""
    joined = text.replace("\\\n", " ")
    return re.findall(r"curl -s localhost:\d+(/\S+) .*?-d '([^']+)'", joined)


def test_the_openai_curl_examples_are_valid_json_and_greedy():
    bodies = curl_bodies(README.read_text())
    assert any(route == "/v1/chat/completions" for route, _ in bodies)
    for route, body in bodies:
        request = json.loads(body)
        if route.startswith("/v1/"):
            assert request.get("temperature") == 0, f"{route}: the example must answer the same way every time"
