"""A fixed pool of LoRA adapter slots over one frozen, tensor-parallel megatron base model.

Each adapted linear ``y = W x`` (``linear_qkv``, ``linear_proj``, ``linear_fc1``,
``linear_fc2`` of every layer, and ``output_layer``) gains, for a token routed to slot ``s``:

    y_o = W_o x + (alpha / rank_s) * B[s, o, :rank_s] @ (A[s, p(o), :rank_s, :] @ x)

with ``A: (slots, parts, r_max, in)`` and ``B: (slots, out, r_max)``.  Every HF projection has
its own LoRA pair, as Tinker trains them (``q, k, v, o, gate, up, down`` and the unembedding):
megatron's fused ``linear_qkv`` holds three parts (q, k, v) and ``linear_fc1`` two (gate, up),
each with its own ``A``; output row ``o`` belongs to part ``p(o)`` (qkv rows are interleaved per
GQA group, see ``convert.fuse_qkv``) and its row of ``B`` multiplies that part's ``A x`` only.
A slot of rank ``r`` therefore trains ``r * (in + out)`` parameters per HF projection, the
count of ``tinker_cookbook.hyperparam_utils.get_lora_param_count``.  The forward keeps one GEMM
per factor: ``h = x @ [A_q; A_k; A_v]^T`` (``[T, parts*r]``), then ``h @ B_bd^T`` with the
block-diagonal ``B_bd[o, p*r:(p+1)*r] = B[o]`` for ``p = p(o)`` (zeros elsewhere: constants
that pass no gradient to ``B``, and whose products with the slot's own ``h`` add exactly
nothing while ``h`` is finite).  That GEMM spends ``parts`` times the FLOPs of
separate ones on ``B``, for one kernel instead of ``parts``.

Ranks above a slot's rank are masked out by slicing, so those rows stay exactly zero.
``alpha = LORA_ALPHA = 32`` is chosen by the server for every slot (clients pick only the
rank), so ``scaling = 32 / rank``; it multiplies ``B`` in the adapters' own precision (fp32)
before ``B`` is cast to the compute dtype, so a bf16 forward never rounds the scaling itself.
A slot enables the attention modules (``train_attn``: qkv, proj), the MLP modules
(``train_mlp``: fc1, fc2) and the unembedding (``train_unembed``: output_layer) independently.

Compute copies: the fp32 ``lora_A``/``lora_B`` are the master values (the optimizer steps them
and every gradient accumulates in their ``.grad``, in fp32). The forward reads persistent
copies in the model's dtype instead: ``compute_A [slots+1, width, in]`` (every part's ``A``,
part after part, ``r_max`` rows each) and ``compute_B [slots+1, out, width]``, the scaled
block-diagonal ``B_bd`` (``width = parts*r_max`` rounded up to 16 bytes, the grouped kernel's
alignment; the extra entry ``slots`` is all zero, the one a segment whose slot does not train
the module uses). ``AdapterPool.refresh`` writes a slot's copies from its masters after every
change of its values (slot init, clear and load, ``optim_step``); a direct in-place write to a
master (it bumps the parameter's version counter) is caught before the next forward. The
copies enter autograd as constants whose gradient (``_Attached``) is added straight into the
master ``.grad`` rows of the slot and rank it belongs to (the diagonal blocks of ``B_bd``'s
gradient, times the slot's scaling, in fp32): no per-step cast, no per-step block-diagonal
build, no fp32 copy of an activation.

Tensor parallelism follows the base layer: for a column-parallel base (qkv, fc1, output) ``A``
is replicated and ``B`` holds this rank's output rows, and the rank-r activation passes
``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward) so ``A``'s
gradient is complete and identical on every rank.  For a row-parallel base (proj, fc2) ``A``
holds this rank's input columns, the rank-r activation passes
``reduce_from_tensor_model_parallel_region`` (all-reduce forward), and ``B`` is replicated.

Initialisation: every part's ``A`` is drawn from a ``torch.Generator`` seeded with the slot's
seed (uniform in +-1/sqrt(in_features), the kaiming-uniform(a=sqrt(5)) bound PEFT uses), full
size, then sharded, so every TP size yields the same adapter.  ``B = 0``: the adapted model starts
exactly equal to the base model, while the non-zero ``A`` still gives ``B`` a non-zero
gradient on the first step (were both zero, neither would ever move).

Packed batches: the engine sets ``SlotRouting.segments``, contiguous token ranges of one slot
each (datums are sorted by slot before packing).  Every adapter computes its update per
segment with that slot's tensors; the base model runs once for the whole stream.

Tenant isolation: no arithmetic ever combines one slot's values with another slot's tokens.
A token's update is computed from its own slot's tensors only (per segment, or one grouped
matmul whose groups are the segments), never by computing every slot for every token and
masking: ``0 * inf`` is NaN, so a mask lets one tenant whose loss overflows turn every co-packed
tenant's gradients into NaN.  A slot's gradients are therefore bit-identical whatever the other
slots of the batch hold (``services/trainer/tests/test_isolation.py``).

Invariant: adapters attach to the model by forward hooks and live in ``AdapterPool`` (never in
the model's own parameters); a slot that is not initialised, and a module its config disables,
contribute exactly nothing and receive no gradient.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from libs.contracts.common import LoraConfig
from services.trainer.convert import ModelShape, ShardKind, fuse_glu, fuse_qkv, shard
from services.trainer.parallel import tp_rank, tp_size

LORA_ALPHA = 32.0


def lora_scaling(rank: int) -> float:
    """PEFT's ``lora_alpha / r``: the factor on every adapter's output."""
    return LORA_ALPHA / rank


@dataclass(frozen=True)
class Segment:
    """Tokens ``[start, end)`` of the packed stream all belong to ``slot``."""

    slot: int
    start: int
    end: int


@dataclass(frozen=True)
class TargetSpec:
    """Where one adapted linear sits and how its adapter is laid out."""

    path: str  # megatron module path, e.g. "decoder.layers.0.self_attention.linear_qkv"
    group: str  # "attn" | "mlp" | "unembed"
    in_features: int  # full (TP=1) sizes
    out_features: int
    a_kind: ShardKind  # how lora_A (r, in) of each part is sharded over TP
    b_kind: ShardKind  # how lora_B (out, r) is sharded over TP
    parts: tuple[int, ...] = ()  # output rows of each HF projection fused here (empty: one)

    @property
    def num_parts(self) -> int:
        return max(1, len(self.parts))

    @property
    def column_parallel(self) -> bool:
        return self.a_kind is ShardKind.REPLICATED


def adapter_targets(shape: ModelShape) -> list[TargetSpec]:
    """Every adapted linear of the model, in canonical order (layer by layer, then output)."""
    rep, col, glu, row = ShardKind.REPLICATED, ShardKind.COLUMN, ShardKind.COLUMN_GLU, ShardKind.ROW
    h, d = shape.hidden_size, shape.head_dim
    targets: list[TargetSpec] = []
    for i in range(shape.num_layers):
        pre = f"decoder.layers.{i}."
        targets += [
            TargetSpec(
                pre + "self_attention.linear_qkv",
                "attn",
                h,
                (shape.num_heads + 2 * shape.num_groups) * d,
                rep,
                col,
                (shape.num_heads * d, shape.num_groups * d, shape.num_groups * d),  # q, k, v
            ),
            TargetSpec(pre + "self_attention.linear_proj", "attn", shape.num_heads * d, h, row, rep),
            TargetSpec(
                pre + "mlp.linear_fc1",
                "mlp",
                h,
                2 * shape.ffn_hidden_size,
                rep,
                glu,
                (shape.ffn_hidden_size, shape.ffn_hidden_size),  # gate, up
            ),
            TargetSpec(pre + "mlp.linear_fc2", "mlp", shape.ffn_hidden_size, h, row, rep),
        ]
    targets.append(TargetSpec("output_layer", "unembed", h, shape.vocab_size, rep, col))
    return targets


def _local(size: int, kind: ShardKind, dim_is_split: bool) -> int:
    return size // tp_size() if dim_is_split and kind is not ShardKind.REPLICATED else size


def row_parts(target: TargetSpec, shape: ModelShape) -> torch.Tensor | None:
    """For each output row of this TP rank's ``B``, the index of the part it belongs to (None
    for an unfused target): the full layout's part of every row, sharded like ``B`` itself."""
    if target.num_parts == 1:
        return None
    labels = [torch.full((rows,), p, dtype=torch.int64) for p, rows in enumerate(target.parts)]
    full = fuse_qkv(labels[0], labels[1], labels[2], shape) if len(labels) == 3 else fuse_glu(labels[0], labels[1])
    return shard(full, target.b_kind, tp_rank(), tp_size())


class _Attached(torch.autograd.Function):
    """``value`` (a compute copy: a constant) on the autograd graph, its gradient handed to
    ``sink``, which adds it into the fp32 master gradients. ``anchor`` (a tensor that requires
    grad, and never receives one) only puts the node on the graph."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, anchor: torch.Tensor, value: torch.Tensor, sink: Callable[[torch.Tensor], None]
    ) -> torch.Tensor:
        ctx.sink = sink
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:  # type: ignore[override]
        ctx.sink(grad)
        return None, None, None


def _as(copy: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A compute copy in ``dtype``: itself in the model's dtype (the engine's case), else a cast."""
    return copy if copy.dtype == dtype else copy.to(dtype)


def _master_grad(param: nn.Parameter) -> torch.Tensor:
    """``param.grad``, allocated (zeros, fp32) on first use and kept: gradients accumulate there."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


class SlotRouting:
    """Which slot each token of the current forward belongs to (set by the engine)."""

    def __init__(self, num_slots: int = 0, max_rank: int = 0) -> None:
        self.segments: list[Segment] = []
        self.configs: dict[int, LoraConfig] = {}
        self.num_slots = num_slots  # also the index of the compute copies' all-zero entry
        self.max_rank = max_rank
        self.stacked = False  # several slots at once: one grouped matmul (GPU) or per-segment (CPU)
        self._groups: dict[tuple[Any, ...], GroupLayout] = {}
        self._groups_for: list[Segment] | None = None

    def group_layout(self, group: str, x: torch.Tensor) -> GroupLayout:
        """Every segment as one group of a grouped matmul, for the adapters of ``group``.

        Built once per forward and module group on the host and copied to the device once, so
        the adapters of every layer reuse it with no host round trip.
        """
        if self._groups_for is not self.segments:
            self._groups, self._groups_for = {}, self.segments
        key = (group, x.device)
        if key not in self._groups:
            entries = [
                seg.slot if self.configs[seg.slot].trains(group) else self.num_slots for seg in self.segments
            ]
            active = [
                (g, seg.slot, self.configs[seg.slot].rank)
                for g, seg in enumerate(self.segments)
                if self.configs[seg.slot].trains(group)
            ]
            first = entries[0]
            consecutive = entries == list(range(first, first + len(entries)))
            self._groups[key] = GroupLayout(
                entries=torch.tensor(entries, device=x.device),
                span=(first, first + len(entries)) if consecutive else None,
                active=tuple(active),
                active_groups=torch.tensor([g for g, _, _ in active], device=x.device),
                active_slots=torch.tensor([s for _, s, _ in active], device=x.device),
                active_scale=torch.tensor(
                    [lora_scaling(r) for _, _, r in active], dtype=torch.float64, device=x.device
                ).to(torch.float32),
                full_rank=all(r == self.max_rank for _, _, r in active),
                offsets=torch.tensor([seg.end for seg in self.segments], dtype=torch.int32, device=x.device),
            )
        return self._groups[key]


@dataclass(frozen=True)
class GroupLayout:
    """The grouped-matmul layout of one forward for one module group.

    Segment ``g`` of the packed stream ends at row ``offsets[g]`` and uses compute-copy entry
    ``entries[g]``: its slot, or the all-zero entry for a slot that does not train the module.
    ``active`` lists ``(group, slot, rank)`` of the segments that do (their slot's ``alpha/rank``
    in ``active_scale``, fp32, the adapters' precision).
    """

    entries: torch.Tensor  # [G] int64
    span: tuple[int, int] | None  # entries are exactly range(*span): a view, no gather
    active: tuple[tuple[int, int, int], ...]
    active_groups: torch.Tensor  # [G'] int64
    active_slots: torch.Tensor  # [G'] int64
    active_scale: torch.Tensor  # [G'] float32
    full_rank: bool  # every active slot's rank is the pool's: whole rows, one index_add
    offsets: torch.Tensor  # [G] int32, cumulative; the last one is T


_GROUPED_OK: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs here for ``x``'s device and dtype (checked once each).

    It runs on CPU for any float dtype, and on CUDA for bf16 on SM90+ with alignment rules. A
    small forward and backward with uneven groups is tried once per (device type, dtype); where
    it raises or disagrees with the plain per-group products, the per-segment path is used.
    """
    key = (x.device.type, x.dtype)
    if key not in _GROUPED_OK:
        _GROUPED_OK[key] = hasattr(torch, "_grouped_mm") and _probe_grouped_mm(x.device, x.dtype)
    return _GROUPED_OK[key]


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type == "cuda" and (dtype != torch.bfloat16 or torch.cuda.get_device_capability(device)[0] < 9):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(13, 16, generator=gen).to(device, dtype).requires_grad_()
        w = torch.randn(3, 8, 16, generator=gen).to(device, dtype).requires_grad_()  # [G, r, in]
        offsets = torch.tensor([5, 5, 13], dtype=torch.int32, device=device)  # an empty group too
        y = torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)
        y.backward(torch.ones_like(y))
        ref = torch.cat([x[:5] @ w[0].t(), x[5:13] @ w[2].t()])
        tolerance = 5e-2 if dtype == torch.bfloat16 else 1e-4
        return bool((y.float() - ref.float()).abs().max() <= tolerance * max(1.0, float(ref.float().abs().max())))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


class SlotAdapter(nn.Module):
    """The slot-indexed LoRA tensors of one adapted linear, their compute copies and the
    forward-hook math."""

    def __init__(
        self,
        target: TargetSpec,
        shape: ModelShape,
        num_slots: int,
        max_rank: int,
        routing: SlotRouting,
        anchor: torch.Tensor,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.target = target
        self.routing = routing
        self.anchor = anchor
        self.max_rank = max_rank
        self.parts = target.num_parts
        in_local = _local(target.in_features, target.a_kind, dim_is_split=True)
        out_local = _local(target.out_features, target.b_kind, dim_is_split=True)
        # (slots, parts, r_max, in) and (slots, out, r_max); fp32 whatever the model's dtype
        self.lora_A = nn.Parameter(torch.zeros(num_slots, self.parts, max_rank, in_local, device=device))
        self.lora_B = nn.Parameter(torch.zeros(num_slots, out_local, max_rank, device=device))
        align = max(1, 16 // torch.empty((), dtype=dtype).element_size())
        self.width = -(-self.parts * max_rank // align) * align
        self.compute_A: torch.Tensor
        self.compute_B: torch.Tensor
        self.register_buffer(
            "compute_A", torch.zeros(num_slots + 1, self.width, in_local, device=device, dtype=dtype), persistent=False
        )
        self.register_buffer(
            "compute_B", torch.zeros(num_slots + 1, out_local, self.width, device=device, dtype=dtype), persistent=False
        )
        self._synced = (self.lora_A._version, self.lora_B._version)
        parts = row_parts(target, shape)
        self.part_mask: torch.Tensor | None
        self.diag_index: torch.Tensor | None
        if parts is None:
            self.part_mask = None
            self.diag_index = None
        else:  # [out, parts] one-hot of each local row's part; [out, r_max] its columns in B_bd
            mask = parts.view(-1, 1) == torch.arange(self.parts).view(1, -1)
            self.register_buffer("part_mask", mask.to(device), persistent=False)
            index = parts.view(-1, 1) * max_rank + torch.arange(max_rank).view(1, -1)
            self.register_buffer("diag_index", index.to(device), persistent=False)

    # ---- compute copies ----

    def refresh(self, start: int, stop: int, scale: float) -> None:
        """Write the compute copies of slots ``[start, stop)`` (all of one rank, whose scaling is
        ``scale``) from their masters: ``A`` cast, ``scale * B`` placed on the block diagonal."""
        with torch.no_grad():
            a = self.lora_A.data[start:stop].flatten(1, 2)  # [n, parts*r_max, in]
            self.compute_A[start:stop, : a.shape[1]].copy_(a)
            b = (self.lora_B.data[start:stop] * scale).to(self.compute_B.dtype)  # [n, out, r_max]
            if self.diag_index is None:
                self.compute_B[start:stop, :, : self.max_rank].copy_(b)
            else:
                index = self.diag_index.expand(stop - start, *self.diag_index.shape)
                self.compute_B[start:stop].scatter_(2, index, b)

    def refresh_slots(self, slots: Iterable[int]) -> None:
        """Bring the compute copies of ``slots`` up to date with their masters (a slot that is
        not initialised gets zero copies); consecutive slots of one rank share the kernels."""
        configs = self.routing.configs
        for start, stop in _rank_runs(slots, configs):
            if start in configs:
                self.refresh(start, stop, lora_scaling(configs[start].rank))
            else:
                with torch.no_grad():
                    self.compute_A[start:stop].zero_()
                    self.compute_B[start:stop].zero_()

    def ensure_synced(self) -> None:
        """Refresh every slot's copies if a master was written in place since the last refresh
        (the engine refreshes the slots it changes itself; this catches any other writer)."""
        if (self.lora_A._version, self.lora_B._version) != self._synced:
            self.refresh_slots(range(self.routing.num_slots))
            self._synced = (self.lora_A._version, self.lora_B._version)

    def _diagonal(self, grad_b: torch.Tensor) -> torch.Tensor:
        """``[.., out, r_max]``: each row's own block of a ``B_bd`` gradient ``[.., out, width]``
        (a gather: the other blocks' entries are never read)."""
        if self.diag_index is None:
            return grad_b[..., : self.max_rank]
        return grad_b.gather(-1, self.diag_index.expand(*grad_b.shape[:-1], self.max_rank))

    def _sink_a(self, slot: int, rank: int) -> Callable[[torch.Tensor], None]:
        def sink(grad: torch.Tensor) -> None:  # [width, in]
            rows = grad[: self.parts * self.max_rank].view(self.parts, self.max_rank, -1)[:, :rank]
            _master_grad(self.lora_A)[slot, :, :rank].add_(rows)

        return sink

    def _sink_b(self, slot: int, rank: int) -> Callable[[torch.Tensor], None]:
        scale = lora_scaling(rank)

        def sink(grad: torch.Tensor) -> None:  # [out, width]
            own = self._diagonal(grad)[:, :rank].float() * scale
            _master_grad(self.lora_B)[slot, :, :rank].add_(own)

        return sink

    def plain_weights(self, slot: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A [width, in], B_bd [out, width])`` of ``slot``, on the graph, in ``dtype`` (the
        copies' own, the model's; another one is a cast of them)."""
        self.ensure_synced()
        rank = self.routing.configs[slot].rank
        a = _Attached.apply(self.anchor, _as(self.compute_A[slot], dtype), self._sink_a(slot, rank))
        b = _Attached.apply(self.anchor, _as(self.compute_B[slot], dtype), self._sink_b(slot, rank))
        return a, b

    def _exact(self, slot: int, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A [parts*rank, in], B_bd [out, parts*rank])``: the slot's own rank only."""
        a, b = self.plain_weights(slot, dtype)
        width = self.parts * self.max_rank
        a = a[:width].view(self.parts, self.max_rank, -1)[:, :rank].reshape(self.parts * rank, -1)
        b = b[:, :width].view(b.shape[0], self.parts, self.max_rank)[:, :, :rank].reshape(b.shape[0], -1)
        return a, b

    def delta(self, x: torch.Tensor) -> torch.Tensor | None:
        """The LoRA update for the packed activations ``x: [T, 1, in_local]``, or None.

        One slot covering the whole batch takes a plain path. Several slots: with
        ``routing.stacked`` (the GPU default) one grouped matmul per projection whose groups are
        the segments (``torch._grouped_mm``): a fixed number of kernels however many tenants
        share the batch, and exactly each slot's own products; otherwise (the CPU default, or
        where grouped matmuls are not available) one small matmul per segment, at the slot's own
        rank.  Either way a token only ever meets its own slot's tensors (see the module
        docstring on isolation).
        """
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        region = (
            copy_to_tensor_model_parallel_region
            if self.target.column_parallel
            else reduce_from_tensor_model_parallel_region
        )  # one collective per module and forward; every TP rank sees the same segments
        self.ensure_synced()
        routing, group = self.routing, self.target.group
        active = [s for s in routing.segments if routing.configs[s.slot].trains(group)]
        if not active:
            return None
        slots = sorted({s.slot for s in active})
        covered = sum(s.end - s.start for s in active) == x.shape[0]
        # Plain 2-D matmuls: ``[T, 1, in] @ [in, r]`` would take a different kernel (and
        # rounding) with and without autograd, so forward_only would differ from forward_backward.
        rows = x.reshape(x.shape[0], x.shape[-1])  # [T, in]
        if len(slots) == 1 and covered:
            a, b = self.plain_weights(slots[0], rows.dtype)  # [width, in], [out, width]
            out = region(rows @ a.t()) @ b.t()  # [T, out]
        elif routing.stacked and grouped_mm_supported(x):
            out = self._grouped(rows, region)
        else:
            out = self._per_segment(rows, region)
        return out.unsqueeze(1)  # [T, 1, out]

    def _grouped(self, rows: torch.Tensor, region: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Both factors as grouped matmuls over the segments (one kernel each), on the compute
        copies at their full width (every slot's rows/columns past its rank are zero). Each
        slot's ``alpha/rank`` is already in its ``B`` copy (finite weights times a finite
        number), never on the activations, so nothing multiplies another slot's values."""
        layout = self.routing.group_layout(self.target.group, rows)
        if layout.span is not None:
            a_all = self.compute_A[layout.span[0] : layout.span[1]]  # [G, width, in]: a view
            b_all = self.compute_B[layout.span[0] : layout.span[1]]  # [G, out, width]
        else:
            a_all = self.compute_A.index_select(0, layout.entries)
            b_all = self.compute_B.index_select(0, layout.entries)
        a_all, b_all = _as(a_all, rows.dtype), _as(b_all, rows.dtype)
        a = _Attached.apply(self.anchor, a_all, functools.partial(self._grouped_sink_a, layout))
        b = _Attached.apply(self.anchor, b_all, functools.partial(self._grouped_sink_b, layout))
        h = region(torch._grouped_mm(rows, a.transpose(1, 2), offs=layout.offsets))  # [T, width]
        return torch._grouped_mm(h, b.transpose(1, 2), offs=layout.offsets)  # [T, out]

    def _grouped_sink_a(self, layout: GroupLayout, grad: torch.Tensor) -> None:  # [G, width, in]
        if not layout.active:
            return
        full = self.parts * self.max_rank
        master = _master_grad(self.lora_A)
        if layout.full_rank:
            picked = grad.index_select(0, layout.active_groups)[:, :full].float()  # [G', parts*r_max, in]
            master.view(master.shape[0], full, -1).index_add_(0, layout.active_slots, picked)
            return
        for g, slot, rank in layout.active:
            rows = grad[g, :full].view(self.parts, self.max_rank, -1)[:, :rank]
            master[slot, :, :rank].add_(rows)

    def _grouped_sink_b(self, layout: GroupLayout, grad: torch.Tensor) -> None:  # [G, out, width]
        if not layout.active:
            return
        master = _master_grad(self.lora_B)
        own = self._diagonal(grad.index_select(0, layout.active_groups))  # [G', out, r_max]
        if layout.full_rank:
            scaled = own.float() * layout.active_scale.view(-1, 1, 1)
            master.index_add_(0, layout.active_slots, scaled)
            return
        for i, (_, slot, rank) in enumerate(layout.active):
            master[slot, :, :rank].add_(own[i, :, :rank].float() * lora_scaling(rank))

    def _per_segment(self, rows: torch.Tensor, region: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Each slot's segment through its own adapter at its own rank: exact LoRA FLOPs, but
        kernels per segment. The better trade on a CPU, where FLOPs cost more than launches
        (docs/benchmarks.md).
        """
        routing = self.routing
        rank_of = {
            s.slot: routing.configs[s.slot].rank if routing.configs[s.slot].trains(self.target.group) else 0
            for s in routing.segments
        }
        width = self.parts * max(rank_of.values())
        weights = {slot: self._exact(slot, rank, rows.dtype) for slot, rank in rank_of.items() if rank}
        hidden = []
        for seg in routing.segments:
            if not rank_of[seg.slot]:
                hidden.append(rows.new_zeros(seg.end - seg.start, width))
                continue
            a = weights[seg.slot][0]  # [parts*rank, in]
            h_seg = rows[seg.start : seg.end] @ a.t()  # [t, parts*rank]
            hidden.append(torch.nn.functional.pad(h_seg, (0, width - a.shape[0])))  # [t, width]
        h = region(torch.cat(hidden, dim=0))  # [T, width]: one collective per module and forward
        out = []
        for seg in routing.segments:
            rank = rank_of[seg.slot]
            if not rank:
                out.append(rows.new_zeros(seg.end - seg.start, self.compute_B.shape[1]))
                continue
            b = weights[seg.slot][1]  # [out, parts*rank]
            out.append(h[seg.start : seg.end, : self.parts * rank] @ b.t())  # [t, out]
        return torch.cat(out, dim=0)  # [T, out]

    def hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        update = self.delta(args[0])
        if update is None:
            return output
        base, bias = output
        return base + update.to(base.dtype), bias


def _rank_runs(slots: Iterable[int], configs: dict[int, LoraConfig]) -> list[tuple[int, int]]:
    """``[start, stop)`` of each maximal run of consecutive ``slots`` that share their rank (or
    are all uninitialised)."""
    runs: list[tuple[int, int]] = []
    key: Any = object()
    for slot in sorted(set(slots)):
        this = configs[slot].rank if slot in configs else None
        if runs and runs[-1][1] == slot and this == key:
            runs[-1] = (runs[-1][0], slot + 1)
        else:
            runs.append((slot, slot + 1))
            key = this
    return runs


@dataclass(frozen=True)
class SlotTensor:
    """One of a slot's adapter tensors: a view into a slot-indexed parameter."""

    name: str  # e.g. "decoder.layers.0.mlp.linear_fc1.lora_A"
    param: nn.Parameter
    index: tuple[Any, ...]  # selects this slot's rows (and rank) inside ``param``
    kind: ShardKind  # how the full tensor is split over TP ranks

    def value(self) -> torch.Tensor:
        return self.param.data[self.index]

    def grad(self) -> torch.Tensor | None:
        return None if self.param.grad is None else self.param.grad[self.index]


class AdapterPool(nn.Module):
    """All slot adapters of one model, their routing, and each slot's configuration."""

    def __init__(
        self,
        shape: ModelShape,
        num_slots: int,
        max_rank: int,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """``dtype``: the model's compute dtype, that of the adapters' compute copies."""
        super().__init__()
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.routing = SlotRouting(num_slots, max_rank)
        self.targets = adapter_targets(shape)
        # puts the compute copies on the autograd graph (see _Attached); never gets a gradient
        self.anchor = torch.zeros((), device=device, requires_grad=True)
        self.adapters = nn.ModuleDict(
            {
                _key(t.path): SlotAdapter(t, shape, num_slots, max_rank, self.routing, self.anchor, device, dtype)
                for t in self.targets
            }
        )
        # Every master's gradient is a block of one flat fp32 buffer (zeros, allocated here, the
        # memory the first backward used to allocate): the optimizer reduces the whole buffer in
        # one kernel for every slot's gradient norm (optim._flat_chunks).
        params = list(self.parameters())
        flat = torch.zeros(sum(p.numel() for p in params), device=device)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self._handles: list[Any] = []
        self._refresh_views: dict[tuple[int, int], tuple[Any, ...]] = {}  # see _run_views
        # slot -> (the config its tensors were listed for, the list): see slot_tensors
        self._slot_tensors: dict[int, tuple[LoraConfig, list[SlotTensor]]] = {}

    @property
    def configs(self) -> dict[int, LoraConfig]:
        return self.routing.configs

    def adapter(self, path: str) -> SlotAdapter:
        module = self.adapters[_key(path)]
        assert isinstance(module, SlotAdapter)
        return module

    def attach(self, model: nn.Module) -> None:
        """Register one forward hook per adapted linear of ``model``."""
        modules = dict(model.named_modules())
        for target in self.targets:
            hook: Callable[..., Any] = self.adapter(target.path).hook
            self._handles.append(modules[target.path].register_forward_hook(hook))

    def init_slot(self, slot: int, config: LoraConfig) -> None:
        """Fresh adapter for ``slot``: seeded A on enabled modules, every other entry zero."""
        if config.seed is None:
            raise ValueError("a slot's LoRA config needs a seed (the trainer derives one per model)")
        self._check_slot(slot)
        if not 1 <= config.rank <= self.max_rank:
            raise ValueError(f"rank {config.rank} outside [1, {self.max_rank}]")
        self.clear_slot(slot)
        gen = torch.Generator(device="cpu").manual_seed(config.seed)
        with torch.no_grad():
            for target in self.targets:
                bound = 1.0 / math.sqrt(target.in_features)
                a = self.adapter(target.path).lora_A
                for part in range(target.num_parts):
                    full = (
                        torch.rand(config.rank, target.in_features, generator=gen) * (2 * bound) - bound
                    )  # [r, in]
                    if config.trains(target.group):
                        a[slot, part, : config.rank] = shard(full, target.a_kind, tp_rank(), tp_size()).to(a.device)
        self.routing.configs[slot] = config
        self.refresh([slot])

    def refresh(self, slots: Iterable[int]) -> None:
        """Write the compute copies of ``slots`` from their master values: after anything
        changes them other than through the parameters themselves (``optim_step``, a load).

        Per run of consecutive initialised slots of one rank, every adapter at once: one
        multi-tensor copy for all ``A`` (cast), one multi-tensor product for all ``B`` by the
        scaling (fp32), one multi-tensor copy for the unfused ``B``, and one cast and scatter
        per fused ``B`` (its block diagonal); the same values as ``SlotAdapter.refresh``."""
        configs = self.routing.configs
        modules = [m for m in self.adapters.values() if isinstance(m, SlotAdapter)]
        for start, stop in _rank_runs(slots, configs):
            if start not in configs:
                for module in modules:
                    module.refresh_slots(range(start, stop))
                continue
            dst_a, src_a, src_b, dst_plain, plain, fused = self._run_views(modules, start, stop)
            with torch.no_grad():
                torch._foreach_copy_(dst_a, src_a)
                scaled = torch._foreach_mul(src_b, lora_scaling(configs[start].rank))  # fp32
                torch._foreach_copy_(dst_plain, [scaled[i] for i in plain])
                for i, dst, index in fused:
                    dst.scatter_(2, index, scaled[i].to(dst.dtype))
        for module in modules:
            module.ensure_synced()  # a write through the parameter itself, too

    def _run_views(self, modules: list[SlotAdapter], start: int, stop: int) -> tuple[Any, ...]:
        """The views ``refresh`` writes and reads for slots ``[start, stop)`` (kept: slicing a
        few hundred parameters costs more host time than the copies themselves)."""
        key = (start, stop)
        if key not in self._refresh_views:
            if len(self._refresh_views) > 64:
                self._refresh_views.clear()
            dst_a, src_a, src_b, dst_plain, plain, fused = [], [], [], [], [], []
            for i, m in enumerate(modules):
                a = m.lora_A.data[start:stop].flatten(1, 2)  # [n, parts*r_max, in]
                src_a.append(a)
                dst_a.append(m.compute_A[start:stop, : a.shape[1]])
                src_b.append(m.lora_B.data[start:stop])  # [n, out, r_max]
                if m.diag_index is None:
                    plain.append(i)
                    dst_plain.append(m.compute_B[start:stop, :, : m.max_rank])
                else:
                    index = m.diag_index.expand(stop - start, *m.diag_index.shape)
                    fused.append((i, m.compute_B[start:stop], index))
            self._refresh_views[key] = (dst_a, src_a, src_b, dst_plain, plain, fused)
        return self._refresh_views[key]

    def clear_slot(self, slot: int) -> None:
        """Zero the slot's tensors and gradients and forget its config."""
        self._check_slot(slot)
        with torch.no_grad():
            for module in self.adapters.values():
                assert isinstance(module, SlotAdapter)
                for p in (module.lora_A, module.lora_B):
                    p.data[slot].zero_()
                    if p.grad is not None:
                        p.grad[slot].zero_()
                module.compute_A[slot].zero_()
                module.compute_B[slot].zero_()
        self.routing.configs.pop(slot, None)

    def slot_tensors(self, slot: int) -> list[SlotTensor]:
        """The adapter tensors ``slot`` trains (its rank, its enabled modules), canonical order.

        ``lora_A`` of a fused target is ``[parts, r, in]`` (one ``A`` per HF projection, in the
        order of ``TargetSpec.parts``), of any other ``[r, in]``; ``lora_B`` is ``[out, r]``.

        The list is built once per slot and configuration and the same list object is returned
        while ``configs[slot]`` is the same object (a ``SlotTensor`` holds its parameter and an
        index, never a view, so it stays valid while the pool's parameters do): callers must not
        change it. Listing a slot's few hundred tensors costs more host time than a GPU step of
        them (``SlotAdamW`` also keys its cached views on the list's identity)."""
        config = self.routing.configs[slot]
        cached = self._slot_tensors.get(slot)
        if cached is not None and cached[0] is config:
            return cached[1]
        tensors: list[SlotTensor] = []
        for target in self.targets:
            if not config.trains(target.group):
                continue
            module = self.adapter(target.path)
            r = config.rank
            part: int | slice = slice(None) if target.num_parts > 1 else 0
            tensors.append(
                SlotTensor(f"{target.path}.lora_A", module.lora_A, (slot, part, slice(0, r)), target.a_kind)
            )
            tensors.append(
                SlotTensor(
                    f"{target.path}.lora_B", module.lora_B, (slot, slice(None), slice(0, r)), target.b_kind
                )
            )
        self._slot_tensors[slot] = (config, tensors)
        return tensors

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} outside [0, {self.num_slots})")


def _key(path: str) -> str:
    return path.replace(".", "/")  # ModuleDict keys may not contain "."
