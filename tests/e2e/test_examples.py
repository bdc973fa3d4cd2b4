"""The examples in examples/ run against the stack that `make run` starts (here: the test stack)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import Stack

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, stack: Stack, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--base-url", stack.base_url, *args],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_examples_are_short() -> None:
    for path in EXAMPLES.glob("*.py"):
        assert len(path.read_text().splitlines()) < 60, f"{path.name} is 60 lines or more"


def test_sft_example_learns_and_samples_its_sentence(stack: Stack) -> None:
    stdout = run_example("sft_loop.py", stack, "--steps", "40")
    sample = next(line for line in stdout.splitlines() if line.startswith("sample :"))
    assert "quick brown fox" in sample, stdout
    assert "tinker://" in stdout


def test_rl_example_runs(stack: Stack) -> None:
    stdout = run_example("rl_loop.py", stack, "--iterations", "4")
    rewards = [float(line.split()[-1]) for line in stdout.splitlines() if line.startswith("iteration")]
    assert len(rewards) == 4 and all(0.0 <= r <= 1.0 for r in rewards)
