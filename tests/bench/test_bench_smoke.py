"""Smoke test of the CPU benchmarks: each script runs with --quick, exits 0 and prints its tables.

No timing is asserted: the numbers belong in docs/benchmarks.md, from full runs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ["gateway_overhead", "trainer_cpu", "sampler_cpu", "recovery", "client_transport"]


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_script_runs_quick_and_prints_its_table(name: str) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{name}.py"), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "machine: " in done.stdout
    assert "\n## " in done.stdout and "\n|---|" in done.stdout, done.stdout[-3000:]
