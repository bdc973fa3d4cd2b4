"""The chunked fused linear cross-entropy (fused_ce.py) computes what the unfused path computes.

CPU, fp32: the fused path's logprobs and every LoRA gradient (lm_head included) agree
with megatron's output layer + vocab-parallel cross-entropy within twice one fp32 bound
(``tests.numerics``, via ``ce_bounds``), for co-packed slots with and without an lm_head adapter,
pieces cut inside segments, and every loss (test_losses.py runs the reference comparison with the
fused path too). CUDA, bf16: against an fp32 run of the same math, within a stated tolerance.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from libs.contracts.loss_specs import LOSS_SPECS
from services.trainer.engine import (
    UNFUSED_LOGITS_BYTES,
    DatumInput,
    EngineConfig,
    LoraConfig,
    TrainerEngine,
    resolve_fused_ce,
)
from services.trainer.fused_ce import Piece, chunk_tokens, fused_target_logprobs, pieces
from services.trainer.parallel import ensure_model_parallel
from services.trainer.tests.helpers import ce_bounds, ce_datum, random_tokens, randomize_slot, to_hf_layout
from tests.numerics import assert_within


@pytest.fixture
def fused(engine: TrainerEngine) -> Iterator[TrainerEngine]:
    """The tiny engine with the fused path forced on, and small pieces (7 tokens) so segments
    are cut into several; restored after the test."""
    engine.fused_ce, engine.fused_ce_chunk = True, 7
    try:
        yield engine
    finally:
        engine.fused_ce, engine.fused_ce_chunk = engine.config.fused_cross_entropy, None


def test_default_path_is_unfused_on_a_cpu_and_chosen_by_size_on_cuda() -> None:
    """``fused_cross_entropy=None`` (the default): a CPU never takes the fused loss; CUDA takes it
    only for a forward whose fp32 logits would pass ``UNFUSED_LOGITS_BYTES`` (14,134 tokens at a
    151,936-entry vocabulary, twice that with the vocabulary split over two TP ranks); True or
    False wins on either device."""
    assert EngineConfig("x").fused_cross_entropy is None
    vocab = 151_936
    limit = UNFUSED_LOGITS_BYTES // (4 * vocab)
    assert limit == 14_134
    assert resolve_fused_ce(None, "cuda", limit, vocab) is False
    assert resolve_fused_ce(None, "cuda", limit + 1, vocab) is True
    assert resolve_fused_ce(None, "cuda", 2 * limit, vocab // 2) is False
    assert resolve_fused_ce(None, "cpu", 10 * limit, vocab) is False
    assert resolve_fused_ce(True, "cpu", 1, vocab) is True
    assert resolve_fused_ce(False, "cuda", 10 * limit, vocab) is False


def test_pieces_stay_inside_segments_and_cover_them() -> None:
    """Pieces never cross a segment boundary, are at most ``chunk`` long, cover every token once."""
    plan = pieces([(0, 10, 0), (10, 13, -1), (13, 30, 1)], chunk=4)
    assert plan[:3] == [Piece(0, 4, 0, 0), Piece(4, 8, 0, 0), Piece(8, 10, 0, 0)]
    assert plan[3] == Piece(10, 13, -1, 10)
    covered = [t for p in plan for t in range(p.start, p.end)]
    assert covered == list(range(30))
    assert all(p.end - p.start <= 4 for p in plan)
    assert chunk_tokens(151_936) == 1536 and chunk_tokens(2048) == 8192 and chunk_tokens(10**9) == 256


def _slots(engine: TrainerEngine) -> dict[int, object]:
    return {
        0: randomize_slot(engine, 0, LoraConfig(rank=8, seed=1), seed=1),  # lm_head LoRA
        1: randomize_slot(engine, 1, LoraConfig(rank=4, seed=2, train_unembed=False), seed=2),
        3: randomize_slot(engine, 3, LoraConfig(rank=2, seed=3, train_mlp=False), seed=3),
    }


@pytest.mark.numerics  # fp32 bounds from tests.numerics: re-run under other CPU code paths
def test_fused_matches_unfused_for_co_packed_slots(engine: TrainerEngine, qwen_dir: Path) -> None:
    """Three co-packed slots (two with an lm_head adapter, one without), pieces of 7 tokens:
    logprobs and every gradient of every slot agree with the unfused path within twice one fp32
    bound. (The stacked multi-slot strategy runs fused in test_isolation.py.)"""
    states = _slots(engine)
    rng = np.random.default_rng(3)
    datums = [ce_datum(rng, s, n) for s, n in ((1, 9), (0, 12), (3, 5), (1, 4), (0, 16), (3, 8))]
    try:
        runs = {}
        for on in (False, True):
            engine.fused_ce, engine.fused_ce_chunk = on, 7
            outputs = engine.forward_backward(datums, "cross_entropy")
            runs[on] = (outputs, {s: engine.get_slot_grads(s) for s in states})
            for s in states:
                engine.discard_grads(s)
    finally:
        engine.fused_ce, engine.fused_ce_chunk = engine.config.fused_cross_entropy, None
    for slot, state in states.items():
        own = [i for i, d in enumerate(datums) if d.slot == slot]
        bounds = ce_bounds(qwen_dir, engine, state, [datums[i] for i in own])  # type: ignore[arg-type]
        for i, bound in zip(own, bounds.logprobs, strict=True):
            assert_within(runs[True][0][i].logprobs, runs[False][0][i].logprobs, 2 * bound, "logprobs")
        config = state.config  # type: ignore[attr-defined]
        got = to_hf_layout(runs[True][1][slot], config, engine)
        want = to_hf_layout(runs[False][1][slot], config, engine)
        assert set(got) == set(want)
        assert any("lm_head" in k for k in got) == config.train_unembed
        for name, g in want.items():
            assert float(g.abs().max()) > 0, name
            assert_within(got[name], g, 2 * bounds.grads[name], name)


@pytest.mark.parametrize("loss_fn", sorted(LOSS_SPECS))
def test_every_loss_fused_matches_unfused(engine: TrainerEngine, loss_fn: str) -> None:
    """Every loss over two co-packed slots: the fused path's logprobs, losses and gradients equal
    the unfused path's within fp32 rounding (relative 1e-4 of each tensor's largest entry: the
    loss-specific bounds against an independent reference are test_losses.py's, run fused too)."""
    states = _slots(engine)
    rng = np.random.default_rng(9)
    datums = []
    for slot, n in ((0, 7), (3, 10), (0, 5), (1, 6)):
        tokens, targets = random_tokens(rng, n)
        inputs = {"target_tokens": targets}
        if loss_fn == "cross_entropy":
            inputs["weights"] = rng.normal(size=n).astype(np.float32)
        else:
            inputs["logprobs"] = (rng.normal(scale=0.3, size=n) - 7.6).astype(np.float32)  # ~ log(1/2048)
            inputs["advantages"] = rng.normal(size=n).astype(np.float32)
        if loss_fn == "stable_reinforce":  # what the gateway resolves: a prompt of 2, then one sequence
            inputs["sampler_logprobs"] = inputs.pop("logprobs")
            inputs["sampled_sequence"] = np.where(np.arange(n) < 2, -1.0, 0.0).astype(np.float32)
            inputs["advantages"][:2] = 0.0
        datums.append(DatumInput(slot, tokens, inputs))
    try:
        runs = {}
        for on in (False, True):
            engine.fused_ce, engine.fused_ce_chunk = on, 4
            outputs = engine.forward_backward(datums, loss_fn)
            runs[on] = (outputs, {s: engine.get_slot_grads(s) for s in states})
            for s in states:
                engine.discard_grads(s)
    finally:
        engine.fused_ce, engine.fused_ce_chunk = engine.config.fused_cross_entropy, None
    for a, b in zip(runs[True][0], runs[False][0], strict=True):
        assert_within(a.logprobs, b.logprobs, 1e-5 * max(1.0, float(np.abs(b.logprobs).max())), "logprobs")
        assert_within(a.loss, b.loss, 1e-5 * max(1.0, abs(b.loss)), "loss")
    for slot in states:
        for name, want in runs[False][1][slot].items():
            assert_within(runs[True][1][slot][name], want, 1e-4 * float(want.abs().max()) + 1e-30, name)


def test_forward_only_matches_forward_backward(fused: TrainerEngine) -> None:
    """``forward_only`` runs the same fused forward: the same logprobs, bit for bit."""
    _slots(fused)
    rng = np.random.default_rng(4)
    datums = [ce_datum(rng, s, n) for s, n in ((0, 9), (1, 5), (3, 11))]
    a = fused.forward_backward(datums, "cross_entropy", forward_only=True)
    b = fused.forward_backward(datums, "cross_entropy")
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.logprobs, y.logprobs)


def _reference_logprobs(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    segments: list[tuple[int, int, int]],
    us: list[torch.Tensor],
    bs: list[torch.Tensor],
) -> torch.Tensor:
    """Plain full-logits log-softmax (one segment at a time), in the inputs' dtype."""
    out = []
    for start, end, j in segments:
        logits = h[start:end] @ weight.t()
        if j >= 0:
            logits = logits + us[j] @ bs[j].t()
        out.append(torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[start:end, None])[:, 0])
    return torch.cat(out)


def _inputs(device: str, dtype: torch.dtype, vocab: int, hidden: int, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    segments = [(0, 700, 0), (700, 1100, -1), (1100, 2300, 1)]
    total = segments[-1][1]
    h = torch.randn(total, hidden, generator=gen)
    weight = torch.randn(vocab, hidden, generator=gen) * hidden**-0.5 * 2
    targets = torch.randint(0, vocab, (total,), generator=gen)
    us = [torch.randn(700, 8, generator=gen), torch.randn(1200, 16, generator=gen)]
    bs = [torch.randn(vocab, 8, generator=gen) * 0.05, torch.randn(vocab, 16, generator=gen) * 0.05]
    grad = torch.randn(total, generator=gen)
    move = lambda t: t.to(device, dtype).requires_grad_()  # noqa: E731
    return (
        move(h),
        weight.to(device, dtype),
        targets.to(device),
        segments,
        [move(u) for u in us],
        [move(b) for b in bs],
        grad.to(device),
    )


def test_function_matches_full_logits_on_cpu() -> None:
    """The autograd function alone, fp32 on CPU with pieces of 256 tokens: logprobs and the
    gradients of h, u and B equal a full-logits log-softmax's within 1e-5 relative."""
    ensure_model_parallel("cpu")  # a one-rank TP group
    h, w, y, segs, us, bs, g = _inputs("cpu", torch.float32, 1000, 64, seed=0)
    lp = fused_target_logprobs(h, w, y, segs, us, bs, chunk=256)
    lp.backward(g)
    got = [h.grad, *[u.grad for u in us], *[b.grad for b in bs]]
    for t in (h, *us, *bs):
        t.grad = None
    ref = _reference_logprobs(h, w, y, segs, us, bs)
    ref.backward(g)
    assert_within(lp.detach(), ref.detach(), 1e-5 * float(ref.abs().max()), "lp")
    for name, a, t in zip(["h", "u0", "u1", "b0", "b1"], got, [h, *us, *bs], strict=True):
        assert a is not None and t.grad is not None
        assert_within(a, t.grad, 1e-5 * float(t.grad.abs().max()), name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_fused_matches_fp32_reference() -> None:
    """bf16 on CUDA at Qwen3's vocabulary (151,936) and hidden size 4096, 2300 tokens in three
    segments (two with an lm_head LoRA), default pieces, against fp32 full logits on the same
    (bf16-rounded) inputs. The fused logits are rounded to bf16 once (relative 2^-9); with logits
    of std 2, |logit| < 16 over all 3.5e8 of them, so a logprob (target logit minus log-sum-exp)
    is off by at most 2 * 2^-9 * 16 = 0.0625: bound 0.07. Gradients (bf16 d logits, fp32
    accumulation): within 2 % of each tensor's largest entry."""
    ensure_model_parallel("cuda")
    h, w, y, segs, us, bs, g = _inputs("cuda", torch.bfloat16, 151_936, 4096, seed=1)
    lp = fused_target_logprobs(h, w, y, segs, us, bs)
    lp.backward(g)
    got = [h.grad, *[u.grad for u in us], *[b.grad for b in bs]]
    ref_in = [t.detach().float().requires_grad_() for t in (h, *us, *bs)]
    rh, rus, rbs = ref_in[0], ref_in[1:3], ref_in[3:5]
    ref = _reference_logprobs(rh, w.float(), y, segs, list(rus), list(rbs))
    ref.backward(g)
    assert lp.dtype == torch.float32
    assert_within(lp.detach().cpu(), ref.detach().cpu(), 0.07, "lp")
    for name, a, t in zip(["h", "u0", "u1", "b0", "b1"], got, ref_in, strict=True):
        assert a is not None and t.grad is not None
        assert_within(a.float().cpu(), t.grad.cpu(), 0.02 * float(t.grad.abs().max()), name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_fused_matches_unfused(qwen_dir: Path) -> None:
    """A bf16 CUDA engine (tiny-qwen3, three co-packed slots, two with an lm_head adapter): its
    default chooses the loss path per forward (``fused_ce`` unset), and the fused path's logprobs
    and gradients agree with the unfused path of the
    same engine (the decoder's forward is the same; only the loss differs, each rounding bf16
    logits once): logprobs within 0.02 + 1 % absolute, every gradient within 3 % of its tensor's
    largest entry, all finite."""
    engine = TrainerEngine(
        EngineConfig(
            str(qwen_dir), num_slots=4, max_lora_rank=8, device="cuda", attention_backend="sdpa_per_document"
        )
    )
    assert engine.fused_ce is None
    states = _slots(engine)
    rng = np.random.default_rng(3)
    datums = [ce_datum(rng, s, n) for s, n in ((1, 90), (0, 120), (3, 50), (1, 40), (0, 160), (3, 80))]
    runs = {}
    for on in (True, False):
        engine.fused_ce, engine.fused_ce_chunk = on, 64 if on else None
        outputs = engine.forward_backward(datums, "cross_entropy")
        runs[on] = (outputs, {s: engine.get_slot_grads(s) for s in states})
        for s in states:
            engine.discard_grads(s)
    for a, b in zip(runs[True][0], runs[False][0], strict=True):
        assert_within(a.logprobs, b.logprobs, 0.02 + 0.01 * np.abs(b.logprobs), "logprobs")
    for slot in states:
        assert any("output_layer" in k for k in runs[True][1][slot]) == (slot != 1)
        for name, want in runs[False][1][slot].items():
            got = runs[True][1][slot][name].float().cpu()
            want = want.float().cpu()
            assert float(want.abs().max()) > 0, name
            assert_within(got, want, 0.03 * float(want.abs().max()), f"slot {slot} {name}")
