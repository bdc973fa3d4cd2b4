"""Tenant isolation under bad numbers: one slot's non-finite values never reach another slot.

A tenant can make its own loss overflow with finite inputs (docs/semantics.md: `cross_entropy`
weights of 3e38). Packed with others into one unit, its gradients must stay its own: every other
slot's gradients, step and weights are bit-identical to the same batch with a well-behaved
neighbour, with either multi-slot strategy (per segment, the CPU default; grouped/stacked, the
GPU default, forced here on CPU). An optimizer step that would leave a slot non-finite is
refused or rolled back, and reported; the slots stepped with it are untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from services.trainer.engine import AdamParams, DatumInput, DatumOutput, LoraConfig, StepReport, TrainerEngine
from services.trainer.lora import grouped_mm_supported
from services.trainer.tests.helpers import ce_datum, randomize_slot

GOOD, BAD, THIRD = 0, 1, 3


def _overflowing(rng: np.random.Generator, slot: int, n: int) -> DatumInput:
    """Finite inputs whose loss and gradients overflow float32."""
    return _big(rng, slot, n, 3e38)


def _setup(engine: TrainerEngine) -> None:
    randomize_slot(engine, GOOD, LoraConfig(rank=8, seed=1), seed=1)
    randomize_slot(engine, BAD, LoraConfig(rank=4, seed=2), seed=2)
    randomize_slot(engine, THIRD, LoraConfig(rank=2, seed=3, train_mlp=False), seed=3)


def _batch(bad_weights_overflow: bool) -> list[DatumInput]:
    """GOOD, BAD and THIRD interleaved; BAD's datums overflow or not."""
    rng = np.random.default_rng(11)
    out = []
    for slot, n in ((BAD, 6), (GOOD, 7), (THIRD, 5), (BAD, 4), (GOOD, 3)):
        out.append(_overflowing(rng, slot, n) if slot == BAD and bad_weights_overflow else ce_datum(rng, slot, n))
    return out


def _state(engine: TrainerEngine, slot: int) -> dict[str, torch.Tensor]:
    state = engine.get_slot_state(slot)
    return {**state.adapter, **{f"m.{k}": v for k, v in state.exp_avg.items()}, **{f"v.{k}": v for k, v in state.exp_avg_sq.items()}}


@dataclass
class Run:
    grads: dict[int, dict[str, torch.Tensor]]  # after forward_backward
    states: dict[int, dict[str, torch.Tensor]]  # after optim_step
    reports: dict[int, StepReport]
    outputs: list[DatumOutput]


def _run(engine: TrainerEngine, overflow: bool) -> Run:
    for slot in range(engine.config.num_slots):
        engine.release_slot(slot)
    _setup(engine)
    outputs = engine.forward_backward(_batch(overflow), "cross_entropy")
    grads = {slot: engine.get_slot_grads(slot) for slot in (GOOD, BAD, THIRD)}
    hp = AdamParams(learning_rate=1e-2)
    reports = engine.optim_step({GOOD: hp, BAD: hp, THIRD: hp})
    states = {slot: _state(engine, slot) for slot in (GOOD, BAD, THIRD)}
    return Run(grads, states, reports, outputs)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused-ce", "fused-ce"])
@pytest.mark.parametrize("stacked", [False, True], ids=["per-segment", "stacked"])
def test_an_overflowing_tenant_leaves_its_neighbours_bit_identical(
    engine: TrainerEngine, stacked: bool, fused: bool
) -> None:
    """With one tenant's loss overflowing, every other slot's logprobs, losses, gradients, step,
    weights and moments are bit-identical to the same batch with that tenant well-behaved; the
    bad tenant's step is skipped and reported, its weights unchanged. ``fused-ce``: the loss
    through the chunked fused linear cross-entropy, in pieces of 4 tokens (the GPU default path)."""
    if stacked:  # on CPU the stacked strategy is the grouped matmul (torch._grouped_mm)
        assert grouped_mm_supported(torch.zeros(1))
    engine.pool.routing.stacked = stacked
    engine.fused_ce, engine.fused_ce_chunk = fused, 4
    try:
        clean = _run(engine, overflow=False)
        dirty = _run(engine, overflow=True)
    finally:
        engine.pool.routing.stacked = False
        engine.fused_ce, engine.fused_ce_chunk = engine.config.fused_cross_entropy, None

    assert not all(bool(torch.isfinite(g).all()) for g in dirty.grads[BAD].values()), "BAD did not overflow"
    for slot in (GOOD, THIRD):
        for name, g in clean.grads[slot].items():
            assert bool(torch.isfinite(dirty.grads[slot][name]).all()), f"slot {slot} {name}: non-finite gradient"
            assert torch.equal(dirty.grads[slot][name], g), f"slot {slot} {name}: gradient changed by its neighbour"
        for name, value in clean.states[slot].items():
            assert torch.equal(dirty.states[slot][name], value), f"slot {slot} {name}: state changed by its neighbour"
        assert dirty.reports[slot] == clean.reports[slot] and dirty.reports[slot].applied
    for datum, got, want in zip(_batch(False), dirty.outputs, clean.outputs, strict=True):
        if datum.slot != BAD:
            assert np.array_equal(got.logprobs, want.logprobs) and got.loss == want.loss
    report = dirty.reports[BAD]
    assert not report.applied and report.step == 0
    assert "non-finite gradient norm" in (report.reason or "")
    # The bad slot holds what it started with: the randomised adapter, zero moments.
    start = _run(engine, overflow=False)  # re-initialises every slot the same way, then steps
    _setup(engine)
    initial = _state(engine, BAD)
    for name, value in initial.items():
        assert torch.equal(dirty.states[BAD][name], value), name
    assert start.reports[BAD].applied


def _big(rng: np.random.Generator, slot: int, n: int, weight: float) -> DatumInput:
    datum = ce_datum(rng, slot, n)
    return DatumInput(slot, datum.tokens, {**datum.loss_inputs, "weights": np.full(n, weight, np.float32)})


@pytest.mark.parametrize(
    ("weight", "lr", "why"),
    [(1.0, 3e38, "could not be computed"), (1e25, 1e-2, "would have left non-finite")],
    ids=["learning-rate-overflows", "gradient-square-overflows"],
)
def test_a_step_that_would_leave_non_finite_state_is_rolled_back(
    engine: TrainerEngine, weight: float, lr: float, why: str
) -> None:
    """A finite gradient norm whose step would take the weights or moments past float32 (an
    extreme learning rate; a gradient whose square overflows the second moment) is rolled back
    (weights, moments, step counter as before, gradients cleared) and reported; the slot stepped
    in the same call applies normally."""
    randomize_slot(engine, GOOD, LoraConfig(rank=4, seed=1), seed=1)
    randomize_slot(engine, BAD, LoraConfig(rank=4, seed=2), seed=2)
    rng = np.random.default_rng(5)
    hp = AdamParams(learning_rate=1e-2)
    engine.forward_backward([ce_datum(rng, GOOD, 5), ce_datum(rng, BAD, 5)], "cross_entropy")
    engine.optim_step({GOOD: hp, BAD: hp})  # one good step each, so the moments are non-zero
    engine.forward_backward([ce_datum(rng, GOOD, 5), _big(rng, BAD, 5, weight)], "cross_entropy")
    before = _state(engine, BAD)
    reports = engine.optim_step({GOOD: hp, BAD: AdamParams(learning_rate=lr)})

    bad = reports[BAD]
    assert math.isfinite(bad.grad_norm), "precondition: the gradient norm is finite"
    assert not bad.applied and bad.step == 1
    assert why in (bad.reason or "") and "rolled back" in (bad.reason or "")
    after = _state(engine, BAD)
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    assert engine.get_slot_state(BAD).step == 1
    assert all(float(g.abs().max()) == 0 for g in engine.get_slot_grads(BAD).values())
    assert not engine.has_pending_grads(BAD)
    good = reports[GOOD]
    assert good.applied and good.step == 2
    assert all(bool(torch.isfinite(v).all()) for v in _state(engine, GOOD).values())
