"""scripts/suite_under_load.py, issue 39's measurement of the README's test command on a busy machine: the
command it runs is the README's, its figures come from /proc/stat readings (injected here), and a real run
reports pytest's result."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest
from script_module import load_script

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script():
    yield load_script("suite_under_load.py")
    sys.modules.pop("suite_under_load", None)


def test_it_runs_the_readmes_test_command(script):
    readme = next(line for line in (REPO / "README.md").read_text().splitlines() if "python -m pytest " in line)
    readme_args = shlex.split(readme.split("python -m pytest ", 1)[1].split("#", 1)[0])
    assert script.readme_pytest_args() == readme_args
    assert "tests" in readme_args


def test_a_ci_script_without_pytest_is_an_error(script, tmp_path):
    ci = tmp_path / "run"
    ci.write_text("#!/bin/sh\n# python -m pytest in a comment only\necho\n")
    with pytest.raises(ValueError, match="no `python -m pytest` line"):
        script.readme_pytest_args(ci)


def test_a_reading_splits_busy_and_idle_leaves_out_steal_and_takes_the_busy_process_own_time(script, tmp_path):
    # user nice system idle iowait irq softirq steal guest guest_nice
    (tmp_path / "stat").write_text("cpu  100 5 20 300 7 1 2 3 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    (tmp_path / "42").mkdir()
    fields = ["S"] + ["0"] * 10 + ["11", "4"] + ["0"] * 30  # utime (14th field) 11, stime 4
    (tmp_path / "42" / "stat").write_text("42 (y e s) " + " ".join(fields))
    sample = script.read_sample(42, proc=tmp_path)
    assert (sample.busy, sample.idle, sample.busy_process) == (100 + 5 + 20 + 1 + 2, 307, 15)  # not steal's 3
    assert script.read_sample(43, proc=tmp_path).busy_process == -1  # no such process
    assert script.read_sample(None, proc=tmp_path).busy_process == 0


def test_the_report_takes_the_busy_process_share_out_of_the_machines(script):
    s = script.Sample
    samples = [s(1000.0, 500, 100, 40), s(1001.0, 700, 100, 140), s(1600.0, 120500, 1600, 60040),
               s(1601.0, 120700, 1600, -1)]  # the busy process ended before the last reading
    report = script.summarize(samples, hz=100)
    assert report.wall_s == 601.0
    assert report.busy_process_cpu_s == 600.0
    assert report.ours_cpu_s == (120700 - 500 - 60000) / 100
    assert report.idle_cpu_s == 15.0
    with pytest.raises(ValueError):
        script.summarize(samples[:1], hz=100)


@pytest.mark.parametrize(("wall", "verdict"), [(900.0, "met"), (900.4, "MISSED")])
def test_the_last_row_holds_the_wall_time_to_the_limit(script, wall, verdict):
    lines = script.report_lines(script.Report(wall, 1200.0, 500.0, 3.0), 900.0, "5 passed in 1.0s")
    assert lines[-1].startswith("README tests under load: <= 900 s")
    assert lines[-1].split()[-1] == verdict
    assert "1200 CPU-s (1.33 cores on average)" in lines[1]
    assert lines[4] == "pytest: 5 passed in 1.0s"


def test_own_session_puts_the_busy_process_in_a_session_of_its_own(script):
    for mode, own in (("own-session", True), ("same-session", False)):
        busy = script.start_busy(mode)
        try:
            assert (os.getsid(busy.pid) == busy.pid) is own
        finally:
            busy.kill()
            busy.wait()
    assert script.start_busy("none") is None


def test_a_run_reports_pytests_result_and_status(script, tmp_path, capsys):
    selection = "tests/test_docs_paths.py::test_the_check_sees_a_moved_file"
    status = script.main(["--out", str(tmp_path), "--busy", "none", "--keep-cache", "--",
                          "-q", "-p", "no:cacheprovider", selection])
    printed = capsys.readouterr().out
    assert status == 0, (tmp_path / "pytest.log").read_text()
    assert re.search(r"^pytest: 1 passed in [0-9.]+s$", printed, re.MULTILINE), printed
    assert (tmp_path / "report.txt").read_text().splitlines()[-1] in printed
    failing = script.main(["--out", str(tmp_path), "--busy", "none", "--keep-cache", "--",
                           "-q", "-p", "no:cacheprovider", "tests/no_such_file.py"])
    assert failing != 0
