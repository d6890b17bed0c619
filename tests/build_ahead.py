"""The op library and the default model, made when a pytest-xdist run starts, beside the tests.

On a clean machine the first server start converts the default model and then compiles the op library, one after
the other, while the other worker's first tests wait on their locks: two minutes with both workers idle on a
busy 2-core machine. Started by the process that starts the run, the two are made side by side while the workers
start and collect. Each takes its lock as any process does, so a test that needs one waits for it as it would for
another worker; on a machine that has them, each is a check of a few seconds (the op library's: 3 CPU-s).
"""

from __future__ import annotations

import subprocess
import sys

import compile_ahead

STEPS = {
    "op library": "from fp8cache import ops; ops.load('cpu')",
    "default model": "from fp8cache.model.default_model import ensure_default_model; ensure_default_model(progress=False)",
}


def wanted(config) -> bool:
    """Only for runs over pytest-xdist workers (the README's and CI's commands, the fast lane): a single-process
    run of a few tests may need neither."""
    return (not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))
            and not config.option.collectonly and not config.getoption("--cpu-isa"))


def start(config) -> list[subprocess.Popen]:
    if not wanted(config):
        return []
    return [subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) for code in STEPS.values()]


def stop(procs: list[subprocess.Popen]) -> None:
    """At the end of the run, one still working (the run ended early) is ended: both are safe to kill (the op
    library's compile dies with its parent, the model is converted in a folder of its own)."""
    compile_ahead.end(procs)
