"""optim_step: per-slot AdamW identical to torch.optim.AdamW, clipping, non-finite skip."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from services.trainer.engine import AdamParams, LoraConfig, TrainerEngine
from services.trainer.tests.helpers import ce_datum, randomize_slot
from tests.numerics import U32, assert_within, gamma

pytestmark = pytest.mark.numerics  # also run under other thread counts and CPU paths (tests/infra)


def _params(engine: TrainerEngine, slot: int) -> dict[str, torch.Tensor]:
    return {t.name: t.value().clone() for t in engine.pool.slot_tensors(slot)}


def _train_step(engine: TrainerEngine, slot: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    engine.forward_backward([ce_datum(rng, slot, 6), ce_datum(rng, slot, 4)], "cross_entropy")


@pytest.mark.parametrize("clip", [0.0, 0.5], ids=["no-clip", "clip"])
def test_adamw_matches_torch(engine: TrainerEngine, clip: float) -> None:
    """Three steps equal torch.optim.AdamW (+ clip_grad_norm_) on the same gradients."""
    randomize_slot(engine, 0, LoraConfig(rank=4, seed=0), seed=1)
    hp = AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1, grad_clip_norm=clip)
    ref = {name: torch.nn.Parameter(p) for name, p in _params(engine, 0).items()}
    ref_opt = torch.optim.AdamW(
        list(ref.values()),
        lr=hp.learning_rate,
        betas=(hp.beta1, hp.beta2),
        eps=hp.eps,
        weight_decay=hp.weight_decay,
    )
    for step in range(1, 4):
        _train_step(engine, 0, seed=step)
        for tensor in engine.pool.slot_tensors(0):
            grad = tensor.grad()
            assert grad is not None
            ref[tensor.name].grad = grad.clone()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(list(ref.values()), clip if clip else math.inf))
        report = engine.optim_step({0: hp})[0]
        ref_opt.step()
        assert report.applied and report.step == step
        # the same fp32 gradients, reduced in two orders: a sum of squares has no cancellation, so
        # each side is within gamma(n) relative of the exact norm
        entries = sum(p.numel() for p in ref.values())
        assert_within(report.grad_norm, ref_norm, 2 * gamma(entries) * ref_norm, "grad norm")
        got = _params(engine, 0)
        for name, p in ref.items():
            if clip:
                # The clip coefficient carries the norm's rounding into the gradient, and Adam's
                # m / sqrt(v) cancels a common scale of g up to eps: what is left is each step's
                # elementwise rounding (at most 8 operations: decay, moments, bias corrections,
                # sqrt, divide, scale, subtract) of |p| and of the update lr * |m / sqrt(v)|, which
                # is at most lr / sqrt(1 - beta2) when beta1**2 <= beta2.
                update = hp.learning_rate / math.sqrt(1 - hp.beta2)
                bound = step * 8 * U32 * (p.detach().abs() + update)
                assert_within(got[name], p.detach(), bound, name)
            else:
                assert torch.equal(got[name], p.detach()), name
        assert not engine.has_pending_grads(0)
        assert all(float(g.abs().max()) == 0 for g in engine.get_slot_grads(0).values())


def test_step_touches_only_the_requested_slot(engine: TrainerEngine) -> None:
    """Stepping slot 0 leaves slot 1's weights, gradients, moments and step count alone."""
    randomize_slot(engine, 0, LoraConfig(rank=4, seed=0), seed=1)
    randomize_slot(engine, 1, LoraConfig(rank=2, seed=1), seed=2)
    rng = np.random.default_rng(3)
    engine.forward_backward([ce_datum(rng, 0, 5), ce_datum(rng, 1, 6)], "cross_entropy")
    engine.optim_step({1: AdamParams(learning_rate=1e-2)})
    _train_step(engine, 1, seed=4)
    before0, before1 = _params(engine, 0), _params(engine, 1)
    grads1 = engine.get_slot_grads(1)
    state1 = engine.get_slot_state(1)

    engine.optim_step({0: AdamParams(learning_rate=1e-2)})

    after0 = _params(engine, 0)
    assert any(not torch.equal(before0[k], after0[k]) for k in before0)
    after1 = engine.get_slot_state(1)
    assert all(torch.equal(before1[k], after1.adapter[k]) for k in before1)
    assert all(torch.equal(grads1[k], g) for k, g in engine.get_slot_grads(1).items())
    assert all(torch.equal(state1.exp_avg[k], after1.exp_avg[k]) for k in state1.exp_avg)
    assert after1.step == 1 and engine.has_pending_grads(1) and not engine.has_pending_grads(0)


def test_non_finite_gradients_skip_the_step_and_are_discarded(engine: TrainerEngine) -> None:
    """A NaN gradient norm: no update, no step counted, grads zeroed, reported as skipped."""
    randomize_slot(engine, 0, LoraConfig(rank=4, seed=0), seed=1)
    _train_step(engine, 0, seed=1)
    poisoned = engine.pool.slot_tensors(0)[3].grad()
    assert poisoned is not None
    poisoned[0, 0] = float("nan")
    before = _params(engine, 0)
    report = engine.optim_step({0: AdamParams(learning_rate=1e-2)})[0]
    assert not report.applied and report.step == 0
    assert report.reason is not None and "non-finite" in report.reason
    assert math.isnan(report.grad_norm)
    after = _params(engine, 0)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(float(g.abs().max()) == 0 for g in engine.get_slot_grads(0).values())
    assert not engine.has_pending_grads(0)


def test_discard_grads_clears_only_that_slot(engine: TrainerEngine) -> None:
    randomize_slot(engine, 0, LoraConfig(rank=4, seed=0), seed=1)
    randomize_slot(engine, 1, LoraConfig(rank=4, seed=1), seed=2)
    rng = np.random.default_rng(0)
    engine.forward_backward([ce_datum(rng, 0, 5), ce_datum(rng, 1, 5)], "cross_entropy")
    engine.discard_grads(0)
    assert not engine.has_pending_grads(0) and engine.has_pending_grads(1)
    assert all(float(g.abs().max()) == 0 for g in engine.get_slot_grads(0).values())
    assert any(float(g.abs().max()) > 0 for g in engine.get_slot_grads(1).values())


def test_slot_tensors_are_listed_again_when_the_slot_config_changes(engine: TrainerEngine) -> None:
    """The pool hands out the same tensor list while a slot keeps its config; a slot loaded
    with another rank gets a new list cut to that rank, and its next optim_step updates exactly
    those tensors (step 1, every one of them changed, gradients zero afterwards)."""
    randomize_slot(engine, 0, LoraConfig(rank=8, seed=0), seed=1)
    first = engine.pool.slot_tensors(0)
    assert engine.pool.slot_tensors(0) is first
    _train_step(engine, 0, seed=1)
    assert engine.optim_step({0: AdamParams(learning_rate=1e-2)})[0].applied

    randomize_slot(engine, 0, LoraConfig(rank=2, seed=0), seed=2)
    second = engine.pool.slot_tensors(0)
    assert second is not first
    assert all(t.value().shape[-1 if t.name.endswith("lora_B") else -2] == 2 for t in second)
    before = _params(engine, 0)
    _train_step(engine, 0, seed=2)
    report = engine.optim_step({0: AdamParams(learning_rate=1e-2)})[0]
    assert report.applied and report.step == 1
    after = _params(engine, 0)
    assert set(after) == set(before) and all(not torch.equal(before[k], after[k]) for k in before)
    assert all(float(g.abs().max()) == 0 for g in engine.get_slot_grads(0).values())
