"""Contract, backward compatibility: the JSON-era SDK (tinker==0.24.1) against the real stack.

The client runs in its own interpreter (`make sdk024` creates `.venv-sdk024`; CI points
`TINKERD_SDK024_PYTHON` at it). Without that interpreter the test fails: CI runs both SDKs.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.harness import Stack

ROOT = Path(__file__).resolve().parents[2]
CLIENT = Path(__file__).with_name("sdk024_client.py")


def sdk024_python() -> str:
    configured = os.environ.get("TINKERD_SDK024_PYTHON")
    fallback = ROOT / ".venv-sdk024" / "bin" / "python"
    python = configured or (str(fallback) if fallback.exists() else None)
    if python is None or not Path(python).exists():
        pytest.fail("no SDK 0.24.1 interpreter: run `make sdk024` or set TINKERD_SDK024_PYTHON")
    return python


def test_sdk024_trains_saves_samples_and_resumes(stack: Stack) -> None:
    python = sdk024_python()
    version = subprocess.run(
        [python, "-c", "import tinker; print(tinker.__version__)"], capture_output=True, text=True, check=True
    )
    assert version.stdout.strip() == "0.24.1"
    env = {**os.environ, "TINKER_TELEMETRY": "0", "PYTHONPATH": ""}
    done = subprocess.run(
        [python, str(CLIENT), stack.base_url, "tml-sdk024"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert "loss:sum" in seen["fwdbwd_metrics"] and seen["fwdbwd_outputs"] == 2
    assert seen["forward_logprobs"] == 4
    assert seen["state"].endswith("/weights/state024")
    assert len(seen["samples"]) == 2 and all(seen["sample_logprobs"])
    logprobs = seen["compute_logprobs"]  # SamplingClient.compute_logprobs exists in 0.24.1
    assert len(logprobs) == 3 and logprobs[0] is None and all(isinstance(v, float) for v in logprobs[1:])
    assert "loss:sum" in seen["resumed_metrics"]
    assert {"weights/state024", "sampler_weights/sampler024"} <= set(seen["checkpoints"])
