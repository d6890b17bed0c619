"""The op library's compile child: `_build._compile` runs this file as a script (not `-m`, which would import
torch through the package first), so that it ties itself to its parent before anything slow happens.

It shares its parent's build lock (an inherited descriptor) and dies with it: a kill -9 of the starting
process ends the compile and every compiler under it, instead of leaving an orphan that compiles on while
the next start builds beside it.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """End this process and its process group (ninja and the compilers it runs: the child leads the group,
    started with start_new_session) when `parent` dies, or at once if it has died already."""

    def end_group(signum: int | None = None, frame: object = None) -> None:
        if os.getpgrp() == os.getpid():  # never the caller's own group, where a test runs this in-process
            os.killpg(os.getpid(), signal.SIGKILL)
        os._exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, end_group)
    try:  # Linux: the kernel sends SIGTERM when the parent dies
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (AttributeError, OSError):
        pass  # elsewhere the inherited lock makes the next start wait for this compile instead
    if os.getppid() != parent:  # it died before the request took effect
        end_group()


def compile_in_this_process(spec: dict) -> None:
    from torch.utils import cpp_extension

    cpp_extension.load(
        name=spec["name"], sources=spec["sources"], extra_cflags=spec["cflags"],
        extra_cuda_cflags=spec["cuda_cflags"], extra_ldflags=["-fopenmp"], extra_include_paths=[spec["root"]],
        build_directory=spec["build_dir"], is_python_module=False, verbose=spec["verbose"])


def main(spec_json: str, compile: Callable[[dict], None] = compile_in_this_process) -> None:
    """Die with the parent, then compile (`compile`: a stand-in compiler in the crash tests)."""
    spec = json.loads(spec_json)
    die_with_parent(int(spec["parent"]))
    compile(spec)


if __name__ == "__main__":
    del sys.path[0]  # this file's folder: its modules (fake, probes, ...) must not shadow top-level ones
    main(sys.argv[1])
