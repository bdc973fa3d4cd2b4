"""Listening sockets: binding them, naming who holds a taken address, announcing what was bound.

Every Tinkerd process that listens binds its own socket: on its configured port, or on port 0 so
that the kernel picks a free one at the moment of binding (no probe-then-bind window another
process could take the port in). It then makes the bound address known through an
*announcement*: a small JSON file (`{"url": ..., "pid": ...}`, written atomically) that the
supervisor and the gateway read. An engine address written as `file://PATH` in the gateway's
configuration is such a file (`resolve_address`).

A port that is taken fails loudly: `BindError` names the address and, where the kernel tells
(`psutil`), the process holding it; a service that cannot bind exits with `BIND_FAILED_EXIT`
after printing one line that starts with `BIND_FAILED_PREFIX`, which the supervisor reads.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec

BIND_FAILED_EXIT = 78
"""A service's exit code when it cannot bind its address (`EX_CONFIG`): the supervisor does not
restart it on the same address forever (tinkerd/supervisor.py)."""
BIND_FAILED_PREFIX = "cannot bind "
SERVING = "serving on "
"""The log line an HTTP service prints once its socket accepts requests: `<name> serving on URL`."""
ANNOUNCED = "file://"


class BindError(OSError):
    """`host:port` could not be bound; `holder` describes the process holding it, if known."""

    def __init__(self, host: str, port: int, cause: OSError, holder: str | None) -> None:
        self.host, self.port, self.holder = host, port, holder
        why = os.strerror(cause.errno) if cause.errno else str(cause)
        held = f"; held by {holder}" if holder else ""
        super().__init__(cause.errno, f"{BIND_FAILED_PREFIX}{host}:{port}: {why.lower()}{held}")

    def __str__(self) -> str:
        return str(self.strerror)


def holder_of(port: int, kind: str = "tcp") -> str | None:
    """The processes with a socket bound to local `port`, as `pid N (cmdline)`; None when the
    kernel names none we may see (no such socket, or another user's)."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - a dependency of the project
        return None
    try:
        conns = psutil.net_connections(kind=kind)
    except (psutil.Error, OSError):
        return None
    pids = sorted({c.pid for c in conns if c.laddr and c.laddr.port == port and c.pid is not None})
    described = []
    for pid in pids:
        try:
            cmd = " ".join(psutil.Process(pid).cmdline()) or psutil.Process(pid).name()
        except psutil.Error:
            cmd = "?"
        described.append(f"pid {pid} ({cmd[:160]})")
    return ", ".join(described) or None


def bind_tcp(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` (0: a port the kernel picks now), not yet listening:
    connections are refused until the server that owns it starts listening.

    Raises:
        BindError: the address is taken (or not allowed), naming the holder where known.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT leftover is no holder
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        holder = holder_of(port) if exc.errno == errno.EADDRINUSE else None
        raise BindError(host, port, exc, holder) from exc
    return sock


def url_of(sock: socket.socket, scheme: str = "http") -> str:
    """The URL of a bound socket (its real port, also when it was bound to port 0)."""
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


class Announcement(msgspec.Struct, frozen=True):
    """A listening process's bound address."""

    url: str
    pid: int


def announce(path: Path, url: str) -> None:
    """Write the announcement of `url` for this process (atomically: readers never see half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(msgspec.json.encode(Announcement(url=url, pid=os.getpid())))
    os.replace(tmp, path)


def read_announcement(path: Path) -> Announcement | None:
    """The announcement at `path`, or None when there is none (yet)."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=Announcement)
    except (OSError, msgspec.DecodeError):
        return None


def withdraw(path: Path) -> None:
    """Remove this process's announcement (a later process's one is left alone)."""
    found = read_announcement(path)
    if found is not None and found.pid == os.getpid():
        path.unlink(missing_ok=True)


def announced_path(address: str) -> Path | None:
    """The announcement file an engine address names (`file://PATH`), or None for a URL."""
    return Path(address.removeprefix(ANNOUNCED)) if address.startswith(ANNOUNCED) else None


def resolve_address(address: str) -> str | None:
    """`address` itself for a URL; for `file://PATH`, the URL announced there (None: none yet)."""
    path = announced_path(address)
    if path is None:
        return address
    found = read_announcement(path)
    return found.url.rstrip("/") if found is not None else None


def serve_asgi(
    name: str,
    host: str,
    port: int,
    make_app: Callable[[], Any],
    announce_to: Path | None = None,
    **uvicorn_options: Any,
) -> None:
    """Bind `host:port`, build the app, and serve it under uvicorn on that socket.

    The socket is bound before the app is built (a taken port fails at once, before a model is
    loaded) and listens only once the app has started. Then the bound URL is announced to
    `announce_to` and `<name> serving on URL` is printed. A bind failure prints its
    `BIND_FAILED_PREFIX` line and exits with `BIND_FAILED_EXIT`.
    """
    import uvicorn

    try:
        sock = bind_tcp(host, port)
    except BindError as exc:
        print(f"{name}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(BIND_FAILED_EXIT) from None
    url = url_of(sock)

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                if announce_to is not None:
                    announce(announce_to, url)
                print(f"{name} {SERVING}{url}", file=sys.stderr, flush=True)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            if announce_to is not None:
                withdraw(announce_to)
            await super().shutdown(sockets)

    config = uvicorn.Config(make_app(), **uvicorn_options)
    Server(config).run(sockets=[sock])


def announce_file_from_env(env: Mapping[str, str]) -> Path | None:
    """Where this process announces its address (`TINKERD_ANNOUNCE_FILE`, set by the supervisor)."""
    value = env.get("TINKERD_ANNOUNCE_FILE")
    return Path(value) if value else None


def host_id() -> str:
    """This machine's identity for memory shared between its processes (CUDA IPC, shared memory):
    the kernel's boot id, which containers of one host share, else the host name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()
