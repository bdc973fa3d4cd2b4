"""The supervisor's view of its stack: each child's state, written to one file others read.

`tinkerd up` (tinkerd/supervisor.py) rewrites `DATA/run/stack.json` atomically whenever a child
changes state; the gateway's healthz and `tinkerd status` read it (its path reaches every child
as `TINKERD_STACK_STATE_FILE`). States:

- `starting`: started, its ready line not seen yet;
- `up`: it logged ready (an HTTP service: it serves on its announced address);
- `restarting`: it exited and is started again after a backoff (`detail` says how it ended;
  `failing_since_ns` is when the current run of failures began);
- `stopped`: held down by an operator;
- `failed`: given up on (an address it cannot bind); the stack stops.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import msgspec

STARTING, UP, RESTARTING, STOPPED, FAILED = "starting", "up", "restarting", "stopped", "failed"


class ServiceState(msgspec.Struct, kw_only=True):
    state: str
    since_ns: int
    restarts: int = 0
    detail: str = ""
    address: str | None = None  # the URL it announced (HTTP services)
    failing_since_ns: int | None = None


class StackState(msgspec.Struct, kw_only=True):
    supervisor_pid: int
    services: dict[str, ServiceState]


def write_state(path: Path, state: StackState) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(msgspec.json.encode(state))
    os.replace(tmp, path)


def read_state(path: Path) -> StackState | None:
    """The stack's state, or None without a file or when its supervisor is gone."""
    try:
        state = msgspec.json.decode(path.read_bytes(), type=StackState)
    except (OSError, msgspec.DecodeError):
        return None
    try:
        os.kill(state.supervisor_pid, 0)
    except ProcessLookupError:
        return None  # a leftover of a stack that is not running
    except PermissionError:
        pass
    return state


def state_file_from_env(env: Mapping[str, str]) -> Path | None:
    value = env.get("TINKERD_STACK_STATE_FILE")
    return Path(value) if value else None


def describe(name: str, service: ServiceState) -> str:
    """One line: `sampler restarting (3 restarts): exited with code 1: ...`."""
    line = f"{name} {service.state}"
    if service.restarts:
        line += f" ({service.restarts} restarts)"
    if service.address:
        line += f" at {service.address}"
    return f"{line}: {service.detail}" if service.detail else line


def service_of(child: str) -> str:
    """The service a child runs: `gateway-1` (a second gateway replica) runs `gateway`, and
    `trainer@a` (the trainer of group `a`) runs `trainer`."""
    return child.partition("@")[0].split("-", 1)[0]
