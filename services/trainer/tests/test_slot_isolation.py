"""A slot's training does not depend on the units it shares: bit-identical however they are composed.

One seeded slot (the subject) trains ``STEPS`` steps, a ``forward_backward`` of its own datums
then an ``optim_step``, with the same datums and hyper-parameters each time. Around it, the other
slots of the engine are composed differently:

- ``alone``: nothing else in any call;
- ``packed``: other slots' datums packed into the same ``forward_backward`` call;
- ``stepped-together``: other slots stepped in the same ``optim_step`` call (their gradients
  from calls of their own);
- ``changing``: a different set and order of other slots in every step's two calls;
- ``skipped-neighbours``: in the same calls, a slot whose loss overflows (its step is skipped)
  and a slot with zero gradients (never given a datum).

Every composition must leave the subject exactly as ``alone`` does (fp32 on the CPU, compared
with ``torch.equal``): its logprobs and losses, every step's report (gradient norm, applied, step
count), and its adapter, AdamW moments and step count after the last step. The neighbours differ
in rank and in the modules they train; the subject trains whole rows of the pool (its rank is the
pool's) or fewer, and the whole run is repeated on the multi-slot paths a GPU takes by default,
forced on the CPU (grouped LoRA matmuls, the fused cross-entropy, the fused AdamW update).

The subject's datums hold 20 tokens per call: the base model's GEMMs give a token's row the same
bits whatever the number of rows only from 16 rows up (MKL takes another kernel for fewer), which
every packed unit of the subject, and the subject alone, then has.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from services.trainer.engine import AdamParams, DatumInput, LoraConfig, TrainerEngine
from services.trainer.lora import grouped_mm_supported
from services.trainer.tests.helpers import ce_datum, randomize_slot

SUBJECT = 1
STEPS = 3
# The subject's hyper-parameters clip its gradient, so its norm reaches the weights too.
SUBJECT_HP = AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=0.5)
NEIGHBOUR_HP = AdamParams(learning_rate=3e-3, grad_clip_norm=1.0)
NEIGHBOURS = {  # slot -> config: full rows of the pool, a lower rank, other modules
    0: LoraConfig(rank=8, seed=10),
    2: LoraConfig(rank=2, seed=12, train_unembed=False),
    3: LoraConfig(rank=8, seed=13, train_attn=False),
}
SUBJECT_CONFIGS = {
    "full-rank": LoraConfig(rank=8, seed=1),  # the pool's rank: whole rows of every parameter
    "low-rank": LoraConfig(rank=4, seed=1, train_mlp=False),
}


def _subject_datums(step: int) -> list[DatumInput]:
    rng = np.random.default_rng(100 + step)
    return [ce_datum(rng, SUBJECT, 11), ce_datum(rng, SUBJECT, 9)]  # 20 tokens: see the docstring


def _neighbour_datums(slot: int, step: int, overflow: bool = False) -> list[DatumInput]:
    rng = np.random.default_rng(1000 * slot + step)
    datums = [ce_datum(rng, slot, 6 + slot), ce_datum(rng, slot, 3)]
    if overflow:  # finite inputs whose loss and gradients overflow float32
        datums = [
            DatumInput(
                d.slot, d.tokens, {**d.loss_inputs, "weights": np.full(d.num_tokens, 3e38, np.float32)}
            )
            for d in datums
        ]
    return datums


@dataclass(frozen=True)
class StepPlan:
    """One step around the subject: whose datums share its forward_backward (in the packed order,
    ``SUBJECT`` standing for its own), whose datums go in a call before it, who is stepped with it
    (in the order the call is given), and which slot's datums overflow."""

    packed: tuple[int, ...] = (SUBJECT,)
    before: tuple[int, ...] = ()
    stepped: tuple[int, ...] = (SUBJECT,)
    overflow: int | None = None


COMPOSITIONS: dict[str, list[StepPlan]] = {
    "alone": [StepPlan()] * STEPS,
    "packed": [StepPlan(packed=(0, SUBJECT, 2, 3))] * STEPS,
    "stepped-together": [StepPlan(before=(0, 2, 3), stepped=(3, SUBJECT, 0, 2))] * STEPS,
    "changing": [
        StepPlan(packed=(2, SUBJECT, 0), stepped=(SUBJECT, 0)),
        StepPlan(before=(3,), stepped=(3, 2, SUBJECT)),
        StepPlan(packed=(3, SUBJECT), before=(0,), stepped=(0, SUBJECT, 3)),
    ],
    "skipped-neighbours": [
        StepPlan(packed=(SUBJECT, 2, 0), stepped=(2, SUBJECT, 3, 0), overflow=2),
        StepPlan(packed=(2, SUBJECT), stepped=(SUBJECT, 2, 3), overflow=2),
        StepPlan(before=(2,), stepped=(3, 2, SUBJECT), overflow=2),
    ],
}


@dataclass
class SubjectRun:
    logprobs: list[torch.Tensor]  # every subject datum's, step by step
    losses: list[float]
    reports: list[tuple[bool, float, int]]  # (applied, grad_norm, step) of every step
    state: dict[str, torch.Tensor]  # adapter, moments
    step: int


def _interleaved(plan: StepPlan, step: int) -> list[DatumInput]:
    """The datums of ``plan.packed``, the slots' datums alternating (the subject's in its place)."""
    lists = [
        _subject_datums(step) if slot == SUBJECT else _neighbour_datums(slot, step, slot == plan.overflow)
        for slot in plan.packed
    ]
    out: list[DatumInput] = []
    for i in range(max(len(x) for x in lists)):
        out += [x[i] for x in lists if i < len(x)]
    return out


def _train(engine: TrainerEngine, subject: LoraConfig, plans: list[StepPlan]) -> SubjectRun:
    for slot in range(engine.config.num_slots):
        engine.release_slot(slot)
    randomize_slot(engine, SUBJECT, subject, seed=1)  # non-zero B: every gradient is non-zero
    for slot, config in NEIGHBOURS.items():
        randomize_slot(engine, slot, config, seed=config.seed or 0)
    logprobs: list[torch.Tensor] = []
    losses: list[float] = []
    reports: list[tuple[bool, float, int]] = []
    for step, plan in enumerate(plans):
        before = [d for slot in plan.before for d in _neighbour_datums(slot, step, slot == plan.overflow)]
        if before:
            engine.forward_backward(before, "cross_entropy")
        datums = _interleaved(plan, step)
        outputs = engine.forward_backward(datums, "cross_entropy")
        for datum, output in zip(datums, outputs, strict=True):
            if datum.slot == SUBJECT:
                logprobs.append(torch.from_numpy(output.logprobs))
                losses.append(output.loss)
        params = {slot: SUBJECT_HP if slot == SUBJECT else NEIGHBOUR_HP for slot in plan.stepped}
        got = engine.optim_step(params)
        report = got[SUBJECT]
        reports.append((report.applied, report.grad_norm, report.step))
        if plan.overflow is not None and plan.overflow in plan.stepped:
            assert not got[plan.overflow].applied, "precondition: the overflowing neighbour's step is skipped"
    state = engine.get_slot_state(SUBJECT)
    tensors = {
        **{f"adapter.{k}": v for k, v in state.adapter.items()},
        **{f"exp_avg.{k}": v for k, v in state.exp_avg.items()},
        **{f"exp_avg_sq.{k}": v for k, v in state.exp_avg_sq.items()},
    }
    return SubjectRun(logprobs, losses, reports, tensors, state.step)


@pytest.fixture(params=["cpu-paths", "gpu-paths"])
def paths(request: pytest.FixtureRequest, engine: TrainerEngine) -> Iterator[TrainerEngine]:
    """``cpu-paths``: the CPU engine's defaults (per-segment LoRA, unfused cross-entropy, the
    single-tensor AdamW). ``gpu-paths``: the CUDA defaults forced on the CPU (grouped LoRA
    matmuls, the fused cross-entropy in pieces of 4 tokens, the fused AdamW update)."""
    gpu = request.param == "gpu-paths"
    if gpu:
        assert grouped_mm_supported(torch.zeros(1))
    engine.pool.routing.stacked = gpu
    engine.fused_ce, engine.fused_ce_chunk = gpu, (4 if gpu else None)
    engine.optimizer.fused = True if gpu else None
    try:
        yield engine
    finally:
        engine.pool.routing.stacked = False
        engine.fused_ce, engine.fused_ce_chunk = engine.config.fused_cross_entropy, None
        engine.optimizer.fused = None


@pytest.mark.parametrize("subject", list(SUBJECT_CONFIGS), ids=list(SUBJECT_CONFIGS))
def test_a_slot_trains_bit_identically_however_its_units_are_composed(
    paths: TrainerEngine, subject: str
) -> None:
    """The subject's logprobs, losses, step reports, adapter, AdamW moments and step count are
    bit-identical in every composition of ``COMPOSITIONS`` to training it alone."""
    engine, config = paths, SUBJECT_CONFIGS[subject]
    runs = {name: _train(engine, config, plans) for name, plans in COMPOSITIONS.items()}
    alone = runs.pop("alone")
    assert alone.step == STEPS and all(applied for applied, _, _ in alone.reports)
    assert all(float(v.abs().max()) > 0 for k, v in alone.state.items() if not k.startswith("adapter.")), (
        "precondition: every moment of the subject moved"
    )
    for name, run in runs.items():
        for i, (got, want) in enumerate(zip(run.logprobs, alone.logprobs, strict=True)):
            assert torch.equal(got, want), f"{name}: logprobs of datum {i} differ"
        assert run.losses == alone.losses, f"{name}: losses differ"
        assert run.reports == alone.reports, f"{name}: step reports differ"
        assert run.step == alone.step, f"{name}: step count differs"
        differ = [key for key, want in alone.state.items() if not torch.equal(run.state[key], want)]
        assert not differ, f"{name}: {len(differ)} of {len(alone.state)} tensors differ, first {differ[:3]}"
