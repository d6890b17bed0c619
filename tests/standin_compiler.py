"""A stand-in for the op library's compile child, for the crash tests (tests/crash_safety.py).

Run as `_build.COMPILE_CHILD`, it ties itself to its parent exactly as the real child does
(fp8cache/ops/_compile_child.py's main, loaded by path so that torch is not imported), starts a "compiler"
process under it (as ninja starts g++: in a process group of its own), and writes the library slowly, chunk by chunk, as a linker does: a copy
of a real, working library ($FP8KV_STANDIN_LIBRARY), so the probe and the load after it are the real ones. A kill
then lands in the middle of a half-written file.

It records what must never happen in $FP8KV_STANDIN_RECORD: a second compile of a key while one still runs
(`raced`: the file lock of that folder was held), and a compile that went on after its parent died
(`outlived`).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

CHUNKS = 24
CHUNK_PAUSE_S = 0.04


def _compile_child_module():
    package = importlib.util.find_spec("fp8cache").submodule_search_locations[0]  # does not import fp8cache
    spec = importlib.util.spec_from_file_location("_compile_child", Path(package) / "ops" / "_compile_child.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def standin_compile(spec: dict) -> None:
    record = Path(os.environ["FP8KV_STANDIN_RECORD"])
    running = open(record / "compiling.lock", "a")  # noqa: SIM115 - held until this process ends
    try:
        fcntl.flock(running, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        (record / "raced").write_text(f"{spec['build_dir']}\n")
        sys.exit(3)
    # In a process group of its own, as ninja starts each compiler (posix_spawn with POSIX_SPAWN_SETPGROUP).
    compiler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], process_group=0)
    (Path(spec["build_dir"]) / "build.ninja").write_text("# the stand-in compiler's\n")
    data = Path(os.environ["FP8KV_STANDIN_LIBRARY"]).read_bytes()
    with open(Path(spec["build_dir"]) / f"{spec['name']}.so", "wb") as out:
        for i in range(CHUNKS):
            out.write(data[i * len(data) // CHUNKS:(i + 1) * len(data) // CHUNKS])
            out.flush()
            time.sleep(CHUNK_PAUSE_S)
    compiler.kill()
    compiler.wait()
    if os.getppid() != int(spec["parent"]):
        (record / "outlived").write_text(f"{spec['build_dir']}\n")


if __name__ == "__main__":
    _compile_child_module().main(sys.argv[1], standin_compile)
