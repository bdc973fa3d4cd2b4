"""A tensor-parallel trainer group started by the launcher (`TINKERD_TRAINER_TP=2`, gloo on CPU),
driven through the official SDK, against an independent TP=1 run of the same calls.

The stack starts its trainer as `tinkerd serve trainer` with TP=2: the launcher starts two ranks;
rank 0 consumes the work subject and broadcasts every engine call to rank 1. A rank dying (a fault
point kills rank 1 inside a call) takes the whole group down and the supervisor restarts it
(recovery replays). The reference is the
same SDK calls on a fresh model with the same seed, run after the trainer was restarted with TP=1.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types
from transformers import AutoConfig

from libs.checkpoints import layout
from libs.faults import fired
from tests.harness import Stack
from tests.numerics import ChainShape, assert_within, gamma
from tests.sdk import seeded_datum

LR = 1e-2
# eps = 1 keeps each Adam update a smooth function of its gradient (see
# services/trainer/tests/tp_worker.py): with a tiny eps the first step is lr * sign(g), and the
# fp32 reduction-order noise of near-zero gradient entries would flip whole updates.
ADAM = types.AdamParams(learning_rate=LR, eps=1.0)
TOKENS = 16
STEPS = 2
FAULT = "trainer.follower.forward_backward@3:kill"
"""Rank 1 dies on receiving its third forward_backward call (forward counts: it is one)."""
GROUP_STARTED = re.compile(r"started trainer group of (\d+) ranks \(pids \[(\d+), (\d+)\]")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    data_dir = tmp_path_factory.mktemp("tp")
    env = {
        "TINKERD_FAULT_POINTS": FAULT,
        "TINKERD_FAULT_DIR": str(data_dir / "faults"),
        "TINKERD_TRAINER_TP": "2",
        "TINKERD_TRAINER_DEVICE": "cpu",
        "OMP_NUM_THREADS": "1",  # two ranks on two cores
        "TINKERD_NUM_SLOTS": "4",
        "TINKERD_MAX_LORA_RANK": "8",
    }
    running = Stack(data_dir, env_overrides=env).start()
    try:
        yield running
    finally:
        running.stop()


def datum(step: int) -> types.Datum:
    return seeded_datum(step, TOKENS)


def group_pids(stack: Stack) -> list[int]:
    """The rank pids the newest launcher logged."""
    for line in reversed(stack.logs["trainer"]):
        found = GROUP_STARTED.search(line)
        if found:
            assert int(found.group(1)) == 2
            return [int(found.group(2)), int(found.group(3))]
    raise AssertionError("no trainer group was started:\n" + "\n".join(stack.logs["trainer"][-30:]))


def run_scenario(stack: Stack, api_key: str) -> dict[str, Any]:
    """create (seed 5), STEPS x (forward_backward + optim_step), forward, save_state,
    save_weights_for_sampler, sample; returns the numbers and the saved files' tensors."""
    service = tinker.ServiceClient(base_url=stack.base_url, api_key=api_key)
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=5).result()
    logprobs, losses, norms = [], [], []
    for step in range(STEPS):
        out = training.forward_backward([datum(step)], "cross_entropy").result()
        logprobs.append(out.loss_fn_outputs[0]["logprobs"].to_numpy())
        losses.append(float(out.metrics["loss:sum"]))
        stepped = training.optim_step(ADAM).result()
        assert stepped.metrics is not None
        norms.append(float(stepped.metrics["grad_norm"]))
    after = training.forward([datum(STEPS)], "cross_entropy").result()
    logprobs.append(after.loss_fn_outputs[0]["logprobs"].to_numpy())
    training.save_state("tp").result()
    sampler_path = training.save_weights_for_sampler("tp").result().path
    sample = (
        training.create_sampling_client(sampler_path).result()
        .sample(types.ModelInput.from_ints([3, 4, 5]), 1, types.SamplingParams(max_tokens=4, seed=1))
        .result()
    )
    files: dict[str, torch.Tensor] = {}
    for kind in ("training", "sampler"):
        directory = layout.resolve(layout.public_path(stack.data_dir, training.model_id, kind, "tp"))
        assert directory is not None, f"no {kind} checkpoint was published"
        for file in sorted(directory.glob("*.safetensors")):
            files |= {f"{kind}/{file.name}:{k}": v for k, v in load_file(str(file)).items()}
    return {
        "model_id": training.model_id,
        "logprobs": logprobs,
        "losses": np.asarray(losses),
        "grad_norms": np.asarray(norms),
        "files": files,
        "sampled": [list(seq.tokens) for seq in sample.sequences],
    }


def test_a_rank_dying_inside_a_call_restarts_the_group_and_the_unit_succeeds(stack: Stack) -> None:
    """Rank 1 is killed (fault point) on receiving its third forward_backward call (a forward is one), which
    rank 0 is already computing: rank 0 publishes no outcome for it (its collective fails, and it
    exits instead of reporting an error), the launcher takes the group down, the supervisor starts
    a new two-rank group, the unit is delivered again and the SDK call succeeds; the model trained
    before the kill gives bit-identical logprobs afterwards (recovery replayed its units)."""
    service = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-tp-kill")
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=2).result()
    training.forward_backward([datum(0)], "cross_entropy").result()  # engine call 1 on rank 1
    training.optim_step(ADAM).result()
    old = group_pids(stack)
    before = training.forward([datum(1)], "cross_entropy").result()  # engine call 2 (forward only)
    out = training.forward_backward([datum(2)], "cross_entropy").result()  # rank 1 dies in this one
    assert len(out.loss_fn_outputs) == 1
    assert fired(FAULT, stack.data_dir / "faults")
    new = group_pids(stack)
    assert set(new).isdisjoint(old)
    for pid in old:  # both old ranks are gone (rank 0 too): none is left waiting in a collective
        assert not Path(f"/proc/{pid}").exists()
    logs = stack.logs["trainer"]
    # whichever the launcher reaps first: rank 1 (killed) or rank 0 (exited: its peer is gone)
    assert any(
        f"(pid {old[1]}) exited with code -9" in line or f"(pid {old[0]}) exited with code 71" in line
        for line in logs
        if "taking the trainer group down" in line
    ), "\n".join(logs[-30:])
    assert not any("trainer error" in line for line in logs)

    again = training.forward([datum(1)], "cross_entropy").result()
    assert np.array_equal(
        again.loss_fn_outputs[0]["logprobs"].to_numpy(), before.loss_fn_outputs[0]["logprobs"].to_numpy()
    )


def test_tp2_group_matches_an_independent_tp1_run(stack: Stack) -> None:
    """The same SDK calls on TP=2 and (after restarting the trainer with TP=1) on a fresh model
    with the same seed: logprobs, losses, grad norms, the saved training state and the sampler
    weights agree within twice the fp32 bound of tests/numerics (both sides are fp32; TP=2 splits
    reductions and adds an all-reduce), and both sample."""
    assert any("rank 1 of 2 ready" in line for line in stack.logs["trainer"])
    tp2 = run_scenario(stack, "tml-tp2")

    trainer = stack.supervisor.children["trainer"] if stack.supervisor else None
    assert trainer is not None
    trainer.env["TINKERD_TRAINER_TP"] = "1"
    assert stack.kill("trainer").wait(240), stack.dump_logs()
    assert "tp=1" in next(line for line in reversed(stack.logs["trainer"]) if "ready (" in line)
    tp1 = run_scenario(stack, "tml-tp1")

    chain = ChainShape.of_hf_config(AutoConfig.from_pretrained(str(stack.data_dir / "models" / "tiny-qwen3")))
    g = gamma(chain.backward_depth(TOKENS - 1) + 2)  # the longest chain, plus the all-reduce
    for i, (a, b) in enumerate(zip(tp2["logprobs"], tp1["logprobs"], strict=True)):
        assert_within(a, b, 2 * g * np.abs(b).max(), f"logprobs[{i}]")
    n = TOKENS - 1  # each loss sums n logprobs
    assert_within(tp2["losses"], tp1["losses"], 2 * g * n * max(np.abs(b).max() for b in tp1["logprobs"]), "losses")
    assert_within(tp2["grad_norms"], tp1["grad_norms"], 2 * g * tp1["grad_norms"], "grad norms")
    # Adam with eps = 1 moves a weight by at most lr * (gradient error) <= lr * g * |grad| per step
    drift = STEPS * 2 * LR * g * float(tp1["grad_norms"].max())
    assert set(tp2["files"]) == set(tp1["files"])
    assert any(k.startswith("sampler/") for k in tp1["files"]) and any(k.startswith("training/") for k in tp1["files"])
    for name, want in tp1["files"].items():
        got = tp2["files"][name]
        assert got.shape == want.shape, name
        if "optimizer" in name:  # moments: (1 - b2) g^2 doubles the gradient's relative error
            bound = 2 * 2 * g * float(want.abs().max())
        else:
            bound = 2 * g * float(want.abs().max()) + drift
        assert_within(got, want, bound, name)
    for sampled in (tp2["sampled"], tp1["sampled"]):
        assert len(sampled) == 1 and len(sampled[0]) == 4


TINKERD = [sys.executable, "-m", "tinkerd.cli"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "trainer", "--tp", "0"], "--tp must be a positive integer, got '0'"),
        (["serve", "trainer", "--tp", "two"], "--tp must be a positive integer, got 'two'"),
        (["serve", "gateway", "--tp", "2"], "--tp applies to the trainer only"),
        (["up", "--tp", "-1"], "--tp must be a positive integer, got '-1'"),
    ],
)
def test_a_bad_tp_flag_stops_the_command_naming_it(argv: list[str], message: str) -> None:
    done = subprocess.run([*TINKERD, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert message in done.stderr


def test_up_passes_its_tp_to_the_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    """`tinkerd up --tp 2` starts the stack with TINKERD_TRAINER_TP=2 for the trainer it supervises."""
    import tinkerd.supervisor
    from tinkerd.cli import parser

    seen: dict[str, Any] = {}
    monkeypatch.setattr(tinkerd.supervisor, "up", lambda **kwargs: seen.update(kwargs) or 0)
    args = parser().parse_args(["up", "--tp", "2"])
    assert args.func(args) == 0
    assert seen["extra_env"] == {"TINKERD_TRAINER_TP": "2"}
