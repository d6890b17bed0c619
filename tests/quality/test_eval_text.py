"""The WikiText-2 test text ships in the package: intact, with its licence, in a non-editable build, the
default of eval / calibrate / bench, and nothing of the product or its tests looks beside the repo for it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fp8cache.quality import eval as fp8_eval
from launcher import bench as bench_commands

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "fp8cache" / "data" / "wikitext-2-raw"


def test_the_shipped_text_has_the_checksum_its_readme_states():
    stated = re.search(r"sha256:\s*([0-9a-f]{64})", (DATA / "README.md").read_text(encoding="utf-8"))
    assert stated, "the README beside wiki.test.raw must state its sha256"
    assert hashlib.sha256((DATA / "wiki.test.raw").read_bytes()).hexdigest() == stated.group(1)


def test_the_licence_notice_lies_beside_the_text():
    notice = (DATA / "LICENSE").read_text(encoding="utf-8")
    assert "Attribution-ShareAlike 3.0" in notice and "creativecommons.org/licenses/by-sa/3.0" in notice
    assert "Merity" in notice  # the credit CC BY-SA asks for


def test_the_default_text_is_the_shipped_one_wherever_we_run(monkeypatch, tmp_path):
    monkeypatch.delenv("FP8KV_EVAL_TEXT", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing beside the working directory either
    path = fp8_eval.locate_eval_text()
    assert os.path.samefile(path, DATA / "wiki.test.raw")
    # read_text keeps the bytes: CRLF line ends decide the token stream the README's figures come from.
    assert fp8_eval.read_text(path).encode("utf-8") == (DATA / "wiki.test.raw").read_bytes()


def test_overrides_still_win_and_a_missing_one_is_named(monkeypatch, tmp_path):
    mine = tmp_path / "mine.txt"
    mine.write_text("some other text")
    monkeypatch.setenv("FP8KV_EVAL_TEXT", str(mine))
    assert fp8_eval.locate_eval_text() == str(mine)
    other = tmp_path / "other.txt"
    other.write_text("x")
    assert fp8_eval.locate_eval_text(str(other)) == str(other)
    monkeypatch.setenv("FP8KV_EVAL_TEXT", str(tmp_path / "gone.txt"))
    with pytest.raises(FileNotFoundError, match="gone.txt"):
        fp8_eval.locate_eval_text()


def test_a_missing_shipped_text_says_how_to_fix_it(monkeypatch, tmp_path):
    monkeypatch.delenv("FP8KV_EVAL_TEXT", raising=False)
    monkeypatch.setattr(fp8_eval, "SHIPPED_EVAL_TEXT", str(tmp_path / "wiki.test.raw"))
    with pytest.raises(FileNotFoundError) as err:
        fp8_eval.locate_eval_text()
    assert "reinstall" in str(err.value) and "--text" in str(err.value)


def test_a_non_editable_build_carries_the_text_and_its_notice(tmp_path):
    # build_py is what a wheel (and so a non-editable pip install) copies the package from.
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=ROOT,
                   check=True, capture_output=True)
    built = tmp_path / "fp8cache" / "data" / "wikitext-2-raw"
    for name in ("wiki.test.raw", "LICENSE", "README.md"):
        assert (built / name).read_bytes() == (DATA / name).read_bytes(), name


def test_nothing_reads_the_shared_folder_beside_the_repo():
    # Spelled in pieces so this file does not match itself.
    patterns = [re.compile(p) for p in (r"\.\./" + "shared", r"[\"']" + r"shared[\"']\s*,\s*[\"']data",
                                        "shared" + r"/data/")]
    offenders = []
    for folder in ("fp8cache", "launcher", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            offenders += [f"{path.relative_to(ROOT)}: {p.pattern}" for p in patterns if p.search(text)]
    assert not offenders, f"users have no shared folder beside the repo; use the shipped text: {offenders}"


# ---- bench --text -----------------------------------------------------------------------------------


def _no_engines(*args, **kwargs):
    raise AssertionError("engines were built before the prompt text was checked")


@pytest.mark.parametrize("command, module, function", [
    (bench_commands.throughput, "throughput", "iter_throughput"),
    (bench_commands.capacity, "capacity", "iter_capacity"),
])
def test_bench_fails_before_building_engines_when_the_text_is_missing(monkeypatch, tmp_path, command, module,
                                                                      function):
    import importlib

    monkeypatch.setattr(importlib.import_module(f"fp8cache.bench.{module}"), function, _no_engines)
    missing = tmp_path / "missing.txt"
    result = CliRunner().invoke(command, ["--text", str(missing)])
    assert result.exit_code == 2, result.output
    assert str(missing) in result.output and "not a file" in result.output
    monkeypatch.setenv("FP8KV_EVAL_TEXT", str(missing))
    result = CliRunner().invoke(command, [])
    assert result.exit_code == 2, result.output
    assert "FP8KV_EVAL_TEXT" in result.output


@pytest.mark.parametrize("given", [True, False])
def test_bench_throughput_cuts_its_prompts_from_the_chosen_text(monkeypatch, tmp_path, given):
    from fp8cache.bench import throughput

    seen = {}

    def record(*args, **kwargs):
        seen.update(kwargs)
        return iter(())

    monkeypatch.delenv("FP8KV_EVAL_TEXT", raising=False)
    monkeypatch.setattr(throughput, "iter_throughput", record)
    mine = tmp_path / "prompts.txt"
    mine.write_text("text to cut prompts from")
    result = CliRunner().invoke(bench_commands.throughput, ["--json", *(["--text", str(mine)] if given else [])])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == []
    assert os.path.samefile(seen["text_path"], mine if given else DATA / "wiki.test.raw")
