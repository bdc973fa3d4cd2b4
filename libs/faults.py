"""Fault-injection points for crash tests (off unless `TINKERD_FAULT_POINTS` names some).

Code marks the places where a crash matters with `crash_point("trainer.outcome_published")`.
`TINKERD_FAULT_POINTS` is a comma-separated list of specs `NAME[@N][:ACTION]`: the spec fires the
N-th time (default 1st) this process reaches point NAME, and only once ever: a marker file in
`TINKERD_FAULT_DIR` records that it fired, so the restarted process runs through. Actions:

- `kill` (default): SIGKILL this process, exactly like `kill -9`;
- `hang`: block the calling thread forever (a wedged kernel, a deadlock): the process stays
  alive and must be detected by a watchdog;
- `enospc`: raise `OSError(ENOSPC)` where the point is, as a full disk does;
- `hold`: block the calling thread until the test lets it go (`release`): a slow disk, held
  for exactly as long as the test needs, with the rest of the process running.

Points in shared code take the service's name from `TINKERD_SERVICE` (set by `tinkerd serve`),
e.g. `service_point("checkpoint_write")` is `publisher.checkpoint_write` in the publisher.
The older single-point form, `TINKERD_FAULT_POINT=NAME` with its marker file
`TINKERD_FAULT_MARKER`, still works.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ACTIONS = ("kill", "hang", "enospc", "hold")
HOLD_POLL_S = 0.05
_hits: Counter[str] = Counter()
_lock = threading.Lock()


@dataclass(frozen=True)
class Spec:
    point: str
    nth: int
    action: str
    marker: Path

    @classmethod
    def parse(cls, text: str, directory: Path) -> Spec:
        match = re.fullmatch(r"([\w.\-]+)(?:@(\d+))?(?::(\w+))?", text.strip())
        if match is None or (match.group(3) or "kill") not in ACTIONS:
            raise ValueError(f"bad fault spec {text!r}: NAME[@N][:{'|'.join(ACTIONS)}]")
        name = re.sub(r"[^\w.\-]", "_", text.strip())
        return cls(match.group(1), int(match.group(2) or 1), match.group(3) or "kill", directory / f"{name}.fired")


def specs(env: dict[str, str] | os._Environ[str] = os.environ) -> list[Spec]:
    out = []
    if raw := env.get("TINKERD_FAULT_POINTS"):
        directory = Path(env.get("TINKERD_FAULT_DIR", "/tmp/tinkerd-faults"))
        out += [Spec.parse(item, directory) for item in raw.split(",") if item.strip()]
    if single := env.get("TINKERD_FAULT_POINT"):
        marker = Path(env.get("TINKERD_FAULT_MARKER", "/tmp/tinkerd-fault-fired"))
        out.append(Spec(single, 1, "kill", marker))
    return out


def fired(spec_text: str, directory: Path) -> bool:
    """Whether the spec `spec_text` of a run whose `TINKERD_FAULT_DIR` is `directory` fired."""
    return Spec.parse(spec_text, directory).marker.exists()


def release(spec_text: str, directory: Path) -> None:
    """Let a `hold` spec of a run whose `TINKERD_FAULT_DIR` is `directory` go on."""
    marker = Spec.parse(spec_text, directory).marker
    marker.with_name(marker.name + ".release").touch()


def service() -> str:
    return os.environ.get("TINKERD_SERVICE", "")


def hits(name: str) -> int:
    """How often this process has reached point `name` while a spec named it (`@N` counts on)."""
    with _lock:
        return _hits[name]


def service_point(name: str) -> None:
    """A point in code that several services share, named after the service running it."""
    crash_point(f"{service()}.{name}")


def crash_point(name: str) -> None:
    active = [spec for spec in specs() if spec.point == name]
    if not active:
        return
    with _lock:
        _hits[name] += 1
        hit = _hits[name]
    for spec in active:
        if spec.nth != hit:
            continue
        spec.marker.parent.mkdir(parents=True, exist_ok=True)
        try:
            spec.marker.touch(exist_ok=False)
        except FileExistsError:
            continue
        if spec.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.action == "hang":
            threading.Event().wait()
        elif spec.action == "hold":
            released = spec.marker.with_name(spec.marker.name + ".release")
            while not released.exists():
                threading.Event().wait(HOLD_POLL_S)
        elif spec.action == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
