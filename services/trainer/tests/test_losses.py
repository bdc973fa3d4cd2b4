"""Every loss, and its LoRA gradients, match an independent plain-torch reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.trainer.engine import DatumInput, TrainerEngine
from services.trainer.lora import SlotConfig
from services.trainer.loss_specs import validate_loss_request
from services.trainer.tests.helpers import (
    ReferenceLoRAModel,
    assert_close_scaled,
    ce_datum,
    random_tokens,
    randomize_slot,
    to_hf_layout,
)


def _ref_loss(
    name: str, lp: torch.Tensor, inp: dict[str, torch.Tensor], cfg: dict[str, float]
) -> torch.Tensor:
    """The loss formulas of the Tinker docs, written out independently of ``losses.py``."""
    if name == "cross_entropy":
        return -(inp["weights"] * lp).sum()
    q, adv = inp["logprobs"], inp["advantages"]
    ratio = (lp - q).exp()
    lo, hi = cfg.get("clip_low_threshold", 0.0), cfg.get("clip_high_threshold", 0.0)
    if name == "importance_sampling":
        return -(ratio * adv).sum()
    if name == "ppo":
        return -torch.min(ratio * adv, torch.clip(ratio, lo, hi) * adv).sum()
    if name == "cispo":
        return -(torch.clip(ratio, lo, hi).detach() * lp * adv).sum()
    if name == "dro":
        return -(lp * adv - 0.5 * cfg["beta"] * (lp - q) ** 2).sum()
    assert name == "gspo"
    keep = inp["sequence_ratio_mask"] != 0
    log_ratio = (lp.detach() - q)[keep].mean() if keep.any() else torch.zeros(())
    token_ratio = torch.exp(log_ratio + lp - lp.detach())
    return -torch.min(token_ratio * adv, torch.clip(token_ratio, lo, hi) * adv).sum()


CASES = [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    ("dro", {"beta": 0.3}),
    ("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
]


def _datums(engine: TrainerEngine, loss_fn: str, rng: np.random.Generator, slot: int) -> list[DatumInput]:
    datums = []
    for n in (6, 11, 3):
        tokens, targets = random_tokens(rng, n)
        datums.append(DatumInput(slot, tokens, {"target_tokens": targets}))
    if loss_fn == "cross_entropy":
        return [ce_datum(rng, slot, n) for n in (6, 11, 3)]
    current = engine.forward_backward(datums, "cross_entropy", forward_only=True)
    out = []
    for d, o in zip(datums, current, strict=True):
        n = d.num_tokens
        inputs = dict(d.loss_inputs)
        # Sampler logprobs near the current ones: ratios spread around 1, some get clipped.
        inputs["logprobs"] = (o.logprobs + rng.normal(scale=0.3, size=n)).astype(np.float32)
        inputs["advantages"] = rng.normal(size=n).astype(np.float32)
        if loss_fn == "gspo":
            inputs["sequence_ratio_mask"] = (rng.random(n) < 0.7).astype(np.float32)
        out.append(DatumInput(slot, d.tokens, inputs))
    return out


@pytest.mark.parametrize(("loss_fn", "cfg"), CASES, ids=[c[0] for c in CASES])
def test_loss_and_grads_match_reference(
    loss_fn: str, cfg: dict[str, float], engine: TrainerEngine, qwen_dir: Path
) -> None:
    """Per-datum logprobs, losses and every LoRA gradient equal the HF + plain-torch reference."""
    config = SlotConfig(rank=4, seed=3)
    state = randomize_slot(engine, 1, config, seed=11)
    rng = np.random.default_rng(5)
    datums = _datums(engine, loss_fn, rng, slot=1)

    # Engine: one packed call.
    outputs = engine.forward_backward(datums, loss_fn, cfg)
    grads = to_hf_layout(engine.get_slot_grads(1), config, engine)

    # Reference: HF model, one datum at a time.
    ref = ReferenceLoRAModel(qwen_dir, to_hf_layout(state.adapter, config, engine), config)
    total = torch.zeros(())
    for datum, out in zip(datums, outputs, strict=True):
        inputs = {
            k: torch.from_numpy(np.asarray(v)) for k, v in datum.loss_inputs.items() if k != "target_tokens"
        }
        lp = ref.logprobs(datum.tokens, np.asarray(datum.loss_inputs["target_tokens"]))
        loss = _ref_loss(loss_fn, lp, inputs, cfg)
        assert_close_scaled(torch.from_numpy(out.logprobs), lp.detach(), 1e-5, "logprobs")
        assert_close_scaled(torch.tensor(out.loss), loss.detach(), 1e-5, "loss")
        total = total + loss
    total.backward()
    expected = ref.grads()
    assert set(grads) == set(expected)
    assert any(float(g.abs().max()) > 0 for g in expected.values())
    for name, want in expected.items():
        assert_close_scaled(grads[name], want, 1e-5, name)


@pytest.mark.parametrize("stacked", [False, True], ids=["per-segment", "stacked"])
def test_two_slot_packed_batch_gives_each_slot_its_own_gradients(engine: TrainerEngine, stacked: bool) -> None:
    """Interleaved datums of two slots in one call == each slot's datums in a call of their own,
    with either multi-slot LoRA strategy (per segment: the CPU default; stacked: the GPU default)."""
    engine.pool.routing.stacked = stacked
    randomize_slot(engine, 0, SlotConfig(rank=8, seed=1), seed=1)
    randomize_slot(engine, 2, SlotConfig(rank=3, seed=2, train_mlp=False), seed=2)
    rng = np.random.default_rng(7)
    datums = [ce_datum(rng, slot, n) for slot, n in ((2, 5), (0, 8), (2, 9), (0, 4))]

    mixed = engine.forward_backward(datums, "cross_entropy")
    mixed_grads = {s: engine.get_slot_grads(s) for s in (0, 2)}
    engine.discard_grads(0)
    engine.discard_grads(2)
    for slot in (0, 2):
        own = [d for d in datums if d.slot == slot]
        alone = engine.forward_backward(own, "cross_entropy")
        for got, want in zip(
            [o for d, o in zip(datums, mixed, strict=True) if d.slot == slot], alone, strict=True
        ):
            # fp32: a mixed batch runs the multi-slot LoRA kernels, a single slot the plain path
            assert_close_scaled(torch.from_numpy(got.logprobs), torch.from_numpy(want.logprobs), 1e-6, "logprobs")
        for name, g in engine.get_slot_grads(slot).items():
            assert_close_scaled(mixed_grads[slot][name], g, 1e-5, name)
        engine.discard_grads(slot)
    engine.pool.routing.stacked = False


@pytest.mark.parametrize(
    ("loss_fn", "cfg", "inputs", "needle"),
    [
        ("ppo", None, {"target_tokens": 4, "logprobs": 4}, "advantages is required"),
        ("cross_entropy", None, {"target_tokens": 4, "weights": 3}, "weights has length 3, expected 4"),
        (
            "cross_entropy",
            None,
            {"target_tokens": 4, "advantages": 4},
            "advantages is not read by cross_entropy",
        ),
        (
            "ppo",
            {"clip_low_threshold": float("nan")},
            {"target_tokens": 4, "logprobs": 4, "advantages": 4},
            "clip_low_threshold must be a finite number",
        ),
        (
            "dro",
            {"clip_low_threshold": 0.5},
            {"target_tokens": 4, "logprobs": 4, "advantages": 4},
            "clip_low_threshold is not read by dro",
        ),
        ("nope", None, {"target_tokens": 4}, "loss_fn 'nope' is not supported"),
    ],
)
def test_validator_names_the_offending_field(
    loss_fn: str, cfg: dict[str, float] | None, inputs: dict[str, int], needle: str
) -> None:
    """The shared validator rejects malformed requests with a message naming the field."""
    error = validate_loss_request(loss_fn, cfg, [4], [inputs])
    assert error is not None and needle in error, error


def test_engine_rejects_invalid_request_without_side_effects(engine: TrainerEngine) -> None:
    """A bad request raises ValueError and leaves no pending gradients behind."""
    engine.init_slot(0, rank=2, seed=0)
    tokens = np.arange(4, dtype=np.int64)
    bad = DatumInput(0, tokens, {"target_tokens": tokens, "logprobs": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match="advantages is required"):
        engine.forward_backward([bad], "importance_sampling")
    with pytest.raises(ValueError, match="slot 3 is not initialised"):
        engine.forward_backward([DatumInput(3, tokens, {"target_tokens": tokens})], "cross_entropy")
    assert not engine.has_pending_grads(0)
