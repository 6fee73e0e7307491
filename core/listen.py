"""Where `draftflow serve` listens: the address family, the listen backlog, and one-line bind errors.

Checked before the model loads (``check_listen``), so a taken port or a wrong ``--host`` costs
a fraction of a second, not a model load.
"""

from __future__ import annotations

import errno
import socket

from draftflow.core.errors import DraftflowError

BACKLOG_MIN = 128  # listen backlog floor: the classic SOMAXCONN (the kernel caps any value at net.core.somaxconn)
BACKLOG_MAX = 65535


def backlog(max_waiting: int) -> int:
    """The listen backlog for a server that lets ``max_waiting`` requests wait.

    Connections of a burst queue in the kernel until the accept loop takes them; past the
    backlog they are reset (the standard library's default of 5 reset 27 of 96 connections
    of 32 clients). A burst can be the whole waiting line at once, each request on its own
    connection, plus as many again past the line (who must get their 503, not a reset),
    plus some health checks and metric scrapes (16). 128 is the floor; the kernel caps the
    value at net.core.somaxconn.
    """
    return min(max(BACKLOG_MIN, 2 * max_waiting + 16), BACKLOG_MAX)


def listen_family(host: str, port: int) -> int:
    """The address family (IPv4 or IPv6) of ``host``; raises DraftflowError when it cannot be listened on."""
    if not 0 <= port <= 65535:
        raise DraftflowError(f"--port {port} is outside 0..65535; choose a free port, or 0 to let the system pick one")
    try:
        return socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    except (OSError, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise DraftflowError(f"--host {host!r}: cannot resolve it ({reason}); pass an address of this machine such "
                             "as 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None


def listen_error(host: str, port: int, exc: OSError) -> str:
    """The one-line message for a failed bind."""
    where = f"cannot listen on {host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return f"{where}: the address is already in use (another server?); stop it or choose another --port"
    if exc.errno == errno.EACCES:
        return f"{where}: permission denied (ports below 1024 need root); choose a --port of 1024 or above"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{where}: {host} is not an address of this machine; use 127.0.0.1 or 0.0.0.0 as --host"
    return f"{where}: {exc.strerror or exc}; check --host and --port"


def check_listen(host: str, port: int) -> None:
    """Bind and release ``host:port`` once, so a taken port is reported before the model loads."""
    family = listen_family(host, port)
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            probe.bind((host, port))
    except OSError as exc:
        raise DraftflowError(listen_error(host, port, exc)) from None
