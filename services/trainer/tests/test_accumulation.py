"""Gradients are plain sums: K chunked calls accumulate exactly like one call."""

from __future__ import annotations

import numpy as np
import torch

from services.trainer.engine import TrainerEngine
from services.trainer.lora import SlotConfig
from services.trainer.tests.helpers import assert_close_scaled, ce_datum, randomize_slot


def test_chunked_calls_accumulate_like_one_call(engine64: TrainerEngine) -> None:
    """Splitting a batch over 3 forward_backward calls yields the one-call gradients.

    Run in float64 so the comparison measures accumulation, not fp32 GEMM blocking noise
    (in fp32 the two differ by ~1e-6 relative because T changes the matmul shapes).
    """
    engine = engine64
    randomize_slot(engine, 0, SlotConfig(rank=4, seed=0), seed=4)
    randomize_slot(engine, 1, SlotConfig(rank=2, seed=1), seed=5)
    rng = np.random.default_rng(0)
    datums = [ce_datum(rng, slot, n) for slot, n in ((0, 5), (1, 7), (0, 3), (0, 9), (1, 4), (1, 6))]

    whole = engine.forward_backward(datums, "cross_entropy")
    one_call = {s: engine.get_slot_grads(s) for s in (0, 1)}
    for s in (0, 1):
        engine.discard_grads(s)

    chunked = []
    for chunk in (datums[:2], datums[2:3], datums[3:]):
        chunked += engine.forward_backward(chunk, "cross_entropy")
    for s in (0, 1):
        for name, g in engine.get_slot_grads(s).items():
            assert_close_scaled(g, one_call[s][name], 1e-6, name)
    for a, b in zip(whole, chunked, strict=True):
        np.testing.assert_allclose(a.loss, b.loss, rtol=1e-6)


def test_forward_only_leaves_gradients_untouched(engine: TrainerEngine) -> None:
    """forward_only returns the same logprobs and losses but neither adds nor clears gradients."""
    randomize_slot(engine, 0, SlotConfig(rank=4, seed=0), seed=4)
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


def test_logprobs_are_target_token_logprobs(engine: TrainerEngine) -> None:
    """DatumOutput.logprobs[i] is log p(target_tokens[i]) from the full softmax at position i."""
    engine.init_slot(0, rank=2, seed=0)
    rng = np.random.default_rng(2)
    datum = ce_datum(rng, 0, 7)
    out = engine.forward_backward([datum], "cross_entropy", forward_only=True)[0]
    logits = engine.logits([datum])[0]  # [N, V]
    expected = torch.log_softmax(logits, -1).gather(
        -1, torch.from_numpy(datum.loss_inputs["target_tokens"])[:, None]
    )[:, 0]
    assert_close_scaled(torch.from_numpy(out.logprobs), expected, 1e-6)
    weights = datum.loss_inputs["weights"]
    np.testing.assert_allclose(out.loss, -(weights * out.logprobs).sum(), rtol=1e-5)
