"""Connection limits for uvicorn's h11 protocol: how many connections may be open, and how long a client may
take to send a request.

uvicorn itself closes an idle keep-alive connection, but not one that opened and sent nothing, or sent half its
headers: 20,000 of those used up the process's file descriptors and took the whole server down. Here each
connection must finish its request headers within the read timeout of its first byte (or of connecting), and
send each part of its body within the read timeout of the last; connections past the limit get a 503 and are
closed at once. The limit, the listen backlog (asyncio accepts up to that many sockets in one go, before any
can be refused) and the refused connections still closing all fit below the open-file limit.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("fp8kv.server")

DEFAULT_READ_TIMEOUT_S = 20.0
DEFAULT_MAX_CONNECTIONS = 4096
MAX_BACKLOG = 2048  # uvicorn's default
# Descriptors kept for everything but client sockets: logs, the listening sockets, the structured output
# workers' pipes (an idle server holds about 10).
FD_RESERVE = 64
# A refused connection stays open up to this long after its 503 so that the client reads it (closing a socket
# with unread input resets it, and the answer is lost); at most max_lingering at once, the rest just close.
_LINGER_S = 1.0
_MAX_LINGERING = 64


@dataclass(frozen=True)
class Limits:
    max_connections: int
    backlog: int  # uvicorn.Config(backlog=): the listen queue, and the most sockets accepted in one go
    max_lingering: int


def connection_limits(requested: int | None, open_files: int | None = None) -> tuple[Limits, str | None]:
    """Limits that fit below the open-file limit (the soft RLIMIT_NOFILE unless given), and a warning when
    `requested` connections do not."""
    if open_files is None:
        open_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        open_files = 1 << 20 if open_files == resource.RLIM_INFINITY else open_files
    budget = max(32, open_files - FD_RESERVE)
    backlog, lingering = min(MAX_BACKLOG, budget // 4), min(_MAX_LINGERING, budget // 4)
    room = budget - backlog - lingering
    if requested is None:
        return Limits(min(DEFAULT_MAX_CONNECTIONS, room), backlog, lingering), None
    if requested > room:
        return Limits(room, backlog, lingering), (
            f"--max-connections {requested} is more than the open-file limit ({open_files}) leaves room for; "
            f"using {room} (raise the limit with ulimit -n or systemd's LimitNOFILE=)")
    return Limits(requested, backlog, lingering), None


def _refusal(max_connections: int) -> bytes:
    body = (f"the server has {max_connections} connections open, its limit (fp8kv run --max-connections); "
            "retry later\n").encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def protocol_class(limits: Limits, read_timeout: float) -> type[H11Protocol]:
    """An H11Protocol subclass (uvicorn.Config(http=...)) that enforces these limits."""

    class LimitedH11Protocol(_LimitedH11Protocol):
        pass

    LimitedH11Protocol.max_connections = limits.max_connections
    LimitedH11Protocol.max_lingering = limits.max_lingering
    LimitedH11Protocol.read_timeout = read_timeout
    return LimitedH11Protocol


class _LimitedH11Protocol(H11Protocol):
    max_connections = DEFAULT_MAX_CONNECTIONS
    max_lingering = _MAX_LINGERING
    read_timeout = DEFAULT_READ_TIMEOUT_S
    lingering = 0  # refused connections still open (all classes together)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._refused = False
        self._lingers = False
        self._read_timer: asyncio.TimerHandle | None = None
        self._waiting_for = ""  # "headers" or "body" while the read timer runs

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            self._refused = True
            self.transport = transport  # connection_lost() closes it again
            transport.write(_refusal(self.max_connections))
            if _LimitedH11Protocol.lingering < self.max_lingering:
                _LimitedH11Protocol.lingering += 1
                self._lingers = True
                transport.write_eof()
                self._read_timer = self.loop.call_later(_LINGER_S, transport.close)
            else:
                transport.close()
            logger.warning("refused a connection: %d are open, the limit (--max-connections)", self.max_connections)
            return
        super().connection_made(transport)
        self._watch("headers")

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        if self.transport.is_closing():
            self._stop_watch()
        elif self.conn.their_state is h11.IDLE:
            if self._waiting_for != "headers":
                self._watch("headers")  # a request began: its headers have read_timeout from now, in all
        elif self.conn.their_state is h11.SEND_BODY:
            self._watch("body")  # each part of the body has read_timeout from the last
        else:
            self._stop_watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_watch()
        if self._lingers:
            self._lingers = False
            _LimitedH11Protocol.lingering -= 1
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # uvicorn's keep-alive timeout now covers the idle connection; a next request restarts ours.
        if self.conn.their_state is not h11.SEND_BODY:
            self._stop_watch()

    def _watch(self, what: str) -> None:
        self._stop_watch()
        self._waiting_for = what
        self._read_timer = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _stop_watch(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self._waiting_for = ""

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self._waiting_for == "body" and self.flow.read_paused:
            self._watch("body")  # the application has not read what came; the client is not the one late
            return
        logger.info("closed a connection: the request %s did not arrive within %g s (--read-timeout)",
                    self._waiting_for, self.read_timeout)
        self._waiting_for = ""
        self.transport.close()
