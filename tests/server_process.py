"""A real `fp8kv run` process for the server tests: started on a free port of 127.0.0.1, its output in a file."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx

START_TIMEOUT_S = 600  # the first start on a machine may compile the ops and convert the default model
_URL = re.compile(r'(?:serving \S+ at |"url": ")(http://127\.0\.0\.1:\d+)')  # text or --log-format json


def fp8kv_command() -> list[str]:
    return [sys.executable, "-m", "launcher.cli"]


class ServerProcess:
    def __init__(self, args: list[str], log_path: str, env: dict[str, str] | None = None,
                 python_prelude: str | None = None) -> None:
        """args: what follows `fp8kv run`. python_prelude: code run before the CLI (to simulate faults)."""
        full_env = dict(os.environ, **(env or {}))
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        if python_prelude is None:
            cmd = fp8kv_command() + ["run", "--port", "0", *args]
        else:
            boot = python_prelude + "\nfrom launcher.cli import main\nmain()"
            cmd = [sys.executable, "-c", boot, "run", "--port", "0", *args]
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - open for the server's whole life, closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.url = self._wait_for_url()

    def output(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def _wait_for_url(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            match = _URL.search(self.output())
            if match:
                return match.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"fp8kv run exited with {self.proc.returncode} before serving:\n"
                                   f"{self.output()[-4000:]}")
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"fp8kv run did not start serving in {START_TIMEOUT_S}s:\n{self.output()[-4000:]}")

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 120.0), **kwargs)


def engine_stats(server: ServerProcess, headers: dict[str, str] | None = None) -> dict:
    with server.client(headers=headers) as c:
        info = c.get("/info")
        info.raise_for_status()
        return info.json()["engine"]


def wait_idle(server: ServerProcess, headers: dict[str, str] | None = None, timeout: float = 60.0) -> dict:
    """Engine stats once nothing runs or waits (aborts are applied at the engine's next step)."""
    deadline = time.monotonic() + timeout
    stats = engine_stats(server, headers)
    while time.monotonic() < deadline:
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["active_requests"] == 0:
            return stats
        time.sleep(0.1)
        stats = engine_stats(server, headers)
    return stats
