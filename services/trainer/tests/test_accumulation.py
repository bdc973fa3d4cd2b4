"""Gradients are plain sums: K chunked calls accumulate exactly like one call."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.trainer.engine import LoraConfig, TrainerEngine
from services.trainer.tests.helpers import ce_bounds, ce_datum, randomize_slot, to_hf_layout
from tests.numerics import U32, U64, assert_within, gamma

pytestmark = pytest.mark.numerics  # also run under other thread counts and CPU paths (tests/infra)


def test_chunked_calls_accumulate_like_one_call(engine64: TrainerEngine, qwen_dir: Path) -> None:
    """Splitting a batch over 3 forward_backward calls yields the one-call gradients and losses.

    Run in float64 so the comparison measures accumulation, not fp32 GEMM blocking: the two sides
    compute the same terms in float64 (twice the float64 bound, ``tests.numerics`` at u = 2**-53)
    and add them into the adapters' fp32 gradient buffers: one rounding for the one call; three
    roundings of the chunks' contributions and two of the running sum for the chunked calls, each
    at most ``u32 * |terms|``.
    """
    engine = engine64
    states = {
        0: randomize_slot(engine, 0, LoraConfig(rank=4, seed=0), seed=4),
        1: randomize_slot(engine, 1, LoraConfig(rank=2, seed=1), seed=5),
    }
    rng = np.random.default_rng(0)
    datums = [ce_datum(rng, slot, n) for slot, n in ((0, 5), (1, 7), (0, 3), (0, 9), (1, 4), (1, 6))]

    whole = engine.forward_backward(datums, "cross_entropy")
    one_call = {s: engine.get_slot_grads(s) for s in (0, 1)}
    for s in (0, 1):
        engine.discard_grads(s)

    chunked = []
    for chunk in (datums[:2], datums[2:3], datums[3:]):
        chunked += engine.forward_backward(chunk, "cross_entropy")
    lp_bounds: dict[int, torch.Tensor] = {}
    for s in (0, 1):
        own = [i for i, d in enumerate(datums) if d.slot == s]
        bounds = ce_bounds(qwen_dir, engine, states[s], [datums[i] for i in own], U64)
        lp_bounds.update(zip(own, bounds.logprobs, strict=True))
        config = states[s].config
        want = to_hf_layout(one_call[s], config, engine)
        for name, g in to_hf_layout(engine.get_slot_grads(s), config, engine).items():
            fp32_buffer = (1 + 3 + 2) * U32 * bounds.grad_magnitudes[name]
            assert_within(g, want[name], 2 * bounds.grads[name] + fp32_buffer, name)
    for i, (d, a, b) in enumerate(zip(datums, whole, chunked, strict=True)):
        # loss = -sum(w * logprob): the logprobs' bounds carried through |w|, plus the sum's rounding
        w = torch.from_numpy(np.asarray(d.loss_inputs["weights"], np.float64))
        terms = float((w * torch.from_numpy(a.logprobs).double()).abs().sum())
        bound = float((w.abs() * lp_bounds[i]).sum()) + gamma(d.num_tokens, U64) * terms
        assert_within(b.loss, a.loss, 2 * bound, "loss")


def test_forward_only_leaves_gradients_untouched(engine: TrainerEngine) -> None:
    """forward_only returns the same logprobs and losses but neither adds nor clears gradients."""
    randomize_slot(engine, 0, LoraConfig(rank=4, seed=0), seed=4)
    rng = np.random.default_rng(1)
    datums = [ce_datum(rng, 0, n) for n in (4, 6)]
    trained = engine.forward_backward(datums, "cross_entropy")
    before = engine.get_slot_grads(0)
    looked = engine.forward_backward(datums, "cross_entropy", forward_only=True)
    after = engine.get_slot_grads(0)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert engine.has_pending_grads(0)
    for a, b in zip(trained, looked, strict=True):
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        assert a.loss == b.loss
        assert a.logprobs.dtype == np.float32


def test_logprobs_are_target_token_logprobs(engine: TrainerEngine, qwen_dir: Path) -> None:
    """DatumOutput.logprobs[i] is log p(target_tokens[i]) from the full softmax at position i, and
    the cross-entropy loss is -sum(weights * logprobs).

    The engine's loss path and its ``logits`` are two fp32 computations of the same forward (twice
    one fp32 bound, from the float64 reference); the returned logprobs are rounded to float32 once
    more (u |logprob|)."""
    engine.init_slot(0, LoraConfig(rank=2, seed=0))
    state = engine.get_slot_state(0)
    rng = np.random.default_rng(2)
    datum = ce_datum(rng, 0, 7)
    out = engine.forward_backward([datum], "cross_entropy", forward_only=True)[0]
    logits = engine.logits([datum])[0]  # [N, V]
    expected = torch.log_softmax(logits, -1).gather(
        -1, torch.from_numpy(datum.loss_inputs["target_tokens"])[:, None]
    )[:, 0]
    (lp_bound,) = ce_bounds(qwen_dir, engine, state, [datum]).logprobs
    lp = torch.from_numpy(out.logprobs).double()
    assert_within(lp, expected, 2 * lp_bound + U32 * lp.abs(), "logprobs")
    w = torch.from_numpy(np.asarray(datum.loss_inputs["weights"], np.float64))
    terms = (w * lp).abs()
    # the engine summed its unrounded logprobs: their float32 rounding, then the sum's
    bound = float((w.abs() * U32 * lp.abs()).sum()) + gamma(len(lp)) * float(terms.sum())
    assert_within(out.loss, -(w * lp).sum(), bound, "loss")
