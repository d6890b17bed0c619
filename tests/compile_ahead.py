"""The GPU compile checks (scripts/compile_check.sh), started when the test run starts, beside the tests.

They are one single-threaded compiler after another for several minutes: run last, as tests/ops/test_compile_check.py
asked for them, they were the tail of the run; started first, in the process that starts the run (pytest-xdist's
controller, or pytest itself), they overlap everything else. tests/ops/test_compile_check.py reads their results from
the folder named in FP8KV_COMPILE_AHEAD (the workers inherit it), or runs a target itself when there is none.
A check whose inputs passed before is replayed by the script in a second (scripts/compile_check.sh, run_cached).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compile_check.sh"
ENV = "FP8KV_COMPILE_AHEAD"
# Two chains, longest first: about as long as each other, two compilers at a time at most.
CHAINS = [["cuda-kernels"], ["hip-kernels", "cuda-bindings", "hip-hipify"]]
_folder: str | None = None  # the results folder this process made


def wanted(config) -> bool:
    """Whether this run includes the compile checks: slow tests not left out, and the whole tests folder or
    test_compile_check.py among the arguments (or in a folder among them)."""
    if "not slow" in (config.option.markexpr or "") or config.option.keyword or config.option.collectonly:
        return False
    args = [str(a) for a in config.args] or ["."]
    here = Path(config.invocation_params.dir)
    return any("test_compile_check" in a or any((here / a.split("::")[0]).glob("**/test_compile_check.py"))
               for a in args)


def start(config) -> list[subprocess.Popen]:
    if hasattr(config, "workerinput") or ENV in os.environ or not wanted(config):
        return []
    global _folder
    folder = _folder = tempfile.mkdtemp(prefix="fp8kv-compile-ahead-")
    os.environ[ENV] = folder
    chains = []
    for chain in CHAINS:
        steps = "; ".join(f'bash "{SCRIPT}" {t} > "{folder}/{t}.out" 2>&1; echo $? > "{folder}/{t}.rc.tmp"; '
                          f'mv "{folder}/{t}.rc.tmp" "{folder}/{t}.rc"' for t in chain)
        chains.append(subprocess.Popen(["bash", "-c", steps], start_new_session=True, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL))
    return chains


def stop(chains: list[subprocess.Popen]) -> None:
    """At the end of the run: a chain still compiling (its test deselected or failed early) is ended, and the
    results folder removed."""
    end(chains)
    if _folder:
        shutil.rmtree(_folder, ignore_errors=True)


def end(procs: list[subprocess.Popen]) -> None:
    """End each of procs still running, with the processes it started (each leads a session of its own)."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            proc.wait()


def result(target: str, timeout: float) -> tuple[int, str] | None:
    """(exit status, output) of a target started ahead, waiting for it; None when none was started."""
    import time

    folder = os.environ.get(ENV)
    if not folder or not any(target in chain for chain in CHAINS):
        return None
    rc_file, deadline = Path(folder) / f"{target}.rc", time.monotonic() + timeout
    while not rc_file.is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"compile check {target} started ahead did not finish in {timeout:.0f} s")
        time.sleep(1)
    return int(rc_file.read_text()), (Path(folder) / f"{target}.out").read_text()
