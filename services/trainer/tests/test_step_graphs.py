"""Steps at static shapes (``step_graphs.py``) against the engine's plain path.

On the CPU the static step runs eagerly: the padding, the empty documents, the slot named by a
device tensor and the loss's gradient entering at the log-probabilities are all exercised, against
an engine without static steps (the reference: the same model and adapters, unpadded), for one
slot and for several (the grouped matmuls with the slots' device tensors). On CUDA
(``-k cuda``) the recorded graphs' replays are compared with the same static step run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from torch.utils._python_dispatch import TorchDispatchMode

from libs.contracts.common import LoraConfig
from services.trainer.attention import (
    CUDNN_MIN_TOKENS,
    PerDocumentSdpa,
    _FusedPackedAttention,
    document_ids,
    one_long_document,
)
from services.trainer.engine import (
    LARGE_CARD_BYTES,
    AdamParams,
    DatumInput,
    EngineConfig,
    TrainerEngine,
    step_graph_tokens_for,
)
from services.trainer.step_graphs import StepShape
from services.trainer.tests.helpers import ce_datum, randomize_slot, record_causal_sdpa

X = LoraConfig(rank=4, seed=3)
Z = LoraConfig(rank=8, seed=4)
ALL = (True, True, True)
HP = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)


def is_datum(rng: np.random.Generator, slot: int, n: int) -> DatumInput:
    """An importance-sampling datum (sampling log-probabilities and advantages)."""
    tokens = rng.integers(4, 500, size=n)
    targets = rng.integers(4, 500, size=n)
    return DatumInput(
        slot,
        tokens,
        {
            "target_tokens": targets,
            "logprobs": rng.normal(-3.0, 0.5, size=n).astype(np.float32),
            "advantages": rng.normal(size=n).astype(np.float32),
        },
    )


def _engine(qwen_dir: Path, static: bool, device: str = "cpu") -> TrainerEngine:
    return TrainerEngine(
        EngineConfig(str(qwen_dir), num_slots=4, max_lora_rank=8, device=device, step_graphs=static)
    )


@pytest.fixture(scope="module")
def pair(qwen_dir: Path) -> Iterator[tuple[TrainerEngine, TrainerEngine]]:
    """A plain engine and one with static steps (their adapters: ``_reset``)."""
    plain, static = _engine(qwen_dir, False), _engine(qwen_dir, True)
    assert static.step_graphs is not None and plain.step_graphs is None
    yield plain, static


def _reset(pair: tuple[TrainerEngine, TrainerEngine]) -> None:
    """The same random adapters in both engines, fresh moments, no gradients: rank 4 in slots 0
    and 1, rank 8 in slots 2 and 3. Each comparison starts here: two engines that took different
    roundings once drift apart under AdamW (which turns a gradient's sign into a step of the
    learning rate), so every test compares from equal states."""
    for engine in pair:
        for slot in range(4):
            randomize_slot(engine, slot, X if slot < 2 else Z, seed=10 + slot)


class EagerRecorder:
    """Stands in for CUDA graphs on the CPU: recording runs nothing, and a replay runs the recorded
    forward (into the one static output) or the backward of the last replayed forward again.
    What it exercises is ``StepGraphs``' own part: which static inputs a recording keeps, the
    gradient handed to the backward replay, and the slots' gradients restored after recording."""

    def __init__(self) -> None:
        self.recorded = 0

    def record(
        self, forward: Callable[[], torch.Tensor], grad: torch.Tensor
    ) -> tuple[torch.Tensor, Callable[[], None], Callable[[], None]]:
        self.recorded += 1
        out = torch.full_like(grad, float("nan"))  # like a capture's output before its first replay
        last: list[torch.Tensor] = []

        def replay_forward() -> None:
            with torch.enable_grad():
                last[:] = [forward()]
            out.copy_(last[0].detach())

        def replay_backward() -> None:
            last[0].backward(grad)

        return out, replay_forward, replay_backward


def _grads(engine: TrainerEngine, slot: int) -> dict[str, torch.Tensor]:
    return engine.get_slot_grads(slot)


def _assert_near(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str) -> None:
    """Every tensor within 1e-5 of its own largest entry: fp32 sums in another order (the padded
    stream's GEMMs), not a relative bound per element, which rounding breaks near zero."""
    assert got.keys() == want.keys()
    for name, value in want.items():
        bound = 1e-5 * max(1.0, float(value.abs().max()))
        assert float((got[name] - value).abs().max()) <= bound, (label, name)


def test_step_shapes_round_tokens_documents_and_the_longest_document_up() -> None:
    assert StepShape.of([5, 9, 3], [X]) == StepShape(256, 4, 256, 1, 4, ALL)
    assert StepShape.of([256], [X]) == StepShape(256, 2, 256, 1, 4, ALL, one_document=True)  # no padding
    assert not StepShape.of([200], [X]).one_document and not StepShape.of([128, 128], [X]).one_document
    assert StepShape.of([300, 100, 100], [X]) == StepShape(512, 4, 512, 1, 4, ALL)
    assert StepShape.of([700] * 2 + [40] * 5, [X]).docs == 8
    assert StepShape.of([1000, 1000, 1000, 50], [X]) == StepShape(3072, 8, 1024, 1, 4, ALL)
    assert StepShape.of([10, 10, 10], [X, Z, X]) == StepShape(256, 4, 256, 3, 8, ALL)  # the largest rank


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling"])
def test_a_static_step_gives_the_plain_steps_results_within_rounding_and_touches_only_its_slot(
    pair: tuple[TrainerEngine, TrainerEngine], loss_fn: str
) -> None:
    """Three documents of slot 1, padded to 256 tokens and 4 documents: log-probabilities, losses
    and slot 1's gradients equal the plain engine's within fp32 rounding (GEMMs of another shape,
    the log-softmax in another order), while slot 0's pending gradients and slots 2 and 3 stay
    bit-identical. (The adapters after an AdamW step are not compared: a gradient entry within
    rounding of zero moves its weight by up to the learning rate either way.)"""
    _reset(pair)
    plain, static = pair
    rng = np.random.default_rng(5)
    make = ce_datum if loss_fn == "cross_entropy" else is_datum
    earlier = [make(rng, 0, 6)]  # slot 0 has pending gradients of its own
    batch = [make(rng, 1, n) for n in (5, 9, 3)]
    results = {}
    for name, engine in (("plain", plain), ("static", static)):
        engine.forward_backward(earlier, loss_fn)
        before = {slot: _grads(engine, slot) for slot in (0, 2, 3)}
        steps = static.step_graphs.steps if static.step_graphs is not None else 0
        outs = engine.forward_backward(batch, loss_fn)
        if engine is static:
            assert static.step_graphs is not None and static.step_graphs.steps == steps + 1
        for slot, grads in before.items():
            after = _grads(engine, slot)
            assert all(torch.equal(after[k], v) for k, v in grads.items()), (name, slot)
        results[name] = (outs, _grads(engine, 1))
        engine.optim_step({0: HP, 1: HP})
    (p_outs, p_grads), (s_outs, s_grads) = results["plain"], results["static"]
    for p, s in zip(p_outs, s_outs, strict=True):
        np.testing.assert_allclose(s.logprobs, p.logprobs, rtol=1e-5, atol=1e-5)
        assert s.loss == pytest.approx(p.loss, rel=1e-5, abs=1e-5)
    _assert_near(s_grads, p_grads, "gradients")


def test_static_steps_pass_an_exact_max_seqlen_only_for_one_unpadded_document(
    pair: tuple[TrainerEngine, TrainerEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A static step's max_seqlen is its rounded L_b, which can equal the stream's length while
    the stream holds several documents or padding: inside such a forward no stream may be taken
    for one long document (``varlen_flash_cudnn``'s dense path). A static step of one document
    of exactly T_b tokens has L_b equal to that document's length, and may be, as in a plain
    step's forward."""
    _reset(pair)
    seen: dict[str, set[bool]] = {}
    label = [""]
    attend = PerDocumentSdpa._attend

    def spy(self: PerDocumentSdpa, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        seen.setdefault(label[0], set()).add(one_long_document(CUDNN_MIN_TOKENS, CUDNN_MIN_TOKENS))
        return attend(self, q, k, v, bounds)

    monkeypatch.setattr(PerDocumentSdpa, "_attend", spy)
    rng = np.random.default_rng(9)
    batches = {"two documents": (7, 4), "one padded": (200,), "one unpadded": (256,)}
    for name, engine in zip(("plain", "static"), pair, strict=True):
        for batch_name, lengths in batches.items():
            label[0] = f"{name}, {batch_name}"
            engine.forward_backward([ce_datum(rng, 1, n) for n in lengths], "cross_entropy")
            engine.discard_grads(1)
    assert seen == {
        **{f"plain, {b}": {True} for b in batches},
        "static, two documents": {False},
        "static, one padded": {False},
        "static, one unpadded": {True},
    }


def test_static_steps_repeat_exactly_and_forward_only_gives_the_logprobs_of_forward_backward(
    pair: tuple[TrainerEngine, TrainerEngine],
) -> None:
    """The same static batch twice accumulates the same gradient twice (bit for bit: the second
    call's gradient is the first's doubled), and ``forward`` of it returns exactly the
    log-probabilities ``forward_backward`` did; slot 2 and slot 3 share one shape."""
    _reset(pair)
    _, static = pair
    rng = np.random.default_rng(9)
    batch = [ce_datum(rng, 2, n) for n in (40, 7)]
    first = static.forward_backward(batch, "cross_entropy")
    once = _grads(static, 2)
    again = static.forward_backward(batch, "cross_entropy")
    twice = _grads(static, 2)
    only = static.forward_backward(batch, "cross_entropy", forward_only=True)
    for a, b, c in zip(first, again, only, strict=True):
        assert np.array_equal(a.logprobs, b.logprobs) and np.array_equal(a.logprobs, c.logprobs)
    assert all(torch.equal(twice[k], v + v) for k, v in once.items())
    lengths = [d.num_tokens for d in batch]
    assert StepShape.of(lengths, [static.pool.configs[3]]) == StepShape.of(lengths, [static.pool.configs[2]])


@pytest.mark.parametrize("stacked", [False, True], ids=["per-segment", "grouped"])
def test_a_static_step_of_several_slots_gives_the_plain_steps_results_within_rounding(
    pair: tuple[TrainerEngine, TrainerEngine], stacked: bool
) -> None:
    """Five documents of slots 2, 0 and 1 (ranks 8, 4, 4) in the request's own order, as one static
    step: the grouped matmuls over its three segments, each slot named by a device tensor. Each
    datum's log-probabilities and loss come back in request order and equal the plain engine's
    (per segment or grouped) within fp32 rounding, as do the three slots' gradients; slot 3 stays
    bit-identical."""
    _reset(pair)
    plain, static = pair
    plain.pool.routing.stacked = stacked
    rng = np.random.default_rng(11)
    batch = [ce_datum(rng, slot, n) for slot, n in ((2, 7), (0, 12), (1, 3), (2, 20), (0, 5))]
    results = {}
    try:
        for name, engine in (("plain", plain), ("static", static)):
            untouched = _grads(engine, 3)
            outs = engine.forward_backward(batch, "cross_entropy")
            assert all(torch.equal(_grads(engine, 3)[k], v) for k, v in untouched.items()), name
            results[name] = (outs, {slot: _grads(engine, slot) for slot in (0, 1, 2)})
            for slot in range(4):
                engine.discard_grads(slot)
    finally:
        plain.pool.routing.stacked = False
    (p_outs, p_grads), (s_outs, s_grads) = results["plain"], results["static"]
    for p, s, datum in zip(p_outs, s_outs, batch, strict=True):
        assert s.logprobs.shape == (datum.num_tokens,)
        np.testing.assert_allclose(s.logprobs, p.logprobs, rtol=1e-5, atol=1e-5)
        assert s.loss == pytest.approx(p.loss, rel=1e-5, abs=1e-5)
    for slot, grads in p_grads.items():
        _assert_near(s_grads[slot], grads, f"slot {slot}")


def test_batches_of_mixed_modules_or_past_the_token_limit_take_the_plain_path(
    pair: tuple[TrainerEngine, TrainerEngine],
) -> None:
    """Slots that train different modules, top-K targets, or more padded tokens than
    ``step_graph_max_tokens`` are not static steps; one or several slots within the limit are."""
    _reset(pair)
    _, static = pair
    rng = np.random.default_rng(2)
    assert static._graphed([ce_datum(rng, 0, 10)], top_k=False)
    assert static._graphed([ce_datum(rng, 0, 10), ce_datum(rng, 2, 10)], top_k=False)
    assert not static._graphed([ce_datum(rng, 0, 10)], top_k=True)
    limit = static.step_graph_max_tokens
    assert not static._graphed([ce_datum(rng, 0, limit + 1)], top_k=False)
    static.init_slot(3, LoraConfig(rank=4, seed=1, train_mlp=False))
    assert not static._graphed([ce_datum(rng, 0, 10), ce_datum(rng, 3, 10)], top_k=False)
    assert static._graphed([ce_datum(rng, 3, 10)], top_k=False)


def test_the_default_step_limit_is_4096_tokens_on_a_card_of_120_gib_and_2048_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The card's total memory picks the default limit (the cards faked: pure logic)."""
    totals = {0: LARGE_CARD_BYTES + (20 << 30), 1: 80 << 30, 2: LARGE_CARD_BYTES}  # an H200, an H100, the bound
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=totals[d.index]))
    assert step_graph_tokens_for(torch.device("cuda", 0)) == 4096
    assert step_graph_tokens_for(torch.device("cuda", 1)) == 2048
    assert step_graph_tokens_for(torch.device("cuda", 2)) == 4096
    assert step_graph_tokens_for(torch.device("cpu")) == 2048


def _batch(rng: np.random.Generator, *docs: tuple[int, int]) -> list[DatumInput]:
    """Cross-entropy datums of (slot, tokens)."""
    return [ce_datum(rng, slot, n) for slot, n in docs]


def _assert_steps_alike(first: TrainerEngine, second: TrainerEngine, calls: list[list[DatumInput]]) -> None:
    """Each call's ``forward_backward`` then an optimizer step of its slots on both engines: the
    log-probabilities, losses, gradients and adapters after the step are bit-identical."""
    for i, call in enumerate(calls):
        outs = [engine.forward_backward(call, "cross_entropy") for engine in (first, second)]
        for a, b in zip(*outs, strict=True):
            assert np.array_equal(a.logprobs, b.logprobs) and a.loss == b.loss, i
        slots = sorted({d.slot for d in call})
        for slot in slots:
            got, want = _grads(first, slot), _grads(second, slot)
            assert all(torch.equal(got[k], want[k]) for k in want), (i, slot)
        for engine in (first, second):
            engine.optim_step(dict.fromkeys(slots, HP))
        for slot in slots:
            got, want = first.get_slot_state(slot).adapter, second.get_slot_state(slot).adapter
            assert all(torch.equal(got[k], want[k]) for k in want), (i, slot)


def test_replays_of_a_recording_give_the_static_steps_results_bit_for_bit(qwen_dir: Path) -> None:
    """With a recorder (``EagerRecorder`` on the CPU), steps of one shape replay its recording: two
    steps of slot 1 and one of slot 0 (one recording serves both slots), then two of slots 0 and 2
    together (a second recording), each forward and backward a replay. Log-probabilities, losses,
    gradients and adapters after optimizer steps equal an engine running the same static steps
    without recordings, bit for bit; a forward-only call replays too."""
    replayed, eager = _engine(qwen_dir, True), _engine(qwen_dir, True)
    assert replayed.step_graphs is not None and eager.step_graphs is not None
    recorder = EagerRecorder()
    replayed.step_graphs.recorder = recorder
    _reset((replayed, eager))
    rng = np.random.default_rng(4)
    calls = [_batch(rng, (1, 30), (1, 200)), _batch(rng, (1, 100), (1, 17)), _batch(rng, (0, 150), (0, 60))]
    calls += [_batch(rng, (2, 50), (0, 90)), _batch(rng, (0, 60), (2, 80))]
    _assert_steps_alike(replayed, eager, calls)
    only = [engine.forward_backward(calls[0], "cross_entropy", forward_only=True) for engine in (replayed, eager)]
    assert all(np.array_equal(a.logprobs, b.logprobs) for a, b in zip(*only, strict=True))
    assert recorder.recorded == 2 and replayed.step_graphs.replays == 6


class FailingRecorder:
    """A recorder whose recording fails after running the warm-up's forward and backward as an
    aborted CUDA capture does: the capture's end fails while the first error is being raised."""

    def __init__(self) -> None:
        self.tries = 0

    def record(
        self, forward: Callable[[], torch.Tensor], grad: torch.Tensor
    ) -> tuple[torch.Tensor, Callable[[], None], Callable[[], None]]:
        self.tries += 1
        with torch.enable_grad():
            forward().backward(grad)
        try:
            raise RuntimeError("dependency created on uncaptured work in another stream")
        finally:
            raise RuntimeError("operation failed due to a previous error during capture")


def test_after_a_failed_recording_static_steps_run_eagerly_and_nothing_more_is_recorded(
    qwen_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first recording fails: that step and the later ones, of another shape too, give the
    results of an engine without recordings bit for bit (the warm-up's gradients are undone), no
    second recording is tried, and the warning names the error the recording began with."""
    failing, eager = _engine(qwen_dir, True), _engine(qwen_dir, True)
    assert failing.step_graphs is not None and eager.step_graphs is not None
    recorder = FailingRecorder()
    failing.step_graphs.recorder = recorder
    _reset((failing, eager))
    rng = np.random.default_rng(6)
    _assert_steps_alike(failing, eager, [_batch(rng, (1, 30), (1, 200)), _batch(rng, (0, 150), (2, 60))])
    assert recorder.tries == 1 and failing.step_graphs.recorder is None
    assert failing.step_graphs.recorded == 0 and failing.step_graphs.steps == 2
    [warning] = [r for r in caplog.records if "could not record a step graph" in r.getMessage()]
    assert warning.getMessage().endswith("dependency created on uncaptured work in another stream")


class HostSyncAudit(TorchDispatchMode):
    """Every op dispatched while active that a CUDA graph cannot record: one that makes the host
    wait for the device (a scalar read back, ``nonzero``, indexing by a boolean mask, a
    ``repeat_interleave`` without its output size, ``unique``) or a collective (none is needed at
    one rank). Seen on the CPU, where the same ops run: a capture on the GPU fails on any of them."""

    SYNCING = frozenset(
        {
            torch.ops.aten._local_scalar_dense,
            torch.ops.aten.nonzero,
            torch.ops.aten.masked_select,
            torch.ops.aten._unique2,
            torch.ops.aten.unique_consecutive,
            torch.ops.aten.unique_dim,
            torch.ops.aten.equal,
        }
    )
    INDEXING = frozenset(
        {torch.ops.aten.index, torch.ops.aten.index_put_, torch.ops.aten.index_put, torch.ops.aten._index_put_impl_}
    )

    READS = ("tolist", "cpu", "numpy")
    """Reads of a tensor into host memory that dispatch no op on a CPU tensor (on CUDA, each is a
    copy to the host and a wait): watched by wrapping the methods while the audit runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.found: list[str] = []
        self._methods: dict[str, Any] = {}

    def __enter__(self) -> HostSyncAudit:
        for name in self.READS:
            method = self._methods[name] = getattr(torch.Tensor, name)

            def watched(tensor: torch.Tensor, *args: Any, _name: str = name, _method: Any = method, **kw: Any) -> Any:
                self.found.append(f"Tensor.{_name}")
                return _method(tensor, *args, **kw)

            setattr(torch.Tensor, name, watched)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for name, method in self._methods.items():
            setattr(torch.Tensor, name, method)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.ops += 1
        packet = func.overloadpacket
        if packet in self.SYNCING:
            self.found.append(str(func))
        elif packet in self.INDEXING and any(
            i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        ):
            self.found.append(f"{func} with a boolean mask")
        elif packet is torch.ops.aten.repeat_interleave and kwargs.get("output_size") is None:
            self.found.append(f"{func} without output_size")
        elif func.namespace in ("c10d", "_c10d_functional"):
            self.found.append(f"{func} (a collective)")
        return func(*args, **kwargs)


class DeviceMaskAttention(_FusedPackedAttention):
    """Per-document causal attention from the device's boundaries alone (no host read, as
    ``varlen_flash`` on CUDA): the CPU stand-in for the kernel a step graph records."""

    def _attend_packed(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_len: int,
        cache_key: torch.Tensor | None,
    ) -> torch.Tensor:
        total, rep = q.shape[0], self.heads // self.groups
        doc = document_ids(cu_seqlens, total)
        pos = torch.arange(total)
        allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
        kt, vt = (x.transpose(0, 1).repeat_interleave(rep, dim=0, output_size=self.heads) for x in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(0, 1), kt, vt, attn_mask=allowed, scale=self.scale)
        return out.transpose(0, 1)


class AuditingRecorder(EagerRecorder):
    """``EagerRecorder``, whose recording first runs the step's forward and backward (what a CUDA
    capture records) under ``HostSyncAudit``."""

    def __init__(self) -> None:
        super().__init__()
        self.audits: list[HostSyncAudit] = []

    def record(
        self, forward: Callable[[], torch.Tensor], grad: torch.Tensor
    ) -> tuple[torch.Tensor, Callable[[], None], Callable[[], None]]:
        with HostSyncAudit() as audit, torch.enable_grad():
            forward().backward(grad)
        self.audits.append(audit)
        return super().record(forward, grad)


def test_what_a_step_graph_records_waits_for_nothing_on_the_host(qwen_dir: Path) -> None:
    """The forward and backward a recording captures, of one slot (the one-slot LoRA path) and of
    two (the grouped matmuls), dispatch no op that would make a CUDA capture fail: no host sync,
    no boolean-mask indexing, no collective. The attention kernel is the device-only stand-in
    (``varlen_flash`` has no CPU build); the rest is the engine's own code."""
    engine = _engine(qwen_dir, True)
    assert engine.step_graphs is not None
    for layer in engine.model.decoder.layers:
        attn = layer.self_attention
        attn.core_attention = DeviceMaskAttention(attn.config, attn.layer_number, AttnMaskType.causal, "self")
    recorder = AuditingRecorder()
    engine.step_graphs.recorder = recorder
    for slot in range(4):
        randomize_slot(engine, slot, X, seed=30 + slot)
    rng = np.random.default_rng(8)
    engine.forward_backward(_batch(rng, (1, 30), (1, 200)), "cross_entropy")
    engine.forward_backward(_batch(rng, (0, 50), (2, 90)), "cross_entropy")
    assert recorder.recorded == 2 and engine.step_graphs.recorded == 2
    for audit in recorder.audits:
        assert audit.ops > 1000  # the whole model ran under the audit, forward and backward
        assert audit.found == [], audit.found


class BroadcastMatmuls(TorchDispatchMode):
    """Records every batched matmul one of whose operands is broadcast over the batch (a batch
    stride of 0): a weight multiplied token by token instead of as one matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[tuple[int, ...], ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket is torch.ops.aten.bmm and any(a.stride(0) == 0 and a.shape[0] > 1 for a in args[:2]):
            self.found.append(tuple(tuple(a.shape) for a in args[:2]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("stacked", [False, True], ids=["per-segment", "grouped"])
def test_no_step_multiplies_a_weight_token_by_token(
    pair: tuple[TrainerEngine, TrainerEngine], stacked: bool
) -> None:
    """Plain and static steps of one slot and of three: no backward multiplies a weight by the
    tokens' gradients as a batched matmul with the weight broadcast over the tokens (what
    megatron's output layer does when the gradient it gets is not laid out as one matrix)."""
    _reset(pair)
    rng = np.random.default_rng(12)
    batches = [_batch(rng, (1, 40), (1, 9)), _batch(rng, (2, 7), (0, 12), (1, 30))]
    for engine in pair:
        engine.pool.routing.stacked = stacked
        try:
            for batch in batches:
                with BroadcastMatmuls() as audit:
                    engine.forward_backward(batch, "cross_entropy")
                assert audit.found == [], audit.found
                for slot in range(3):
                    engine.discard_grads(slot)
        finally:
            engine.pool.routing.stacked = False


# ---------------------------------------------------------------- CUDA: recorded graphs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_step_graph_replays_equal_the_static_step_run_eagerly_bit_for_bit(qwen_dir: Path) -> None:
    """Two bf16 engines with the same adapters, one replaying recorded graphs and one running the
    same static steps eagerly. Two steps of slot 1 share one recording; a step of slot 2 reuses it
    (another row); two steps of two slots each (the grouped matmuls) share a second one; optimizer
    steps in between. Every log-probability, loss, gradient and adapter is bit-identical, and
    slot 3, in no batch until the end, keeps zero gradients until then."""
    graphs, eager = _engine(qwen_dir, True, "cuda"), _engine(qwen_dir, True, "cuda")
    assert graphs.step_graphs is not None and eager.step_graphs is not None
    eager.step_graphs.recorder = None
    for engine in (graphs, eager):
        for slot in range(4):
            randomize_slot(engine, slot, X, seed=20 + slot)
    rng = np.random.default_rng(1)
    # each of the first three: 256 tokens, 4 documents, the longest 256; then two slots of 140
    calls = [_batch(rng, (1, 30), (1, 200)), _batch(rng, (1, 100), (1, 17)), _batch(rng, (2, 150), (2, 60))]
    calls += [_batch(rng, (1, 50), (0, 90)), _batch(rng, (2, 90), (3, 50))]
    _assert_steps_alike(graphs, eager, calls[:-1])
    assert all(not v.any() for v in _grads(graphs, 3).values())
    _assert_steps_alike(graphs, eager, calls[-1:])
    assert graphs.step_graphs.recorded == 2 and graphs.step_graphs.replays == 5


@cuda
def test_cuda_a_one_document_step_graph_records_cudnn_attention_and_replays_bit_for_bit(
    qwen_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of one document of exactly ``CUDNN_MIN_TOKENS`` tokens (a shape of its own) on the
    CUDA default backend: the recording's attention is cuDNN's (``_causal_sdpa`` with ``cudnn``,
    and never FlashAttention's), and its replays give the same static steps run eagerly bit for
    bit, with an optimizer step between two of them."""
    from services.trainer import attention

    graphs, eager = _engine(qwen_dir, True, "cuda"), _engine(qwen_dir, True, "cuda")
    assert graphs.step_graphs is not None and eager.step_graphs is not None
    eager.step_graphs.recorder = None
    head_dim = graphs.model.config.kv_channels
    device = torch.device("cuda", torch.cuda.current_device())  # the key the layers' probe takes
    assert attention.cudnn_attention_usable(device, torch.bfloat16, head_dim)  # probed before counting
    calls = record_causal_sdpa(monkeypatch)
    for engine in (graphs, eager):
        for slot in range(4):
            randomize_slot(engine, slot, X, seed=40 + slot)
    rng = np.random.default_rng(5)
    calls_of = [_batch(rng, (1, CUDNN_MIN_TOKENS)), _batch(rng, (2, CUDNN_MIN_TOKENS))]
    assert StepShape.of([CUDNN_MIN_TOKENS], [X]).one_document
    _assert_steps_alike(graphs, eager, calls_of)
    assert graphs.step_graphs.recorded == 1 and graphs.step_graphs.replays == 2
    layers = len(graphs.model.decoder.layers)
    # eager: 2 steps; graphs: 2 warm-ups and the capture, each forward once per layer
    assert calls == [True] * layers * 5
