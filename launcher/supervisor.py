"""`fp8kv run --num-shard N` on one machine: start N rank processes and keep them alive together.

Like TGI's launcher: each rank is a copy of this command with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set;
rank 0 serves HTTP, the others run model slices. Each rank reports ready over its own sd_notify socket (the
protocol systemd uses), so the supervisor knows when all are up and can tell systemd in turn. If a rank
exits, the others are stopped and the supervisor exits non-zero with that rank's last output. SIGTERM or
SIGINT is forwarded to every rank: rank 0 finishes its in-flight requests, then releases the workers.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from fp8cache.distributed.processes import (
    LOOPBACK,
    RankProcess,
    describe_exit,
    die_with_parent,
    free_port,
    rank_env,
    relay_output,
)
from fp8cache.platform.log import LOG_LINE, log_formatter
from fp8cache.systemd.notify import Notifier

MASTER_ADDR = LOOPBACK
__all__ = ["MASTER_ADDR", "Supervisor", "free_port", "kill_descendants", "owns_its_children", "rank_command",
           "supervise"]
EXIT_INTERRUPTED = 128 + signal.SIGINT  # the shell's status for a command ended by Ctrl-C
_FAILURE_GRACE_S = 10.0  # after one rank fails, how long the others get to exit before SIGKILL
_POLL_S = 0.1


@dataclass
class Rank(RankProcess):
    notify: socket.socket | None = None
    ready: bool = False


def rank_command(argv: list[str]) -> list[str]:
    """This same `fp8kv ...` command line, run by this Python."""
    return [sys.executable, "-m", "launcher.cli", *argv]


def _rank_env(rank: int, world: int, port: int, notify_path: str) -> dict[str, str]:
    env = rank_env(rank, world, port, MASTER_ADDR, NOTIFY_SOCKET=notify_path)
    # systemd's watchdog is meant for the supervisor; rank 0 pings through it, the workers not at all.
    env.pop("WATCHDOG_PID", None)
    if rank:
        env.pop("WATCHDOG_USEC", None)
    return env


class Supervisor:
    def __init__(self, argv: list[str], num_shard: int, stop_timeout: float,
                 write: Callable[[str], None] | None = None, log_format: str = "text") -> None:
        """argv: the command's arguments after the program name; stop_timeout: seconds a graceful stop
        may take before the ranks are killed; log_format: the ranks' (--log-format), which the supervisor's
        own lines follow, so that the whole output is in one format."""
        self.argv, self.num_shard, self.stop_timeout = argv, num_shard, stop_timeout
        self._write_lock = threading.Lock()
        self._write = write or sys.stderr.write
        self._formatter = log_formatter(log_format)
        self.ranks: list[Rank] = []
        self.stop_signal: int | None = None
        self.systemd = Notifier()
        self._rank0_status: str | None = None

    def say(self, text: str, level: int = logging.INFO) -> None:
        """One line of the supervisor's, as the `fp8kv` logger's record in the ranks' format."""
        record = logging.LogRecord("fp8kv", level, __file__, 0, text, None, None)
        self._put(self._formatter.format(record))

    def _put(self, line: str) -> None:
        with self._write_lock:
            self._write(line if line.endswith("\n") else line + "\n")
            sys.stderr.flush()

    def _relay(self, line: str) -> None:
        """A rank's output line (relay_output made it "[rank r] line"): its log lines, already in the format
        and labelled with the rank, pass as they are; anything else it wrote (a traceback, a library's print)
        becomes a warning line of the supervisor's."""
        label, _, text = line.partition("] ")
        if LOG_LINE.match(text):
            self._put(text)
        else:
            self.say(f"{label}] {text}", logging.WARNING)

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            with tempfile.TemporaryDirectory(prefix="fp8kv-ranks-") as tmp:
                self._start(tmp)
                return self._watch()
        finally:
            self._kill_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: object) -> None:
        if self.stop_signal is None:
            self.stop_signal = sig
            self.systemd.stopping(f"stopping on {signal.Signals(sig).name}")

    def _start(self, tmp: str) -> None:
        port = int(os.environ.get("MASTER_PORT") or free_port())
        self.say(f"starting {self.num_shard} tensor-parallel ranks (MASTER_ADDR={MASTER_ADDR} "
                 f"MASTER_PORT={port})")
        for r in range(self.num_shard):
            path = os.path.join(tmp, f"rank-{r}.notify")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            sock.bind(path)
            sock.setblocking(False)
            proc = subprocess.Popen(rank_command(self.argv), env=_rank_env(r, self.num_shard, port, path),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=die_with_parent)  # noqa: PLW1509 (no threads yet)
            self.ranks.append(Rank(r, proc, notify=sock))
            self.say(f"rank {r} started (pid {proc.pid})")
        # Relay threads start after the last fork: preexec_fn is only safe while this process has one thread.
        for rank in self.ranks:
            threading.Thread(target=relay_output, args=(rank, self._relay), daemon=True).start()

    def _watch(self) -> int:
        """Until a stop signal or a rank's exit; the exit status."""
        while True:
            self._read_notifications()
            if self.stop_signal is not None:
                return self._stop_gracefully()
            for rank in self.ranks:
                code = rank.proc.poll()
                if code is not None:
                    return self._fail(rank, code)
            time.sleep(_POLL_S)

    def _read_notifications(self) -> None:
        for rank in self.ranks:
            while True:
                try:
                    message = rank.notify.recv(4096).decode(errors="replace")
                except BlockingIOError:
                    break
                self._on_notification(rank, message)

    def _on_notification(self, rank: Rank, message: str) -> None:
        fields = message.split("\n")
        if "READY=1" in fields and not rank.ready:
            rank.ready = True
            waiting = [r.rank for r in self.ranks if not r.ready]
            self.say(f"rank {rank.rank} ready" + (f"; waiting for {waiting}" if waiting else
                                                         "; all ranks ready"))
            if not waiting:
                status = self._rank0_status or f"{self.num_shard} tensor-parallel ranks ready"
                self.systemd.ready(status)
        if rank.rank == 0:
            # Rank 0 speaks for the service (status, watchdog, stopping); READY waits for every rank.
            status = [f for f in fields if f.startswith("STATUS=")]
            if status:
                self._rank0_status = status[-1].removeprefix("STATUS=")
            rest = "\n".join(f for f in fields if f != "READY=1")
            if rest:
                self.systemd.send(rest)

    def _fail(self, failed: Rank, code: int) -> int:
        why = describe_exit(code)
        self.say(f"rank {failed.rank} {why}; stopping the other ranks", logging.ERROR)
        self.systemd.stopping(f"rank {failed.rank} {why}")
        self._signal_all(signal.SIGTERM)
        self._wait_all(_FAILURE_GRACE_S)
        time.sleep(0.2)  # let the relay threads print the last lines
        self.say(f"last output of rank {failed.rank}:", logging.ERROR)
        for line in failed.tail:
            self.say(f"  | {line}", logging.ERROR)
        self.say(f"tensor-parallel rank {failed.rank} {why}", logging.ERROR)
        return code if code > 0 else 1

    def _stop_gracefully(self) -> int:
        name = signal.Signals(self.stop_signal).name
        self.say(f"{name} received: stopping all {self.num_shard} ranks (up to {self.stop_timeout:g}s)")
        self._signal_all(signal.SIGTERM)
        if not self._wait_all(self.stop_timeout):
            self.say(f"ranks still running after {self.stop_timeout:g}s; killing them")
        time.sleep(0.2)
        codes = [r.proc.returncode for r in self.ranks]
        # A rank still importing when the SIGTERM came has no handler yet and dies of it: that is the stop
        # asked for, not an error.
        bad = [(r.rank, c) for r, c in zip(self.ranks, codes) if c not in (0, -signal.SIGTERM)]
        for r, c in bad:
            self.say(f"rank {r} {describe_exit(c)}", logging.ERROR)
        self.say(f"stopped ({'cleanly' if not bad else 'with errors'})")
        if bad:
            return 1
        # Ctrl-C before every rank was up interrupted the start (the shell's 130); after that it is a stop.
        loading = not all(r.ready for r in self.ranks)
        return EXIT_INTERRUPTED if self.stop_signal == signal.SIGINT and loading else 0

    def _signal_all(self, sig: int) -> None:
        for rank in self.ranks:
            if rank.proc.poll() is None:
                try:
                    rank.proc.send_signal(sig)
                except ProcessLookupError:
                    pass

    def _wait_all(self, timeout: float) -> bool:
        """Wait for every rank to exit; SIGKILL the rest at the timeout. Whether all left on their own."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(r.proc.poll() is not None for r in self.ranks):
                return True
            time.sleep(_POLL_S)
        self._kill_all()
        return False

    def _kill_all(self) -> None:
        for rank in self.ranks:
            if rank.proc.poll() is None:
                rank.proc.kill()
            rank.proc.wait()
            rank.notify.close()


def supervise(argv: list[str], num_shard: int, stop_timeout: float, log_format: str = "text") -> int:
    """Run `fp8kv <argv>` as num_shard ranks on this machine; the exit status for the whole group."""
    return Supervisor(argv, num_shard, stop_timeout, log_format=log_format).run()


# -- no process outlives the command ----------------------------------------------------------------

_PR_SET_CHILD_SUBREAPER = 36
_DESCENDANT_GRACE_S = 2.0


def owns_its_children(command: Callable) -> Callable:
    """Decorator for a click command that loads a model: Ctrl-C exits 130 with one line instead of a
    traceback, and no process it started outlives it. The op library compiles in torch's ninja child, whose
    compilers subprocess.run leaves running when it kills ninja on an interrupt; as a child subreaper this
    process inherits such orphans and ends them on the way out."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        _become_subreaper()
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt:
            sys.stderr.write("\nfp8kv: interrupted\n")
            sys.exit(EXIT_INTERRUPTED)
        finally:
            kill_descendants()

    return wrapper


def _become_subreaper() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)
    except (OSError, AttributeError):  # not Linux: orphans go to init as before
        pass


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process this one can see."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ", which may hold spaces
        table[int(name)] = (int(fields[1]), fields[0])
    return table


def _living_descendants(root: int) -> list[int]:
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return [pid for pid in found if table[pid][1] != "Z"]  # a zombie is already dead


def kill_descendants(grace_s: float = _DESCENDANT_GRACE_S) -> list[int]:
    """SIGTERM every living descendant of this process, SIGKILL what is left after grace_s; the pids
    signalled. The search repeats, because a killed parent's children are re-parented here meanwhile."""
    if not os.path.isdir("/proc"):
        return []
    me, signalled = os.getpid(), set()
    start = time.monotonic()
    while True:
        alive = _living_descendants(me)
        elapsed = time.monotonic() - start
        if not alive or elapsed > 2 * grace_s + 1:  # past that, only an unkillable (D state) process is left
            return sorted(signalled)
        late = elapsed > grace_s
        for pid in alive:
            if late or pid not in signalled:
                try:
                    os.kill(pid, signal.SIGKILL if late else signal.SIGTERM)
                except ProcessLookupError:
                    pass
                signalled.add(pid)
        time.sleep(_POLL_S / 2)
