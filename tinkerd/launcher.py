"""How the supervisor starts a service process: `start(module, args, env)`, which runs as
`python -m MODULE ARGS` would, with exactly `env`, its output on one pipe, in a session of its own.

Two ways, chosen by `TINKERD_LAUNCH`:
- `fork` (the default on Linux without an NVIDIA GPU): forked from a fork server that has
  already imported torch, transformers and megatron-core (`tinkerd/zygote.py`). A start, or a
  restart after a crash, then skips about 3 CPU-seconds of imports per service on a small machine.
  One server runs per environment (`preload_key`), for as long as this process; should it die,
  the services it started are killed (so none ever runs twice) and the supervisor restarts them.
- `exec` (the default where `/dev/nvidiactl` exists, and off Linux, as the fork server uses
  Linux's pidfds): a fresh interpreter per service. A library that touches the CUDA driver while
  it is imported would leave every forked child unable to use the GPU, so GPU machines do not fork.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from typing import IO, Protocol

from tinkerd import zygote

LAUNCH_VAR = "TINKERD_LAUNCH"
MODES = ("fork", "exec")


class Process(Protocol):
    """What the supervisor uses of a started service: `subprocess.Popen`'s names and meanings."""

    pid: int
    stdout: IO[bytes] | None
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def launch_mode(env: dict[str, str]) -> str:
    forkable = sys.platform == "linux" and not Path("/dev/nvidiactl").exists()
    mode = env.get(LAUNCH_VAR) or ("fork" if forkable else "exec")
    if mode not in MODES:
        raise ValueError(f"{LAUNCH_VAR} must be one of {MODES}, got {mode!r}")
    return mode


def start(module: str, args: list[str], env: dict[str, str]) -> Process:
    if launch_mode(env) == "fork":
        try:
            return fork_server(env).launch(module, args, env)
        except ServerLost:
            pass  # it died before forking (its start-up failed): this start goes the long way
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the supervisor stops it (and what it spawned) as one
    )


def prepare(env: dict[str, str]) -> None:
    """Start the fork server for `env` now (it imports in the background), if `env` forks."""
    if launch_mode(env) == "fork":
        fork_server(env)


class ServerLost(Exception):
    """The fork server ended before it could fork the process asked for."""


class Forked:
    """A process the fork server started; its exit arrives from the server, exactly once."""

    def __init__(self, stdout: IO[bytes]) -> None:
        self.pid = 0  # until the server has forked it
        self.stdout: IO[bytes] | None = stdout
        self.returncode: int | None = None
        self.forked = threading.Event()
        self._ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def end(self, code: int) -> None:
        self.returncode = code
        self._ended.set()


def preload_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The environment a fork server is started with: `env` without Tinkerd's own variables,
    which only Tinkerd's modules read, and those are imported after the fork."""
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith("TINKERD_")))


class ForkServer:
    """One `tinkerd.zygote` process, and the thread that reads its replies."""

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tinkerd.zygote", str(theirs.fileno())],
            env=env,
            stdin=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()  # one request on the wire at a time: replies come in order
        self._awaiting: deque[Forked] = deque()
        self._running: dict[int, Forked] = {}
        self.alive = True
        threading.Thread(target=self._read, name="fork-server", daemon=True).start()

    def launch(self, module: str, args: list[str], env: dict[str, str]) -> Forked:
        read_end, write_end = os.pipe()
        forked = Forked(os.fdopen(read_end, "rb"))
        request = {"module": module, "args": args, "env": env, "cwd": os.getcwd()}
        try:
            with self._lock:
                if not self.alive:
                    raise ServerLost
                self._awaiting.append(forked)
                try:
                    socket.send_fds(self._sock, [json.dumps(request).encode()], [write_end])
                except OSError:
                    self._awaiting.remove(forked)
                    raise ServerLost from None
        finally:
            os.close(write_end)  # the child's copy is its stdout: EOF here once it (and its own children) exit
        forked.forked.wait()
        if forked.pid == 0:
            raise ServerLost
        return forked

    def retire(self) -> bool:
        """Stop the server if none of its children runs (it exits on EOF); whether it stopped."""
        with self._lock:
            if self._running or self._awaiting or not self.alive:
                return False
            self.alive = False
        self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader, which reaps the server
        return True

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(zygote.MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            with self._lock:
                if "pid" in message:
                    forked = self._awaiting.popleft()
                    forked.pid = message["pid"]
                    self._running[forked.pid] = forked
                    forked.forked.set()
                elif (ended := self._running.pop(message["ended"], None)) is not None:
                    ended.end(message["code"])
        self._lost()

    def _lost(self) -> None:
        """The server is gone: nobody will report its children's exits, so end them here."""
        with self._lock:
            self.alive = False
            for forked in self._awaiting:
                forked.forked.set()  # pid 0: `launch` raises ServerLost
            self._awaiting.clear()
        self.process.wait()
        self._sock.close()
        for pid, forked in self._running.items():
            _kill_and_wait(pid)
            forked.end(-signal.SIGKILL)
        self._running.clear()


def _kill_and_wait(pid: int) -> None:
    """SIGKILL the process group of `pid`, which is not our child, and wait until `pid` has ended."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        select.select([handle], [], [])  # readable once the process has exited
    finally:
        os.close(handle)


_servers: dict[tuple[tuple[str, str], ...], ForkServer] = {}
_servers_lock = threading.Lock()


def fork_server(env: dict[str, str]) -> ForkServer:
    """The running fork server for `env`'s environment (`preload_key`), started if there is none."""
    key = preload_key(env)
    with _servers_lock:
        server = _servers.get(key)
        if server is None or not server.alive:
            for other in [k for k, s in _servers.items() if k != key and s.retire()]:
                del _servers[other]  # one idle server at most: each holds its own copy of torch
            server = _servers[key] = ForkServer(dict(key))
        return server
