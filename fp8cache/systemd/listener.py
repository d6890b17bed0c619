"""The server's listening sockets, bound before the model loads: a port in use is then reported in a second
instead of after minutes of loading (and, on a first run, compiling and converting)."""

from __future__ import annotations

import socket


class ListenError(OSError):
    """The address cannot be listened on; the message names the address and the fix."""


def bind_listeners(host: str, port: int) -> list[socket.socket]:
    """Bound TCP sockets for host:port, one per address the name has (as asyncio's create_server binds
    "localhost" on 127.0.0.1 and ::1); port 0: any free port, the same for all. They do not listen yet:
    until the server starts, connections are refused instead of queued behind the loading model."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"--host {host!r} is not an address of this machine ({exc.strerror}); use e.g. "
                          "127.0.0.1, 0.0.0.0 or ::") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys((i[0], i[1], i[2], None, i[4]) for i in infos):
            if sockets:  # the first socket's port, when port 0 let the kernel choose
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
            if family == socket.AF_INET6 and len(infos) > 1:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # leave 127.0.0.1 to its own socket
            try:
                sock.bind(address)
            except OSError as exc:
                where = f"[{address[0]}]:{address[1]}" if family == socket.AF_INET6 else f"{address[0]}:{address[1]}"
                raise ListenError(f"cannot listen on {where}: {exc.strerror or exc}; stop what holds the port "
                                  "or pick another with --port (0: any free port)") from None
            sock.set_inheritable(True)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def check_listen(host: str, port: int) -> None:
    """Raise ListenError unless host:port could be bound now (for a parent that starts the server later)."""
    for sock in bind_listeners(host, port):
        sock.close()
