"""A TP=2 trainer group on two GPUs (NCCL), through the stack and the SDK, against TP=1.

Starts `tests.harness.Stack` with `TINKERD_TRAINER_TP=2` and `TINKERD_TRAINER_DEVICE=cuda` (the
launcher starts two ranks, one GPU each), runs the SDK scenario of
`tests/integration/test_tensor_parallel.py`, records which GPUs the ranks hold, restarts the
trainer with TP=1 and runs the scenario again on a fresh model with the same seed; writes the
numbers and their differences to OUT/tp.json.

    python -m bench.gpu_tp --out OUT [--base-model tiny-qwen3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from tests.harness import Stack
from tests.integration.test_tensor_parallel import run_scenario


def gpu_apps() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi failed: {exc}"


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(float(np.abs(b).max()), 1e-30))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {
        "TINKERD_TRAINER_TP": "2",
        "TINKERD_TRAINER_DEVICE": args.device,
        "TINKERD_NUM_SLOTS": "4",
        "TINKERD_MAX_LORA_RANK": "8",
    }
    report: dict[str, object] = {}
    stack = Stack(Path(tempfile.mkdtemp(prefix="gpu-tp-")), env_overrides=env)
    started = time.monotonic()
    try:
        stack.start()
        report["start_s"] = time.monotonic() - started
        report["gpu_apps_tp2"] = gpu_apps()
        t0 = time.monotonic()
        tp2 = run_scenario(stack, "tml-gpu-tp2")
        report["scenario_tp2_s"] = time.monotonic() - t0
        assert stack.supervisor is not None
        stack.supervisor.children["trainer"].env["TINKERD_TRAINER_TP"] = "1"
        if not stack.kill("trainer").wait(300):
            raise RuntimeError("the TP=1 trainer did not start")
        t0 = time.monotonic()
        tp1 = run_scenario(stack, "tml-gpu-tp1")
        report["scenario_tp1_s"] = time.monotonic() - t0
        report["losses"] = {"tp2": tp2["losses"].tolist(), "tp1": tp1["losses"].tolist()}
        report["grad_norms"] = {"tp2": tp2["grad_norms"].tolist(), "tp1": tp1["grad_norms"].tolist()}
        report["logprobs_rel"] = [rel(a, b) for a, b in zip(tp2["logprobs"], tp1["logprobs"], strict=True)]
        report["files_rel_max"] = max(
            rel(tp2["files"][k].float().numpy(), v.float().numpy()) for k, v in tp1["files"].items()
        )
        report["sampled"] = {"tp2": tp2["sampled"], "tp1": tp1["sampled"]}
    finally:
        report["trainer_log"] = [line for line in stack.logs["trainer"] if "INFO" in line or "ERROR" in line][-40:]
        (out / "tp.json").write_text(json.dumps(report, indent=2, default=str))
        stack.stop()
    print(json.dumps({k: v for k, v in report.items() if k != "trainer_log"}, indent=2, default=str))


if __name__ == "__main__":
    main()
