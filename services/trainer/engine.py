"""``TrainerEngine``: multi-tenant LoRA training over one frozen megatron-core base model.

The engine is a pure library (no NATS, no HTTP).  It owns the base model, a fixed pool of
adapter slots (``lora.AdapterPool``), the per-slot AdamW state (``optim.SlotAdamW``) and the
set of slots holding un-stepped gradients.  ``forward_backward`` packs the datums of any number
of slots into one THD stream, runs the model once, computes each datum's loss
(``losses.py``) and backpropagates their plain sum.

SPMD contract: with tensor parallelism every rank of the TP group makes the same calls with the
same arguments in the same order (collectives run inside forward, backward, ``optim_step``,
``get_slot_state`` and ``export_peft``); every rank returns the same results.

Invariant: gradients accumulate in each slot's tensors across ``forward_backward`` calls and
leave only through that slot's ``optim_step``, ``discard_grads``, ``release_slot`` or
``set_slot_state``; nothing a call does to one slot changes another slot's weights, moments,
step counter or gradients.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from infra.config import MAX_LORA_RANK, NUM_SLOTS
from libs.contracts.common import AdamParams, LoraConfig
from libs.contracts.loss_specs import LOSS_SPECS, resolve_config, validate_loss_request
from services.trainer import slot_state
from services.trainer.fused_ce import lm_head_logprobs
from services.trainer.host_copy import to_device
from services.trainer.lora import AdapterPool, grouped_mm_supported
from services.trainer.losses import LOSS_FNS, LOSS_METRICS
from services.trainer.model import build_model
from services.trainer.optim import SlotAdamW, StepReport, zero_grads
from services.trainer.packing import DatumInput, PackedBatch, pack
from services.trainer.parallel import ensure_model_parallel, tp_all_gather, tp_rank
from services.trainer.peft_export import export_peft
from services.trainer.slot_state import SlotState
from services.trainer.step_graphs import TOKEN_STEP, CudaGraphRecorder, StepGraphs
from services.trainer.vocab import target_logprobs

__all__ = [
    "AdamParams",
    "DatumInput",
    "DatumOutput",
    "EngineConfig",
    "LoraConfig",
    "SlotState",
    "StepReport",
    "TrainerEngine",
]


@dataclass(frozen=True)
class EngineConfig:
    """How to build a ``TrainerEngine``.  The TP size is the torch.distributed world size."""

    base_model_dir: str
    num_slots: int = NUM_SLOTS.default
    max_lora_rank: int = MAX_LORA_RANK.default
    device: str = "cpu"  # "cpu" | "cuda"
    dtype: torch.dtype | None = None  # None: float32 on CPU, bfloat16 on CUDA
    attention_backend: str = "auto"  # a key of attention.ATTENTION_BACKENDS; auto: resolve_backend
    fused_cross_entropy: bool | None = None  # None: by size on CUDA, off on CPU (see resolve_fused_ce)
    # Steps of at most step_graph_max_tokens (padded) whose slots train the same modules run at
    # static shapes, replayed as CUDA graphs on CUDA (step_graphs.py); TP=1 with the varlen_flash,
    # varlen_flash_cudnn or sdpa_per_document backend. None: on CUDA, off on CPU (where a static
    # step is only padding)
    step_graphs: bool | None = None
    step_graph_max_tokens: int | None = None  # None: step_graph_tokens_for(device); see TrainerConfig


LARGE_CARD_BYTES = 120 << 30
"""A card of at least this much memory records steps of up to 4,096 tokens by default."""


def step_graph_tokens_for(device: torch.device) -> int:
    """The largest step recorded by default: 4,096 tokens on a card of at least ``LARGE_CARD_BYTES``,
    2,048 elsewhere. A replayed 4,096-token step of the 8B shape is 2-3 % faster than the eager one
    on an H100 and takes the host's launches off a step whose host (an H200's) launches it about as
    slowly as the GPU runs it (docs/benchmarks.md); but the recordings' pool keeps the largest one's
    activations reserved beside any longer eager step (6 GiB at 2,048 tokens in an 80 GB stack's
    out-of-memory report, growing with the tokens), which an 80 GB card running 8,192-token steps
    beside a sampler does not have."""
    if device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory >= LARGE_CARD_BYTES:
        return 4096
    return 2048


def resolve_backend(name: str, device: str) -> str:
    """`auto`: ``varlen_flash_cudnn`` on CUDA (FlashAttention-2, and cuDNN for a step that is one
    long document: 7 % and 11 % faster at 1x4096 and 1x8192 on the H200, docs/benchmarks.md),
    per-document SDPA on CPU."""
    if name != "auto":
        return name
    return "varlen_flash_cudnn" if device == "cuda" else "sdpa_per_document"


# The default loss path on CUDA: the output layer + ``vocab.target_logprobs`` while a forward's
# [tokens x vocab/tp] logits, counted as fp32, stay within this many bytes (14,134 tokens at Qwen3's
# vocabulary), the chunked fused linear cross-entropy (fused_ce.py) beyond, where its memory saving
# grows. (At TP=1 on CUDA the unfused path holds the logits and their gradient in the model's
# dtype, no fp32 copy: ``vocab``'s kernels.) On the H200 the unfused path measured 3-4 % faster from 4,096
# to 8,192 packed tokens, 16x256 aside (1 % slower) (docs/benchmarks.md, "The loss path").
UNFUSED_LOGITS_BYTES = 8 << 30


def resolve_fused_ce(flag: bool | None, device: str, tokens: int, local_vocab: int) -> bool:
    """Whether a forward of ``tokens`` packed tokens takes the fused loss: ``flag`` where it is set;
    unset, on CUDA only when the unfused logits would pass `UNFUSED_LOGITS_BYTES`, never on a CPU."""
    if flag is not None:
        return flag
    return device == "cuda" and tokens * local_vocab * 4 > UNFUSED_LOGITS_BYTES


@dataclass(frozen=True)
class DatumOutput:
    """One datum's result: target-token log-probabilities and its loss (a plain sum)."""

    logprobs: np.ndarray  # float32[N], or [N, K] for top-K targets
    loss: float
    metrics: dict[str, float] = field(default_factory=dict)  # the loss's own, each ``name:sum``


class TrainerEngine:
    """The trainer's compute engine; see the module docstring for its contract."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.tp_size = ensure_model_parallel(config.device)
        dtype = config.dtype or (torch.bfloat16 if config.device == "cuda" else torch.float32)
        self.model_dtype = dtype
        self.model, self.shape = build_model(
            config.base_model_dir,
            dtype=dtype,
            device=config.device,
            attention_backend=resolve_backend(config.attention_backend, config.device),
        )
        self.pool = AdapterPool(self.shape, config.num_slots, config.max_lora_rank, device=config.device)
        self.pool.attach(self.model)
        # Many tenants in one batch: stacked LoRA kernels on a GPU (launches dominate), one
        # adapter per segment on a CPU (FLOPs dominate). Both give the same result.
        self.pool.routing.stacked = config.device == "cuda"
        self.optimizer = SlotAdamW(rows=self.pool.rows)
        self._pending: set[int] = set()
        # One-column targets: log-probabilities from the hidden states by the chunked fused
        # linear cross-entropy (no [T, vocab] logits), or megatron's output layer + vocab-parallel
        # cross-entropy. Equal within rounding; which one a forward takes: resolve_fused_ce.
        self.fused_ce: bool | None = config.fused_cross_entropy  # forced on/off, or None: `resolve_fused_ce`
        self.fused_ce_chunk: int | None = None  # tokens per piece; None: fused_ce.chunk_tokens
        # slot -> a token that changes whenever anything of the slot's state may change (weights,
        # moments, step, gradients, pending): unique across engines, so a snapshot can tell that
        # a slot still holds exactly what an earlier snapshot recorded (``state_versions``)
        self._instance = uuid.uuid4().hex
        self._changes = 0
        self._versions: dict[int, str] = {}
        graphed = config.step_graphs if config.step_graphs is not None else self.device.type == "cuda"
        self.step_graph_max_tokens = (
            config.step_graph_max_tokens
            if config.step_graph_max_tokens is not None
            else step_graph_tokens_for(self.device)
        )
        self.step_graphs = self.new_step_graphs() if graphed else None
        self.snapshot_buffers = slot_state.HostBuffers()  # see get_slot_state(for_snapshot=True)
        # a save's copy of its slot, on CUDA (state/checkpoints.py)
        self.save_buffers = slot_state.PinnedPool() if self.device.type == "cuda" else None

    @property
    def state_versions(self) -> dict[int, str]:
        """Each slot's state token: equal tokens mean the slot's state is unchanged in between
        (a property: not broadcast to the other TP ranks, which hold the same slots)."""
        return dict(self._versions)

    def _touch(self, slots: Iterable[int]) -> None:
        """Mark ``slots`` as changed (called before a change, so that a failure midway counts too)."""
        for slot in slots:
            self._changes += 1
            self._versions[slot] = f"{self._instance}:{self._changes}"

    # ---- slot lifecycle ----

    def init_slot(self, slot: int, lora: LoraConfig) -> None:
        """Give ``slot`` a fresh adapter (seeded A, zero B) and fresh optimizer state."""
        if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
            raise ValueError("a slot must train at least one of attn, mlp, unembed")
        self._touch([slot])
        self.pool.init_slot(slot, lora)
        self.optimizer.reset_slot(slot)
        self._pending.discard(slot)
        self._prepare_host_buffers(slot)

    def _prepare_host_buffers(self, slot: int) -> None:
        """Allocate, on background threads, the host buffers that a snapshot and a save of ``slot``
        copy it into (pinned on CUDA: ``slot_state.HostBuffers``, ``slot_state.PinnedPool``), so
        that no unit waits for the pinning. Only TP rank 0 keeps host copies."""
        if tp_rank() != 0:
            return
        self.snapshot_buffers.prepare(slot, slot_state.host_layout(self.pool, slot), self.device.type == "cuda")
        if self.save_buffers is not None:
            saved = slot_state.host_layout(self.pool, slot, slot_state.SNAPSHOT_TABLES[:3])  # no gradients
            self.save_buffers.prepare(slot_state.pinned_nbytes(saved), count=len(self.pool.configs))

    def release_slot(self, slot: int) -> None:
        """Forget everything about ``slot`` (weights, moments, step counter, gradients)."""
        self._touch([slot])
        self.pool.clear_slot(slot)
        self.optimizer.reset_slot(slot)
        self._pending.discard(slot)

    # ---- training ----

    def forward_backward(
        self,
        datums: list[DatumInput],
        loss_fn: str,
        loss_config: Mapping[str, float] | None = None,
        forward_only: bool = False,
    ) -> list[DatumOutput]:
        """Log-probabilities and per-datum losses; unless ``forward_only``, accumulate gradients.

        Raises:
            ValueError: an invalid request (the message names the field); nothing was changed.
        """
        self._validate(datums, loss_fn, loss_config)
        if not datums:
            return []
        if not forward_only:
            self._touch({d.slot for d in datums})
        cfg = resolve_config(loss_fn, loss_config)
        reads = set(LOSS_SPECS[loss_fn].inputs) - {"target_tokens"}  # ignored inputs never reach the loss
        top_k = any(np.ndim(d.loss_inputs["target_tokens"]) == 2 for d in datums)
        metrics_fn = LOSS_METRICS.get(loss_fn)
        # Top-K targets: pack with the first column as labels, then score all K from the logits.
        packed = [_first_column(d) for d in datums] if top_k else datums
        order = sorted(range(len(packed)), key=lambda i: packed[i].slot)  # as `pack` orders them
        # The losses' inputs reach the device before the model is launched, in one copy (were they
        # copied after the forward is queued, a copy from pageable memory would hold the
        # backward's launch until the forward had finished; ``host_copy``).
        ordered_inputs = [{k: v for k, v in datums[i].loss_inputs.items() if k in reads} for i in order]
        on_device = iter(_to_device_at_once([a for d in ordered_inputs for a in d.values()], np.float32, self.device))
        staged = [{k: next(on_device) for k in d} for d in ordered_inputs]
        targets_k = (
            _to_device_at_once([datums[i].loss_inputs["target_tokens"] for i in order], np.int64, self.device)
            if top_k
            else []
        )
        grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()
        finish: Callable[[torch.Tensor], None] = _backward
        with grad_mode:
            if self._graphed(packed, top_k):
                assert self.step_graphs is not None
                ordered = [packed[i] for i in order]
                bounds = np.concatenate([[0], np.cumsum([d.num_tokens for d in ordered])]).tolist()
                tokens = np.concatenate([np.asarray(d.tokens, dtype=np.int64) for d in ordered])
                targets = np.concatenate([np.asarray(d.loss_inputs["target_tokens"], dtype=np.int64) for d in ordered])
                lp_all, finish = self.step_graphs.logprobs(ordered, tokens, targets, backward=not forward_only)
            else:
                batch = pack(packed, self.device)
                assert batch.order == order
                bounds = batch.bounds
                with self._routed(batch):
                    if top_k:
                        logits = self.model(
                            batch.input_ids, batch.position_ids, None, packed_seq_params=self._packed_params(batch)
                        )[0]  # [T, vocab / tp]
                    elif resolve_fused_ce(
                        self.fused_ce, self.config.device, batch.labels.numel(), self.shape.vocab_size // self.tp_size
                    ):
                        lp_all = self._fused_logprobs(batch)  # [T]
                    else:
                        lp_all = self._output_layer_logprobs(
                            batch.input_ids, batch.position_ids, batch.labels, batch.cu_seqlens, batch.max_len
                        )  # [T]
            lps: list[torch.Tensor] = []
            losses: list[torch.Tensor] = []
            metrics: list[dict[str, torch.Tensor]] = []
            for j in range(len(order)):
                start, end = bounds[j], bounds[j + 1]
                if top_k:
                    lp = target_logprobs(logits[start:end], targets_k[j].reshape(end - start, -1))  # [N, K]
                    lp = lp if targets_k[j].ndim == 2 else lp[:, 0]
                else:
                    lp = lp_all[start:end]  # [N]
                lps.append(lp)
                losses.append(LOSS_FNS[loss_fn](lp, staged[j], cfg))
                if metrics_fn is not None:
                    with torch.no_grad():
                        metrics.append(metrics_fn(lp, staged[j], cfg))
            loss_values = torch.stack(losses)  # [D]
            if not forward_only:
                finish(loss_values.sum())
                self._pending.update(d.slot for d in datums)
        return _unpack_outputs(order, lps, loss_values, metrics)

    def optim_step(self, params: Mapping[int, AdamParams]) -> dict[int, StepReport]:
        """One AdamW step per requested slot (ascending slot order); zeroes those slots' grads."""
        for slot in sorted(params):
            self._require_slot(slot)
        self._touch(params)
        reports = self.optimizer.step_many(
            [(slot, self.pool.slot_tensors(slot), params[slot]) for slot in sorted(params)]
        )
        self._pending.difference_update(params)
        return reports

    def discard_grads(self, slot: int) -> None:
        self._require_slot(slot)
        self._touch([slot])
        zero_grads(self.pool.slot_tensors(slot))
        self._pending.discard(slot)

    def has_pending_grads(self, slot: int) -> bool:
        """True after a ``forward_backward`` touched ``slot`` and before its step or discard."""
        return slot in self._pending

    # ---- state ----

    def get_slot_state(
        self, slot: int, with_optimizer: bool = True, for_snapshot: bool = False, on_device: bool = False
    ) -> SlotState:
        """``for_snapshot``: the tensors are copies in ``snapshot_buffers`` (reused by the next
        snapshot; pinned on CUDA), not tensors of their own. ``on_device``: the full-layout tensors
        where the slot lives, views of it where no gather was needed (the caller copies them
        before the slot changes)."""
        self._require_slot(slot)
        host = self.snapshot_buffers if for_snapshot else None
        follower = for_snapshot and tp_rank() != 0  # joins the gathers; only rank 0 keeps a copy
        return slot_state.get_slot_state(
            self.pool, self.optimizer, slot, with_optimizer, host, follower or on_device
        )

    def get_slot_grads(self, slot: int, for_snapshot: bool = False) -> dict[str, torch.Tensor]:
        """The slot's accumulated gradients, keyed and laid out like ``SlotState.adapter``
        (``for_snapshot``: as in ``get_slot_state``)."""
        self._require_slot(slot)
        host = self.snapshot_buffers if for_snapshot else None
        return slot_state.get_slot_grads(self.pool, slot, host, for_snapshot and tp_rank() != 0)

    def set_slot_grads(self, slot: int, grads: dict[str, torch.Tensor], pending: bool) -> None:
        """Put back gradients captured by ``get_slot_grads`` (and whether they count as pending)."""
        self._require_slot(slot)
        self._touch([slot])
        slot_state.set_slot_grads(self.pool, slot, grads)
        if pending:
            self._pending.add(slot)

    @property
    def pending_slots(self) -> set[int]:
        return set(self._pending)

    def set_slot_state(self, slot: int, state: SlotState, with_optimizer: bool) -> None:
        self._touch([slot])
        slot_state.set_slot_state(self.pool, self.optimizer, slot, state, with_optimizer)
        self._pending.discard(slot)
        self._prepare_host_buffers(slot)

    def export_peft(
        self, slot: int, state: SlotState | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The slot's adapter as PEFT tensors plus ``adapter_config.json`` content (from ``state``,
        the slot's state as ``get_slot_state`` gave it, when the caller has it already)."""
        state = state if state is not None else self.get_slot_state(slot, with_optimizer=False)
        return export_peft(state, self.shape, self.config.base_model_dir)

    def logits(self, datums: list[DatumInput]) -> list[torch.Tensor]:
        """Full-vocabulary logits per datum (gathered over TP), each [N, vocab]; no gradients."""
        self._validate_slots(datums)
        batch = pack(datums, self.device)
        with torch.no_grad(), self._routed(batch):
            local = self.model(
                batch.input_ids, batch.position_ids, None, packed_seq_params=self._packed_params(batch)
            )[0]  # [T, vocab / tp]
        full = torch.cat(tp_all_gather(local), dim=-1).cpu()  # [T, vocab]
        out: list[torch.Tensor | None] = [None] * len(datums)
        for j, index in enumerate(batch.order):
            out[index] = full[batch.bounds[j] : batch.bounds[j + 1]]
        return [o for o in out if o is not None]

    # ---- helpers ----

    def new_step_graphs(self) -> StepGraphs | None:
        """Static steps for this engine, recorded as CUDA graphs on CUDA (``step_graphs.py``;
        assigned to ``step_graphs`` they apply); None where they do not: TP > 1, or an attention
        backend other than varlen_flash(_cudnn) and sdpa_per_document."""
        backend = resolve_backend(self.config.attention_backend, self.config.device)
        if self.tp_size != 1 or backend not in ("varlen_flash", "varlen_flash_cudnn", "sdpa_per_document"):
            return None
        recorder = CudaGraphRecorder(quiet=slot_state.PINNING) if self.device.type == "cuda" else None
        return StepGraphs(self._output_layer_logprobs, self.pool.routing, self.pool.rows.grads, recorder)

    def _graphed(self, datums: list[DatumInput], top_k: bool) -> bool:
        """Whether this forward runs as a static step (``step_graphs``): one target per token, at
        most ``step_graph_max_tokens`` padded tokens, on the unfused loss path, slots that train
        the same modules (several: where the grouped matmul runs)."""
        if self.step_graphs is None or top_k or not self.step_graphs.fits(datums):
            return False
        if len({d.slot for d in datums}) > 1 and not grouped_mm_supported(
            torch.empty(0, device=self.device, dtype=self.model_dtype)
        ):
            return False
        tokens = sum(d.num_tokens for d in datums)
        padded = -(-tokens // TOKEN_STEP) * TOKEN_STEP
        local_vocab = self.shape.vocab_size // self.tp_size
        return padded <= self.step_graph_max_tokens and not resolve_fused_ce(
            self.fused_ce, self.config.device, padded, local_vocab
        )

    def _output_layer_logprobs(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_len: int,
    ) -> torch.Tensor:
        """Every token's target log-probability ``[T]`` by the unfused path: megatron's output
        layer (with its LoRA hook), then ``vocab.target_logprobs`` on the logits (the routing is
        the caller's). Not megatron's vocab-parallel cross-entropy: that one copies the logits to
        fp32, masks its targets by boolean indexing (a host sync, which also keeps a CUDA graph
        from recording it) and all-reduces even at one rank; at TP=1 on CUDA ``target_logprobs``
        reads the logits in their own dtype in one kernel. Static steps (``step_graphs``) record
        this method."""
        logits = self.model(input_ids, position_ids, None, packed_seq_params=_packed_seq_params(cu_seqlens, max_len))
        return target_logprobs(logits[0], labels[0, :, None])[:, 0]  # logits [1, T, V/tp]

    def _fused_logprobs(self, batch: PackedBatch) -> torch.Tensor:
        """The model up to the final norm (its output layer skipped), then ``fused_ce``."""
        self.model.post_process = False  # GPTModel returns the decoder's (normed) hidden states
        try:
            hidden = self.model(
                batch.input_ids, batch.position_ids, None, packed_seq_params=self._packed_params(batch)
            )  # [T, 1, H]
        finally:
            self.model.post_process = True
        return lm_head_logprobs(self.model, self.pool, hidden, batch.labels[0], self.fused_ce_chunk)

    @contextlib.contextmanager
    def _routed(self, batch: PackedBatch) -> Any:
        self.pool.routing.segments = batch.segments
        try:
            yield
        finally:
            self.pool.routing.segments = []

    @staticmethod
    def _packed_params(batch: PackedBatch) -> Any:
        return _packed_seq_params(batch.cu_seqlens, batch.max_len)

    def _require_slot(self, slot: int) -> None:
        if slot not in self.pool.configs:
            raise ValueError(f"slot {slot} is not initialised")

    def _validate_slots(self, datums: list[DatumInput]) -> None:
        vocab = self.shape.vocab_size
        for i, datum in enumerate(datums):
            if datum.slot not in self.pool.configs:
                raise ValueError(f"data[{i}].slot {datum.slot} is not initialised")
            tokens = np.asarray(datum.tokens)
            if tokens.ndim != 1 or tokens.size == 0:
                raise ValueError(f"data[{i}].tokens must be a non-empty 1-D array")
            if tokens.min() < 0 or tokens.max() >= vocab:
                raise ValueError(f"data[{i}].tokens has ids outside [0, {vocab})")

    def _validate(
        self, datums: list[DatumInput], loss_fn: str, loss_config: Mapping[str, float] | None
    ) -> None:
        error = validate_loss_request(
            loss_fn,
            loss_config,
            [d.num_tokens for d in datums],
            [{k: tuple(np.shape(v)) for k, v in d.loss_inputs.items()} for d in datums],
        )
        if error is not None:
            raise ValueError(error)
        self._validate_slots(datums)
        for i, datum in enumerate(datums):
            targets = np.asarray(datum.loss_inputs["target_tokens"])
            if targets.min() < 0 or targets.max() >= self.shape.vocab_size:
                raise ValueError(
                    f"data[{i}].loss_fn_inputs.target_tokens has ids outside [0, {self.shape.vocab_size})"
                )
            for name, value in datum.loss_inputs.items():
                if name != "target_tokens" and not np.all(np.isfinite(np.asarray(value, dtype=np.float64))):
                    raise ValueError(f"data[{i}].loss_fn_inputs.{name} has non-finite values")
            sequence = datum.loss_inputs.get("sampled_sequence")
            if sequence is not None and loss_fn == "stable_reinforce":
                seq = np.asarray(sequence, dtype=np.float64)
                if np.any((seq != np.round(seq)) | (seq < -1) | (seq >= datum.num_tokens)):
                    raise ValueError(
                        f"data[{i}].loss_fn_inputs.sampled_sequence must hold integers in [-1, {datum.num_tokens})"
                    )


def _packed_seq_params(cu_seqlens: torch.Tensor, max_len: int) -> Any:
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=max_len, max_seqlen_kv=max_len
    )


def _backward(loss: torch.Tensor) -> None:
    loss.backward()


def _to_device_at_once(arrays: list[np.ndarray], dtype: type, device: torch.device) -> list[torch.Tensor]:
    """``arrays`` as ``dtype`` tensors on ``device``, views of one tensor that took one copy."""
    if not arrays:
        return []
    flat = to_device(np.concatenate([np.asarray(a, dtype=dtype).ravel() for a in arrays]), device)
    views, offset = [], 0
    for a in arrays:
        shape = np.shape(a)
        size = int(np.prod(shape))
        views.append(flat[offset : offset + size].view(shape))
        offset += size
    return views


def _unpack_outputs(
    order: list[int], lps: list[torch.Tensor], losses: torch.Tensor, metrics: list[dict[str, torch.Tensor]]
) -> list[DatumOutput]:
    """Each datum's output in request order, read from the device in one copy (``lps``,
    ``losses`` and ``metrics`` are in packed order)."""
    values = [lp.detach().reshape(-1) for lp in lps] + [losses.detach().reshape(-1)]
    values += [v.detach().reshape(1) for m in metrics for v in m.values()]
    host = torch.cat([v.float() for v in values]).cpu().numpy()
    offset = sum(lp.numel() for lp in lps)
    loss_host, offset = host[offset : offset + len(lps)], offset + len(lps)
    outputs: list[DatumOutput | None] = [None] * len(order)
    start = 0
    for j, index in enumerate(order):
        lp_np = host[start : start + lps[j].numel()].reshape(tuple(lps[j].shape))
        start += lps[j].numel()
        named: dict[str, float] = {}
        for name in metrics[j] if metrics else ():
            named[name], offset = float(host[offset]), offset + 1
        outputs[index] = DatumOutput(lp_np, float(loss_host[j]), named)
    return [o for o in outputs if o is not None]


def _first_column(datum: DatumInput) -> DatumInput:
    """The datum with 1-D placeholder labels, for packing a top-K batch."""
    targets = np.asarray(datum.loss_inputs["target_tokens"])
    if targets.ndim == 1:
        return datum
    return DatumInput(datum.slot, datum.tokens, {"target_tokens": targets[:, 0]})
