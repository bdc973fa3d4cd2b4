"""The numerical tests hold on other CPU code paths, not only on the one this machine picks.

A bound tuned on one processor fails on the next: MKL and torch choose GEMM kernels, blockings
and summation orders per CPU and per thread count. This re-runs every test marked ``numerics``
(their bounds come from ``tests/numerics.py``) in a fresh interpreter under each combination of
torch thread count (1, 2) and ATen CPU capability (``default``: no vector kernels; ``avx2``; and
the machine's own), plus MKL's ``COMPATIBLE`` code path, which computes GEMMs with other kernels
than the machine's own (on the AMD machine the bounds were first tuned on, it reproduces the
failures an Intel AVX-512 machine showed). The plain suite run under ``make test`` is the
machine's own capability at one thread (the Makefile gives every pytest-xdist worker one torch
thread), so the matrix runs the machine's own capability at two threads.

Three cuts keep the matrix to distinct paths only. A path that is the same as an earlier one on
this machine (the machine's own capability is AVX2, so "own" is "avx2") is skipped, saying which it
equals; so is the path the suite itself is running on (its thread count, the machine's own
capability, its MKL code path: under ``make test``, one thread and AVX2 on an AVX2 machine), whose
``numerics`` tests this very run already passes. And the tensor-parallel test (services/trainer/tests/test_tp.py) runs on the 1-thread paths
only: its TP=2 ranks pin themselves to one thread, so on a 2-thread path only its TP=1 side would
change, and that side is the engine whose arithmetic on that path every other ``numerics`` test of
the trainer checks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the numerics suite again under six CPU code paths

ROOT = Path(__file__).resolve().parents[2]
NUMERIC_TESTS = ["services/trainer/tests", "services/sampler/tests"]
TP_TEST = "services/trainer/tests/test_tp.py::test_tp2_matches_tp1"

PATHS = [
    pytest.param({"OMP_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "default"}, id="1-thread-default"),
    pytest.param({"OMP_NUM_THREADS": "2", "ATEN_CPU_CAPABILITY": "default"}, id="2-threads-default"),
    pytest.param({"OMP_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "avx2"}, id="1-thread-avx2"),
    pytest.param({"OMP_NUM_THREADS": "2", "ATEN_CPU_CAPABILITY": "avx2"}, id="2-threads-avx2"),
    pytest.param({"OMP_NUM_THREADS": "2"}, id="2-threads-own"),
    pytest.param({"OMP_NUM_THREADS": "2", "MKL_CBWR": "COMPATIBLE"}, id="2-threads-mkl-compatible"),
]


def own_capability() -> str:
    """The ATen CPU capability torch picks on this machine ("avx512", "avx2", "default", ...)."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability()).lower()


def path_key(env: dict[str, str], own: str) -> tuple[str, str, str]:
    """What a path runs on here: (threads, capability, MKL code path)."""
    return env["OMP_NUM_THREADS"], env.get("ATEN_CPU_CAPABILITY", own).lower(), env.get("MKL_CBWR", "")


def suite_path(own: str) -> tuple[str, str, str]:
    """The path this process computes on: its torch threads, capability and MKL code path."""
    import torch

    return (
        str(torch.get_num_threads()),
        os.environ.get("ATEN_CPU_CAPABILITY", own).lower(),
        os.environ.get("MKL_CBWR", ""),
    )


@pytest.mark.parametrize("env", PATHS)
def test_numerical_tests_pass_on_this_cpu_path(env: dict[str, str], tmp_path: Path) -> None:
    """Every ``numerics`` test passes (none fails, none errors, at least 40 run) under ``env``."""
    own = own_capability()
    envs: list[dict[str, str]] = [p.values[0] for p in PATHS]  # type: ignore[misc]
    same = [p.id for p, e in zip(PATHS[: envs.index(env)], envs, strict=False) if path_key(e, own) == path_key(env, own)]
    if same:
        pytest.skip(f"the same path as {same[0]} on this machine (its own capability is {own})")
    if path_key(env, own) == suite_path(own):
        pytest.skip(f"the path this suite runs on ({suite_path(own)}): its numerics tests run in it")
    deselect = ["--deselect", TP_TEST] if env["OMP_NUM_THREADS"] != "1" else []
    run_env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    run_env.update(env, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "numerics",
            "-p",
            "no:cacheprovider",
            "--basetemp",
            str(tmp_path / "t"),
            *deselect,
            *NUMERIC_TESTS,
        ],
        cwd=ROOT,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = "\n".join(done.stdout.splitlines()[-40:])
    assert done.returncode == 0, f"{env}:\n{tail}\n{done.stderr[-2000:]}"
    summary = done.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 40, summary
    assert "failed" not in summary and "error" not in summary, summary
