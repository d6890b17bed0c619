"""The README's test command on a busy machine, as issue 39 asks it to pass: timed, with its CPU counted.

    python scripts/suite_under_load.py [--out DIR] [--busy own-session|same-session|none] [--keep-cache]
                                       [--limit-s 900] [-- PYTEST ARGS]

By default the run starts from an empty fp8kv cache (a HOME of its own under --out: the default model's
conversion, the op libraries, the compile checks and the host emulations are all made by the run, as on a
clean machine) with `yes` busy beside it. `own-session` (the default) starts `yes` in a session of its own, as
another user's job or a second terminal would be: with the kernel's autogroups its group then weighs as much
as the tests' own session whatever the number of test processes, the harder case (0.75 of a core on a 2-core
VM on 2026-11-28). `same-session` shares one group with the tests, so `yes` is one thread among theirs and gets
less (0.5 of a core there). /proc/stat is read each second, so the report splits the
machine's busy time between the busy process and the rest (the run: every process it started, including those
that exit unwaited, and whatever else ran meanwhile).

Prints one line per figure and a last row: `README tests under load: <= LIMIT s   N s   met|MISSED`.
Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def readme_pytest_args(ci_run: Path = REPO / ".ci" / "run") -> list[str]:
    """The arguments of `python -m pytest` in .ci/run, which runs the README's test command (the install before
    it is not repeated: the run measures the tests)."""
    for line in ci_run.read_text().splitlines():
        if "python -m pytest " in line and not line.lstrip().startswith("#"):
            return shlex.split(line.split("python -m pytest ", 1)[1])
    raise ValueError(f"{ci_run} has no `python -m pytest` line")


@dataclass
class Sample:
    """One reading: seconds since the epoch, the machine's /proc/stat jiffies (busy and idle, all CPUs; a VM's
    stolen time is neither) and the busy process's own jiffies (user + system)."""

    t: float
    busy: int
    idle: int
    busy_process: int


def read_sample(busy_pid: int | None, proc: Path = Path("/proc")) -> Sample:
    fields = [int(x) for x in (proc / "stat").read_text().splitlines()[0].split()[1:]] + [0] * 8
    idle = fields[3] + fields[4]  # idle + iowait
    # user nice system irq softirq; not steal (the hypervisor's, not work done here); guest is inside user
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6]
    mine = 0
    if busy_pid is not None:
        try:
            stat = (proc / str(busy_pid) / "stat").read_text()
            after = stat[stat.rfind(")") + 2:].split()  # fields from the state on: utime, stime are 12, 13
            mine = int(after[11]) + int(after[12])
        except (OSError, IndexError, ValueError):  # gone: its last reading stands (summarize keeps the max)
            mine = -1
    return Sample(time.time(), busy, idle, mine)


@dataclass
class Report:
    wall_s: float
    ours_cpu_s: float
    busy_process_cpu_s: float
    idle_cpu_s: float


def summarize(samples: list[Sample], hz: int) -> Report:
    """Jiffies between the first and the last sample, in seconds. A busy-process reading of -1 (it had exited)
    counts as its last good one."""
    if len(samples) < 2:
        raise ValueError("at least two samples are needed")
    first, last = samples[0], samples[-1]
    readings = [s.busy_process for s in samples if s.busy_process >= 0]
    busy_process = (max(readings) - readings[0]) if readings else 0
    busy = last.busy - first.busy
    return Report(last.t - first.t, (busy - busy_process) / hz, busy_process / hz, (last.idle - first.idle) / hz)


def report_lines(report: Report, limit_s: float, result: str) -> list[str]:
    share = (report.ours_cpu_s / report.wall_s) if report.wall_s > 0 else 0.0
    met = "met" if report.wall_s <= limit_s else "MISSED"
    row = f"README tests under load: <= {limit_s:g} s"
    return [f"wall {report.wall_s:.0f} s", f"this run {report.ours_cpu_s:.0f} CPU-s ({share:.2f} cores on average)",
            f"busy process {report.busy_process_cpu_s:.0f} CPU-s", f"idle {report.idle_cpu_s:.0f} CPU-s",
            f"pytest: {result}",
            f"{row:44} {f'{report.wall_s:.0f} s':34} {met}"]


class Sampler(threading.Thread):
    def __init__(self, busy_pid: int | None, period_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.busy_pid, self.period_s, self.samples = busy_pid, period_s, [read_sample(busy_pid)]
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.period_s):
            self.samples.append(read_sample(self.busy_pid))

    def stop(self) -> list[Sample]:
        self._done.set()
        self.join()
        self.samples.append(read_sample(self.busy_pid))
        return self.samples


def start_busy(mode: str) -> subprocess.Popen | None:
    if mode == "none":
        return None
    return subprocess.Popen(["yes"], stdout=subprocess.DEVNULL, start_new_session=mode == "own-session")


def run_environment(home: Path | None) -> dict[str, str]:
    """The tests' environment: this interpreter's folder first on PATH (a HOME of its own hides pyenv's and a
    user site's packages from a shim's `python`), and HOME the empty one when asked."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if home is not None:
        env["HOME"] = str(home)
        env.pop("FP8KV_CACHE_DIR", None)
        env.pop("XDG_CACHE_HOME", None)
    return env


def last_line(path: Path) -> str:
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1].strip("= ") if lines else "(no output)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for the log and the empty HOME (default: a new one)")
    parser.add_argument("--busy", choices=["own-session", "same-session", "none"], default="own-session")
    parser.add_argument("--keep-cache", action="store_true", help="the caches of this HOME, not empty ones")
    parser.add_argument("--limit-s", type=float, default=900.0)
    parser.add_argument("pytest_args", nargs="*", help="after --: instead of the README's arguments")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="fp8kv-suite-load-"))
    out.mkdir(parents=True, exist_ok=True)
    home = None
    if not args.keep_cache:
        home = out / "home"
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir()
    log = out / "pytest.log"
    busy = start_busy(args.busy)
    sampler = Sampler(busy.pid if busy else None)
    sampler.start()
    try:
        with open(log, "wb") as f:
            status = subprocess.run([sys.executable, "-m", "pytest", *(args.pytest_args or readme_pytest_args())], cwd=REPO,
                                    env=run_environment(home), stdout=f, stderr=subprocess.STDOUT,
                                    check=False).returncode
    finally:
        samples = sampler.stop()
        if busy is not None:
            busy.send_signal(signal.SIGTERM)
            busy.wait()
    lines = report_lines(summarize(samples, os.sysconf("SC_CLK_TCK")), args.limit_s, last_line(log))
    (out / "report.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"(log: {log})")
    return status


if __name__ == "__main__":
    sys.exit(main())
