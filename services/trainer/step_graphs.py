"""``forward_backward`` steps at static shapes, replayed as CUDA graphs.

A small step is bound by the host: at 1,024 tokens of the 8B shape the GPU idles most of the
step while Python and the dispatcher launch some 50,000 kernels one by one
(docs/benchmarks.md, "forward_backward"). Replaying a recorded graph launches a whole forward
or backward with one call.

What is recorded, per ``StepShape``: the model from the packed tokens to every token's target
log-probability (the unfused output layer, then ``vocab.target_logprobs``: megatron's
cross-entropy masks by boolean indexing, a host sync, and all-reduces even at one rank, which a
graph cannot record), and its backward from a gradient of those log-probabilities, which adds
into the slots' gradient rows. The losses stay eager: a few vector operations per datum on the
``[T]`` log-probabilities, whose gradient is copied into the backward graph's input.

Static shapes: a batch of ``S`` slots that train the same modules, with ``T`` tokens in ``D``
documents, the longest ``L``, runs as ``T_b`` tokens (``T`` rounded up to a multiple of
``TOKEN_STEP``; the padding is one more document of token 0, in the last slot's segment and in no
loss, so its gradient is exactly zero), ``D_b + 1`` boundaries (``D_b`` the power of two above
``D``; the spare documents are empty) and ``L_b`` (the power of two at or above ``L`` and the
padding, at most ``T_b``: the attention kernel's grid). One document of exactly ``T_b`` tokens is
a shape of its own (``one_document``): its ``L_b`` is that document's length, so
``varlen_flash_cudnn`` records cuDNN's attention for it, as the plain engine runs it. The slots,
their segments' ends and their ``alpha/rank`` are device tensors (``lora.StaticRouting``), so one
recording serves any slots of the same count, largest rank and modules: ``StepShape`` is the
recording's key. One slot takes the one-slot LoRA path, several the grouped matmuls, as in the
plain engine on CUDA.

Costs: a new shape runs two eager steps on a side stream (with the slot's gradients restored
after them), then records both graphs; later steps of the shape replay them. Every recording
shares one memory pool, which keeps the activations of the largest recorded shape reserved:
``EngineConfig.step_graph_max_tokens`` bounds the shapes recorded (longer batches run eagerly).

Equality: a replay runs the recorded kernels on the same addresses, so its results equal the
same static step run eagerly bit for bit (the CUDA tests); the padded step differs from the
unpadded eager one by rounding only, GEMMs of another shape (the CPU tests). Isolation: the
padding tokens use the last slot's own adapter, and the recording reads and adds into exactly
the rows the tensors name, each segment from and into its own slot's. Without CUDA (the CPU
tests), the same static step runs eagerly; after a recording fails (logged), every static step
does, since torch leaves an aborted capture's memory pool open. Recording uses the thread-local
capture mode, as megatron's own graphs do: another thread's CUDA calls (NCCL's watchdog) do not
invalidate it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from libs.contracts.common import LoraConfig
from services.trainer import attention, packed_rope
from services.trainer.lora import Segment, SlotRouting, StaticRouting, lora_scaling
from services.trainer.packing import DatumInput

log = logging.getLogger(__name__)

TOKEN_STEP = 256
"""Recorded token counts are multiples of this."""
WARMUP = 2
"""Eager steps of a new shape on a side stream before it is recorded (lazy kernel set-up)."""


def _power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def modules(config: LoraConfig) -> tuple[bool, bool, bool]:
    return (config.train_attn, config.train_mlp, config.train_unembed)


@dataclass(frozen=True)
class StepShape:
    """The key of one recording: every size and flag its kernels depend on."""

    tokens: int  # T_b
    docs: int  # D_b: boundaries hold D_b + 1 entries
    longest: int  # L_b: the attention's max_seqlen
    slots: int  # S: one segment each
    rank: int  # the largest of their ranks
    modules: tuple[bool, bool, bool]  # train_attn, train_mlp, train_unembed, the same for every slot
    one_document: bool = False  # one document of exactly T_b tokens, no padding: L_b is its length

    @staticmethod
    def of(lengths: list[int], configs: list[LoraConfig]) -> StepShape:
        """``lengths``: the documents in packing order; ``configs``: their slots', ascending."""
        total = sum(lengths)
        tokens = -(-total // TOKEN_STEP) * TOKEN_STEP
        docs = _power_of_two(len(lengths) + 1)  # and the padding document
        longest = min(_power_of_two(max(*lengths, tokens - total)), tokens)
        rank = max(c.rank for c in configs)
        one = len(lengths) == 1 and total == tokens
        return StepShape(tokens, docs, longest, len(configs), rank, modules(configs[0]), one)


@dataclass
class _Recording:
    """The static inputs of one shape, and its graphs once recorded."""

    input_ids: torch.Tensor  # [1, T_b] int64
    position_ids: torch.Tensor  # [1, T_b] int64
    labels: torch.Tensor  # [1, T_b] int64
    cu_seqlens: torch.Tensor  # [D_b + 1] int32
    routing: StaticRouting  # [S] slots, scales, segment ends, compute rows
    grad: torch.Tensor  # [T_b] fp32: the backward's input
    logprobs: torch.Tensor | None = None  # [T_b]: the recorded forward's output
    forward: Replay | None = None
    backward: Replay | None = None


Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
"""(input_ids, position_ids, labels, cu_seqlens, max_seqlen) -> target log-probabilities [T]."""

Replay = Callable[[], None]


class Recorder(Protocol):
    """Records a static step: ``forward()`` gives ``[T_b]`` log-probabilities with autograd history,
    ``grad`` is the static ``[T_b]`` gradient its backward starts from. Returns the static output
    (valid after a forward replay) and the two replays. Nothing need run while recording."""

    def record(self, forward: Callable[[], torch.Tensor], grad: torch.Tensor) -> tuple[torch.Tensor, Replay, Replay]: ...


def first_error(exc: BaseException) -> BaseException:
    """The error a failed capture began with: leaving ``torch.cuda.graph`` ends the capture, and
    that fails in turn ("operation failed due to a previous error during capture"), hiding the
    first error as the later one's context."""
    while exc.__context__ is not None:
        exc = exc.__context__
    return exc


class CudaGraphRecorder:
    """Records with CUDA graphs: two warm-up steps (the kernels' lazy set-up, and a backward from
    zeros), then the forward and the backward captured into one memory pool that every recording
    shares. ``quiet`` is held while capturing (another thread of the process that pins memory
    meanwhile would break the capture).

    Warm-ups and captures run on one stream of the recorder's own. Autograd runs a leaf's gradient
    accumulation on the stream that was current when the leaf's accumulator was made, and after
    a backward makes the caller's stream wait on each such stream. An accumulator made on another
    stream (a warm-up's, still held by its output's graph) is then waited on from inside the
    capture, though nothing of it was captured: CUDA refuses that dependency and the capture fails
    ("dependency created on uncaptured work in another stream"). So no warm-up output outlives
    its step, and every stream involved is the capture's."""

    def __init__(self, quiet: AbstractContextManager[Any] | None = None) -> None:
        self._quiet = quiet if quiet is not None else contextlib.nullcontext()
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None

    def record(self, forward: Callable[[], torch.Tensor], grad: torch.Tensor) -> tuple[torch.Tensor, Replay, Replay]:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
            self._pool = torch.cuda.graph_pool_handle()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.enable_grad():
            for _ in range(WARMUP):
                warm = forward()
                warm.backward(torch.zeros_like(warm))
                del warm  # its graph would keep the step's accumulators alive
        torch.cuda.current_stream().wait_stream(stream)
        fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with self._quiet, torch.enable_grad():  # thread_local: other threads' CUDA calls (NCCL's watchdog) are no error
            with torch.cuda.graph(fwd, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
                out = forward()
            with torch.cuda.graph(bwd, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
                out.backward(grad)
        return out.detach(), fwd.replay, bwd.replay


class StepGraphs:
    """Runs ``forward_backward`` steps at static shapes, recorded by ``recorder`` (CUDA graphs; None:
    every step eagerly) and replayed (module docstring)."""

    def __init__(self, forward: Forward, routing: SlotRouting, grads: torch.Tensor, recorder: Recorder | None) -> None:
        """``forward`` runs the model (routing set by the caller); ``grads``: the pool's gradient
        rows ``[slots, width]`` (restored after a recording, whose warm-up adds into them)."""
        self._forward = forward
        self._routing = routing
        self._grads = grads
        self.recorder = recorder
        self._recordings: dict[StepShape, _Recording] = {}
        self.steps = 0  # static steps run, replayed or eager
        self.recorded = 0  # shapes recorded so far
        self.replays = 0  # steps run from recordings

    def fits(self, datums: list[DatumInput]) -> bool:
        """Whether ``datums`` can run as a static step: their slots all train the same modules."""
        return len({modules(self._routing.configs[d.slot]) for d in datums}) == 1

    def logprobs(
        self, datums: list[DatumInput], tokens: np.ndarray, targets: np.ndarray, backward: bool
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], None]]:
        """Every token's target log-probability ``[T]`` of ``datums`` (in packing order: by
        ascending slot; ``tokens`` and ``targets`` their concatenation), and the function that,
        given the summed loss of those log-probabilities, adds its gradient into the slots."""
        lengths = [d.num_tokens for d in datums]
        ends: dict[int, int] = {}  # slot -> its segment's end
        for datum, end in zip(datums, np.cumsum(lengths).tolist(), strict=True):
            ends[datum.slot] = int(end)
        segments, start = [], 0
        for slot, end in ends.items():
            segments.append(Segment(slot, start, end))
            start = end
        shape = StepShape.of(lengths, [self._routing.configs[s.slot] for s in segments])
        self.steps += 1
        rec = self._recordings.get(shape)
        if rec is None:
            rec = self._recordings[shape] = self._buffers(shape, self._grads.device)
        self._fill(rec, shape, segments, lengths, tokens, targets)
        segments[-1] = Segment(segments[-1].slot, segments[-1].start, shape.tokens)  # and the padding
        total = len(tokens)
        if self.recorder is not None and rec.forward is None:
            self._record_shape(self.recorder, rec, shape, segments)
        if rec.forward is not None and rec.backward is not None and rec.logprobs is not None:
            self.replays += 1
            rec.forward()
            leaf = rec.logprobs[:total].clone().requires_grad_(backward)
            replay_backward = rec.backward

            def replayed(loss: torch.Tensor) -> None:
                (grad,) = torch.autograd.grad(loss, leaf)
                rec.grad[:total].copy_(grad)
                rec.grad[total:].zero_()
                replay_backward()

            return leaf, replayed
        with torch.enable_grad() if backward else torch.no_grad():
            full = self._routed_forward(rec, shape, segments)
        return full[:total], lambda loss: loss.backward()

    # ---- static inputs ----

    @staticmethod
    def _buffers(shape: StepShape, device: torch.device) -> _Recording:
        def zeros(*size: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(size, dtype=dtype, device=device)

        routing = StaticRouting(
            slots=zeros(shape.slots),
            scales=zeros(shape.slots, dtype=torch.float32),
            offsets=zeros(shape.slots, dtype=torch.int32),
            source=torch.arange(shape.slots, device=device),
        )
        return _Recording(
            input_ids=zeros(1, shape.tokens),
            position_ids=zeros(1, shape.tokens),
            labels=zeros(1, shape.tokens),
            cu_seqlens=zeros(shape.docs + 1, dtype=torch.int32),
            routing=routing,
            grad=zeros(shape.tokens, dtype=torch.float32),
        )

    def _fill(
        self,
        rec: _Recording,
        shape: StepShape,
        segments: list[Segment],
        lengths: list[int],
        tokens: np.ndarray,
        targets: np.ndarray,
    ) -> None:
        """Copy one batch into the static inputs: its tokens, then the padding document (token 0,
        positions from 0), its boundaries, then empty documents up to ``D_b``; each segment's
        slot, ``alpha/rank`` and end (the last one the padded stream's)."""
        total, padded = len(tokens), shape.tokens
        ids = np.zeros(padded, dtype=np.int64)
        ids[:total] = tokens
        labels = np.zeros(padded, dtype=np.int64)
        labels[:total] = targets
        ends = np.cumsum(lengths)
        bounds = np.full(shape.docs + 1, padded, dtype=np.int32)
        bounds[0] = 0
        bounds[1 : len(lengths) + 1] = ends
        positions = np.concatenate([np.arange(n, dtype=np.int64) for n in [*lengths, padded - total]])
        rec.input_ids.copy_(torch.from_numpy(ids)[None])
        rec.position_ids.copy_(torch.from_numpy(positions)[None])
        rec.labels.copy_(torch.from_numpy(labels)[None])
        rec.cu_seqlens.copy_(torch.from_numpy(bounds))
        slots = [seg.slot for seg in segments]
        scales = [lora_scaling(self._routing.configs[slot].rank) for slot in slots]
        seg_ends = [seg.end for seg in segments[:-1]] + [padded]
        rec.routing.slots.copy_(torch.tensor(slots, dtype=torch.int64))
        rec.routing.scales.copy_(torch.tensor(scales, dtype=torch.float32))
        rec.routing.offsets.copy_(torch.tensor(seg_ends, dtype=torch.int32))

    # ---- running and recording ----

    def _routed_forward(self, rec: _Recording, shape: StepShape, segments: list[Segment]) -> torch.Tensor:
        """The model over the static inputs, each segment routed to the slot that
        ``rec.routing`` names for it; ``[T_b]`` log-probabilities."""
        packed_rope.forget()  # its per-forward cache is keyed by the identity of cu_seqlens
        self._routing.segments = segments
        self._routing.static = rec.routing
        # L_b is a bound, not the longest document's length, except in a one-document shape,
        # whose every step is one document of exactly L_b = T_b tokens (cuDNN may take it)
        exact = contextlib.nullcontext() if shape.one_document else attention.max_seqlen_rounded()
        try:
            with exact:
                return self._forward(rec.input_ids, rec.position_ids, rec.labels, rec.cu_seqlens, shape.longest)
        finally:
            self._routing.segments = []
            self._routing.static = None

    def _record_shape(
        self, recorder: Recorder, rec: _Recording, shape: StepShape, segments: list[Segment]
    ) -> None:
        """Record ``shape`` (its slots' gradient rows restored after: the recorder's warm-up adds
        into them); a failure is logged and turns recording off: every static step runs eagerly."""
        slots = rec.routing.slots
        rows = self._grads.index_select(0, slots)
        try:
            out, forward, backward = recorder.record(lambda: self._routed_forward(rec, shape, segments), rec.grad)
        except RuntimeError as exc:
            # torch leaves an aborted capture's memory pool open (every later capture fails), so
            # no shape is recorded again in this process; static steps go on eagerly
            self.recorder = None
            log.warning(
                "could not record a step graph for %s; static steps run eagerly from now on: %s",
                shape,
                first_error(exc),
                exc_info=True,
            )
            return
        finally:
            if self._grads.is_cuda:
                torch.cuda.synchronize()
            self._grads.index_copy_(0, slots, rows)
        rec.logprobs, rec.forward, rec.backward = out, forward, backward
        self.recorded += 1
