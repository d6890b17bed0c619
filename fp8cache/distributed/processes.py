"""Rank processes on one machine: what `fp8kv run --num-shard N` (launcher/supervisor.py) and the offline
group (fp8cache/distributed/group.py) both need to start ranks, watch them and explain how one ended."""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

LOOPBACK = "127.0.0.1"
TAIL_LINES = 40  # lines of a failed rank's output kept to show again


@dataclass
class RankProcess:
    rank: int
    proc: subprocess.Popen
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))

    def exit_code(self, wait_s: float = 0.0) -> int | None:
        """The exit status, waiting up to wait_s for it; None while it runs."""
        try:
            return self.proc.wait(wait_s) if wait_s > 0 else self.proc.poll()
        except subprocess.TimeoutExpired:
            return None

    def describe_failure(self) -> str:
        """'rank 1 (pid 123) was killed by SIGKILL', then its last output lines."""
        lines = [f"rank {self.rank} (pid {self.proc.pid}) {describe_exit(self.proc.returncode)}"]
        if self.tail:
            lines.append(f"last output of rank {self.rank}:")
            lines += [f"  | {line}" for line in self.tail]
        return "\n".join(lines)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, addr: str = LOOPBACK, **extra: str) -> dict[str, str]:
    """This process's environment plus the standard torch.distributed variables for one rank."""
    return dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR=addr,
                MASTER_PORT=str(port), PYTHONUNBUFFERED="1", **extra)


def die_with_parent() -> None:
    """Child side (preexec_fn): get SIGTERM if the parent dies (even by SIGKILL), so no rank is orphaned."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def relay_output(rank: RankProcess, emit: Callable[[str], None]) -> None:
    """Thread body: each output line of the rank goes to its tail and to emit as '[rank r] line'."""
    for raw in iter(rank.proc.stdout.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        rank.tail.append(line)
        emit(f"[rank {rank.rank}] {line}")


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def stop_processes(ranks: list[RankProcess], timeout: float) -> bool:
    """Wait up to timeout for every rank to exit, then SIGKILL the rest; whether all left on their own."""
    deadline = time.monotonic() + timeout
    clean = True
    for r in ranks:
        try:
            r.proc.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            clean = False
            break
    for r in ranks:
        if r.proc.poll() is None:
            r.proc.kill()
        r.proc.wait()
    return clean
