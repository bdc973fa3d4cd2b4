"""Contract, backward compatibility: the JSON-era SDK (tinker==0.24.1) against the real stack.

The client runs in its own interpreter (`make sdk024` creates `.venv-sdk024`; CI points
`TINKERD_SDK024_PYTHON` at it). Without that interpreter the test fails: CI runs both SDKs. The
client (sdk024_client.py) calls and checks every public method of its SDK's four clients; this test
requires that none is left unverified. The stack offers JWT auth, which 0.24.1 also speaks.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import tinker

from tests.harness import JWT_AUTH, SharedStacks, Stack

ROOT = Path(__file__).resolve().parents[2]
CLIENT = Path(__file__).with_name("sdk024_client.py")
KEY = "tml-sdk024"


@pytest.fixture(scope="module")
def stack(shared_stacks: SharedStacks) -> Stack:
    """The whole stack, with JWT auth offered to SDKs (shared with the other contract module that offers it)."""
    return shared_stacks.get(JWT_AUTH)


def sdk024_python() -> str:
    configured = os.environ.get("TINKERD_SDK024_PYTHON")
    fallback = ROOT / ".venv-sdk024" / "bin" / "python"
    python = configured or (str(fallback) if fallback.exists() else None)
    if python is None or not Path(python).exists():
        pytest.fail("no SDK 0.24.1 interpreter: run `make sdk024` or set TINKERD_SDK024_PYTHON")
    return python


def test_sdk024_calls_and_checks_every_method_of_its_surface(stack: Stack) -> None:
    python = sdk024_python()
    version = subprocess.run(
        [python, "-c", "import tinker; print(tinker.__version__)"], capture_output=True, text=True, check=True
    )
    assert version.stdout.strip() == "0.24.1"
    # An external export (SDK 0.28+) of the same tenant: 0.24.1 must still list it (as "sampler").
    newer = tinker.ServiceClient(base_url=stack.base_url, api_key=KEY)
    exported = newer.create_lora_training_client(base_model="tiny-qwen3", rank=4).result()
    export_path = exported.save_weights_external("export-by-038").result().path
    env = {**os.environ, "TINKER_TELEMETRY": "0", "PYTHONPATH": ""}
    done = subprocess.run(
        [python, str(CLIENT), stack.base_url, KEY, "tml-sdk024-other"],
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["surface"] > 80 and seen["unverified"] == [], seen["unverified"]
    # only the two client-side-only methods may be skipped, and only for want of torch there
    assert set(seen["skipped_without_torch"]) <= {
        "TrainingClient.forward_backward_custom",
        "TrainingClient.forward_backward_custom_async",
    }
    assert "loss:sum" in seen["fwdbwd_metrics"] and seen["fwdbwd_outputs"] == 2
    assert seen["forward_logprobs"] == 4
    assert seen["state"].endswith("/weights/state024")
    assert len(seen["samples"]) == 2 and all(seen["sample_logprobs"])
    logprobs = seen["compute_logprobs"]
    assert len(logprobs) == 3 and logprobs[0] is None and all(isinstance(v, float) for v in logprobs[1:])
    assert "loss:sum" in seen["resumed_metrics"]
    assert {"weights/state024", "sampler_weights/sampler024"} <= set(seen["checkpoints"])
    assert export_path.endswith("/external_weights/export-by-038")
    newer.close("success").result()
