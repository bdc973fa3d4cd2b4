"""Runs the SDK's own command-line tool, `tinker`, against a stack.

The command runs in a fresh interpreter exactly as the `tinker` console script runs it, except
that the interpreter leaves through `os._exit` once the command has returned and its output is
flushed. The SDK's HTTP transport (pyqwest) runs tokio threads that may still hand a response
chunk to Python while the interpreter finalizes; CPython 3.11 then calls `pthread_exit` on that
Rust thread, which aborts the process (SIGABRT, no output) after the command has finished and
printed its result: about one run in fifty on a loaded two-core machine. Skipping finalization
keeps the exit status the command's own, which is what the tests check.
"""

from __future__ import annotations

import os
import subprocess
import sys

_RUN_CLI = """
import os, sys
from tinker.cli.__main__ import cli
sys.argv[0] = "tinker"
try:
    cli()
    code = 0
except SystemExit as stop:
    code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    if isinstance(stop.code, str):
        print(stop.code, file=sys.stderr)
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
"""


def run_tinker_cli(base_url: str, api_key: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`tinker ARGS` with the stack's address and key in its environment; never raises on failure."""
    env = {**os.environ, "TINKER_BASE_URL": base_url, "TINKER_API_KEY": api_key}
    return subprocess.run(
        [sys.executable, "-c", _RUN_CLI, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
