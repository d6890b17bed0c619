"""The op library's compile child: `_build._compile` runs this file as a script (not `-m`, which would import
torch through the package first), so that it ties itself to its parent before anything slow happens.

It shares its parent's build lock (an inherited descriptor) and dies with it: a kill -9 of the starting
process ends the compile and every compiler under it (its whole session), instead of leaving orphans that
compile on while the next start builds beside them.
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
    """End this process and every process under it (ninja and the compilers it runs) when `parent` dies, or at
    once if it has died already."""
    signal.signal(signal.SIGTERM, _end_session)
    try:  # Linux: the kernel sends SIGTERM when the parent dies
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (AttributeError, OSError):
        pass  # elsewhere the inherited lock makes the next start wait for this compile instead
    if os.getppid() != parent:  # it died before the request took effect
        _end_session()


def _end_session(signum: int | None = None, frame: object = None) -> None:
    """SIGKILL to every process of this session, then this one. The child leads a session of its own
    (start_new_session); its own process group is not enough, for ninja starts each compiler in a process group
    of its own (posix_spawn with POSIX_SPAWN_SETPGROUP), and killed ninja cannot take them down."""
    me = os.getpid()
    if os.getsid(0) == me:  # never a session this process does not lead (a test running this in-process)
        for pid in _session_members(me):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(me, signal.SIGKILL)  # where /proc cannot be read: the group at least
        except ProcessLookupError:
            pass
    os._exit(128 + signal.SIGTERM)


def _session_members(session: int) -> list[int]:
    """Other processes of `session`, from /proc (empty where there is none)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit() or int(entry) == session:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (comm)": state ppid pgrp session
        except OSError:
            continue
        if len(fields) > 3 and int(fields[3]) == session:
            found.append(int(entry))
    return found


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
