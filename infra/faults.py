"""Fault-injection points for crash tests (off unless `TINKERD_FAULT_POINT` names one).

`crash_point("publisher.version_written")` kills the current process with SIGKILL — exactly like
`kill -9` — the first time execution reaches that point, and never again (a marker file beside
`TINKERD_FAULT_MARKER` records that it fired), so the restarted process runs through.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def crash_point(name: str) -> None:
    if os.environ.get("TINKERD_FAULT_POINT") != name:
        return
    marker = Path(os.environ.get("TINKERD_FAULT_MARKER", "/tmp/tinkerd-fault-fired"))
    try:
        marker.touch(exist_ok=False)
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)
