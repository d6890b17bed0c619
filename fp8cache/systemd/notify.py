"""systemd's notify protocol (sd_notify) without libsystemd: one datagram per message to $NOTIFY_SOCKET.

Type=notify units wait for READY=1 before counting the service as started, and WatchdogSec= kills and
restarts a service that stops sending WATCHDOG=1. Outside systemd NOTIFY_SOCKET is unset and every call
here is a no-op.
"""

from __future__ import annotations

import os
import socket


def notify_socket_address(value: str | None = None) -> str | bytes | None:
    """The address to send to: a path, or an abstract name (leading '@' becomes a NUL byte)."""
    value = os.environ.get("NOTIFY_SOCKET") if value is None else value
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if not value.startswith("/"):
        return None  # systemd also allows vsock:..., which a local service never gets
    return value


def sd_notify(message: str, address: str | bytes | None = None) -> bool:
    """Send `message` (e.g. "READY=1") to systemd; False when there is no socket or sending failed."""
    address = notify_socket_address() if address is None else address
    if address is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
        return True
    except OSError:
        # systemd may be restarting or the socket gone; notification is best effort by design.
        return False


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), None when no watchdog is asked for us."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid.strip() != str(os.getpid()):
        return None  # the watchdog is meant for another process (e.g. our parent)
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 2e6 if value > 0 else None


class Notifier:
    """The messages fp8kv sends over a service's life; each returns whether systemd was told."""

    def __init__(self, address: str | bytes | None = None) -> None:
        self.address = notify_socket_address() if address is None else address

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, message: str) -> bool:
        return self.address is not None and sd_notify(message, self.address)

    def ready(self, status: str = "") -> bool:
        return self.send("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def stopping(self, status: str = "") -> bool:
        return self.send("STOPPING=1" + (f"\nSTATUS={status}" if status else ""))

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")
