"""The loss surface beyond one target per token: top-K cross-entropy, inputs a loss ignores,
gspo's default ratio mask and the refusal of server-side custom losses."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from libs.contracts.loss_specs import CUSTOM_LOSS_ERROR, validate_loss_request
from services.trainer.engine import DatumInput, LoraConfig, TrainerEngine
from services.trainer.losses import gspo
from services.trainer.tests.helpers import (
    VOCAB,
    ReferenceLoRAModel,
    ce_bounds,
    random_tokens,
    randomize_slot,
    to_hf_layout,
)
from tests.numerics import assert_within, loss_bound

pytestmark = pytest.mark.numerics


def _top_k_datum(rng: np.random.Generator, slot: int, n: int, k: int) -> DatumInput:
    tokens, _ = random_tokens(rng, n)
    targets = rng.integers(0, VOCAB, (n, k)).astype(np.int64)
    weights = rng.normal(size=(n, k)).astype(np.float32)
    return DatumInput(slot, tokens, {"target_tokens": targets, "weights": weights})


def _weighted_terms(weights: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    return -(weights * lp)


def test_top_k_cross_entropy_matches_reference(engine: TrainerEngine, qwen_dir: Path) -> None:
    """(N, K) targets and weights: logprobs [N, K], loss -sum w*lp and every LoRA gradient equal
    the float64 HF reference, which scores the K columns from its own log-softmax."""
    config = LoraConfig(rank=4, seed=3)
    state = randomize_slot(engine, 1, config, seed=13)
    rng = np.random.default_rng(21)
    datums = [_top_k_datum(rng, 1, n, k) for n, k in ((6, 3), (9, 1), (4, 5))]

    outputs = engine.forward_backward(datums, "cross_entropy")
    grads = to_hf_layout(engine.get_slot_grads(1), config, engine)

    ref = ReferenceLoRAModel(qwen_dir, to_hf_layout(state.adapter, config, engine), config)
    total = torch.zeros((), dtype=torch.float64)
    for datum, out in zip(datums, outputs, strict=True):
        targets = np.asarray(datum.loss_inputs["target_tokens"])
        weights = torch.from_numpy(np.asarray(datum.loss_inputs["weights"])).double()
        logp = torch.log_softmax(ref.logits(datum.tokens), dim=-1)  # [N, V]
        lp = logp.gather(-1, torch.from_numpy(targets))  # [N, K]
        bound = torch.stack([ref.logprob_bound(targets[:, k]) for k in range(targets.shape[1])], dim=1)
        assert out.logprobs.shape == targets.shape
        assert_within(out.logprobs, lp.detach(), bound, "logprobs")
        loss = _weighted_terms(weights, lp).sum()
        assert_within(out.loss, loss.detach(), loss_bound(partial(_weighted_terms, weights), lp, bound), "loss")
        total = total + loss
    total.backward()
    expected = ref.grads()
    longest = max(d.num_tokens for d in datums)
    scored = sum(int(np.asarray(d.loss_inputs["target_tokens"]).size) for d in datums)
    bounds = ref.grad_bounds(longest, scored)
    assert any(float(g.abs().max()) > 0 for g in expected.values())
    for name, want in expected.items():
        assert_within(grads[name], want, bounds[name], name)
    engine.discard_grads(1)


def test_top_k_loss_is_the_sum_of_its_one_column_losses(engine: TrainerEngine, qwen_dir: Path) -> None:
    """A K-column datum's logprobs, loss and gradients equal those of the K datums of one column
    each (the fused one-target path): two fp32 computations of the same math, so within twice the
    fp32 bound of one (from the float64 reference)."""
    config = LoraConfig(rank=2, seed=4)
    state = randomize_slot(engine, 2, config, seed=5)
    rng = np.random.default_rng(8)
    datum = _top_k_datum(rng, 2, 7, 4)
    targets, weights = datum.loss_inputs["target_tokens"], datum.loss_inputs["weights"]
    columns = [
        DatumInput(2, datum.tokens, {"target_tokens": targets[:, k].copy(), "weights": weights[:, k].copy()})
        for k in range(4)
    ]
    (joint,) = engine.forward_backward([datum], "cross_entropy")
    joint_grads = engine.get_slot_grads(2)
    engine.discard_grads(2)
    singles = engine.forward_backward(columns, "cross_entropy")
    single_grads = engine.get_slot_grads(2)
    engine.discard_grads(2)
    bounds = ce_bounds(qwen_dir, engine, state, columns)
    for k, (single, bound) in enumerate(zip(singles, bounds.logprobs, strict=True)):
        assert_within(joint.logprobs[:, k], torch.from_numpy(single.logprobs).double(), 2 * bound, "logprobs")
    assert joint.loss == pytest.approx(sum(s.loss for s in singles), rel=1e-5, abs=1e-5)
    joint_hf = to_hf_layout(joint_grads, config, engine)
    for name, g in to_hf_layout(single_grads, config, engine).items():
        assert_within(joint_hf[name], g, 2 * bounds.grads[name], name)


def test_inputs_a_loss_ignores_are_accepted_and_never_read(engine: TrainerEngine) -> None:
    """`weights` beside importance_sampling is accepted and has no effect on loss or logprobs."""
    randomize_slot(engine, 0, LoraConfig(rank=2, seed=1), seed=2)
    rng = np.random.default_rng(3)
    tokens, targets = random_tokens(rng, 6)
    base = {
        "target_tokens": targets,
        "logprobs": rng.normal(size=6).astype(np.float32) - 5,
        "advantages": rng.normal(size=6).astype(np.float32),
    }
    plain = DatumInput(0, tokens, base)
    weighted = DatumInput(0, tokens, {**base, "weights": np.full(6, 7.0, np.float32)})
    a, b = engine.forward_backward([plain, weighted], "importance_sampling", forward_only=True)
    assert a.loss == b.loss
    np.testing.assert_array_equal(a.logprobs, b.logprobs)


def test_gspo_without_a_mask_leaves_prompt_positions_out_of_the_ratio() -> None:
    """Default mask: positions with advantage 0 (the prompt, padded with 0) never enter the
    sequence ratio, so the loss equals the one with the cookbook's explicit mask."""
    lp = torch.tensor([-1.0, -2.0, -0.5, -0.7, -1.1])
    prompt = 2
    q = torch.tensor([0.0, 0.0, -0.4, -0.9, -1.0])  # the prompt's sampler logprobs padded with 0
    adv = torch.tensor([0.0, 0.0, 0.8, 0.8, 0.8])
    cfg = {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
    mask = torch.tensor([0.0] * prompt + [1.0] * 3)
    implicit = gspo(lp, {"logprobs": q, "advantages": adv}, cfg)
    explicit = gspo(lp, {"logprobs": q, "advantages": adv, "sequence_ratio_mask": mask}, cfg)
    assert float(implicit) == float(explicit)
    # The explicit reference: ratio over the completion only.
    ratio = torch.exp((lp[prompt:] - q[prompt:]).mean())
    assert float(implicit) == pytest.approx(float(-(torch.clip(ratio, 0.5, 2.0) * adv).sum()), rel=1e-6)


@pytest.mark.parametrize(
    ("loss_fn", "inputs", "needle"),
    [
        ("cross_entropy", {"target_tokens": (4, 3), "weights": (4,)}, "weights has shape [4], expected [4, 3]"),
        ("cross_entropy", {"target_tokens": (4, 3), "weights": (4, 2)}, "expected [4, 3]"),
        ("cross_entropy", {"target_tokens": (5, 3)}, "has length 5, expected 4"),
        ("ppo", {"target_tokens": (4, 2), "logprobs": 4, "advantages": 4}, "expected [N] for ppo"),
        ("importance_sampling", {"target_tokens": 4, "logprobs": 4, "advantages": 4, "mask": 4}, "mask is not read"),
        ("custom", {"target_tokens": 4}, "forward_backward_custom"),
    ],
)
def test_validator_rules_for_shapes_ignored_keys_and_custom(
    loss_fn: str, inputs: dict[str, int | tuple[int, ...]], needle: str
) -> None:
    """Top-K shapes must match, keys nobody sends stay a 400 naming them, and `custom` says that
    server-side custom losses are not offered."""
    error = validate_loss_request(loss_fn, None, [4], [inputs])
    assert error is not None and needle in error, error
    if loss_fn == "custom":
        assert error == CUSTOM_LOSS_ERROR


@pytest.mark.parametrize(
    ("loss_fn", "inputs"),
    [
        ("cross_entropy", {"target_tokens": (4, 3), "weights": (4, 3)}),
        ("cross_entropy", {"target_tokens": (4, 3)}),
        ("importance_sampling", {"target_tokens": 4, "logprobs": 4, "advantages": 4, "weights": 4}),
        ("gspo", {"target_tokens": 4, "logprobs": 4, "advantages": 4, "weights": 4}),
    ],
)
def test_validator_accepts_top_k_and_ignored_inputs(loss_fn: str, inputs: dict[str, int | tuple[int, ...]]) -> None:
    """Top-K cross-entropy and the documented accepted-and-ignored keys pass validation."""
    assert validate_loss_request(loss_fn, None, [4], [inputs]) is None
