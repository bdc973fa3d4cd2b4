"""Runs the SDK's own command-line tool, `tinker`, against a stack."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_tinker_cli(base_url: str, api_key: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`tinker ARGS` with the stack's address and key in its environment; never raises on failure."""
    env = {**os.environ, "TINKER_BASE_URL": base_url, "TINKER_API_KEY": api_key}
    return subprocess.run(
        [str(Path(sys.executable).with_name("tinker")), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
