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
block-diagonal ``B_bd[o, p*r:(p+1)*r] = B[o]`` for ``p = p(o)`` (zeros elsewhere, selected by
``factor_rows.block_diagonal``: constants that receive no gradient, and whose products with the
slot's own ``h`` add exactly nothing while ``h`` is finite).  That GEMM spends ``parts`` times the FLOPs of
separate ones on ``B``, for one kernel instead of ``parts``.

Ranks above a slot's rank are masked out by slicing, so those rows stay exactly zero.
``alpha = LORA_ALPHA = 32`` is chosen by the server for every slot (clients pick only the
rank), so ``scaling = 32 / rank``; on every path it multiplies ``B`` in the adapters' own
precision (fp32) before ``B`` is cast to the compute dtype, so a bf16 forward never rounds the
scaling itself.  A slot enables the attention modules (``train_attn``: qkv, proj), the MLP
modules (``train_mlp``: fc1, fc2) and the unembedding (``train_unembed``: output_layer)
independently.

Storage (``PooledRows``): every slot's tensors are one row of slot-major fp32 buffers (values and
gradients), and the parameters are views of them. The forward reads its weights from a compute
copy of the routed slots' rows (``compute_rows``: cast once per forward, ``B`` scaled there), and
each weight's gradient is added into the slot's fp32 gradient row by the backward itself
(``_ToRows``), so a step casts, scales and scatters nothing per tensor.

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

Base products and input gradients: at TP=1, where one slot covers a step (``_AdaptedLinear``) or
the grouped matmuls serve several (``_GroupedAdaptedLinear``), the adapter computes the adapted
linear's output and its input's whole gradient itself (``SlotAdapter.pre_hook`` hands the frozen
linear its input detached): the base and LoRA parts of each in one GEMM and its epilogue, instead
of autograd adding two gradients. Where ``base_in_epilogue`` holds (on CUDA) the frozen linear is
handed no rows at all, and the base GEMM adds the LoRA term, written first, as it writes its output.

Invariant: adapters attach to the model by forward hooks and live in ``AdapterPool`` (never in
the model's own parameters); a slot that is not initialised, and a module its config disables,
contribute exactly nothing and receive no gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from libs.contracts.common import LoraConfig
from services.trainer import factor_rows, grouped_addmm
from services.trainer.convert import ModelShape, ShardKind, fuse_glu, fuse_qkv, shard
from services.trainer.host_copy import to_device
from services.trainer.parallel import tp_rank, tp_size
from services.trainer.probes import KernelProbe

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


class SlotRouting:
    """Which slot each token of the current forward belongs to (set by the engine)."""

    def __init__(self) -> None:
        self._segments: list[Segment] = []
        self.generation = 0  # changes whenever the segments are set: one per forward
        self.configs: dict[int, LoraConfig] = {}
        # A static step's slots, named by device tensors instead of numbers (``StaticRouting``)
        self.static: StaticRouting | None = None
        self.stacked = False  # several slots at once: one grouped matmul (GPU) or per-segment (CPU)
        # Per adapter (``id``), the input its ``pre_hook`` kept from the base linear for its
        # ``hook``: (x, its sole slot or None for the grouped matmuls, base_in_epilogue). Dropped
        # with the forward's segments, so a forward that fails between the two hooks (out of
        # memory) keeps no activations, and their autograd graph, alive into the next one.
        self.handed_inputs: dict[int, tuple[torch.Tensor, int | None, bool]] = {}
        self._groups: dict[tuple[Any, ...], GroupLayout] = {}
        self._groups_for: list[Segment] | None = None

    @property
    def segments(self) -> list[Segment]:
        return self._segments

    @segments.setter
    def segments(self, value: list[Segment]) -> None:
        self._segments = value
        self.generation += 1
        self.handed_inputs = {}

    def group_layout(self, group: str, x: torch.Tensor) -> GroupLayout:
        """Every segment as one group of a grouped matmul, for the adapters of ``group``.

        Built once per forward and module group on the host and copied to the device once, so
        the adapters of every layer reuse it with no host round trip; a static step's comes from
        its device tensors (``StaticRouting``: every one of its slots trains ``group``).
        """
        if self._groups_for is not self.segments:
            self._groups, self._groups_for = {}, self.segments
        key = (group, x.device)
        if key not in self._groups and self.static is not None:
            st = self.static
            rank = max(self.configs[seg.slot].rank for seg in self.segments)
            self._groups[key] = GroupLayout(
                rank=rank,
                source=st.source,
                offsets=st.offsets,
                real=st.source,
                real_slots=st.slots,
                real_scale=st.scales,
                every=True,
                scale=None,  # the recording serves slots of other ranks: the scales stay tensors
                identity=True,  # segment g is the static step's slot g: compute row g
            )
        if key not in self._groups:
            slots = sorted({s.slot for s in self.segments if self.configs[s.slot].trains(group)})
            routed = routed_slots(self)
            source = [
                routed.index(seg.slot) if self.configs[seg.slot].trains(group) else len(routed)
                for seg in self.segments
            ]  # len(routed): the compute rows' all-zero row
            real = [g for g, row in enumerate(source) if row < len(routed)]
            scales = [lora_scaling(self.configs[self.segments[g].slot].rank) for g in real]
            real_slots = [self.segments[g].slot for g in real]
            consecutive = real_slots == list(range(real_slots[0], real_slots[0] + len(real_slots)))
            self._groups[key] = GroupLayout(
                rank=max(self.configs[s].rank for s in slots),
                source=to_device(source, x.device),
                offsets=to_device([seg.end for seg in self.segments], x.device, torch.int32),
                real=to_device(real, x.device),
                real_slots=to_device(real_slots, x.device),
                real_scale=to_device(scales, x.device),
                every=len(real) == len(self.segments),
                scale=scales[0] if len(set(scales)) == 1 else None,
                identity=source == list(range(len(source))),
                first_slot=real_slots[0] if consecutive else None,
            )
        return self._groups[key]


@dataclass(frozen=True)
class StaticRouting:
    """The routing of a static step (``step_graphs.py``): one segment per slot, in ascending slot
    order, the last one reaching the stream's end, each slot named by a device tensor's value
    rather than its number. A step recorded once (a CUDA graph) then serves any slots of the
    same shape: the tensors' values choose whose rows it reads and adds into."""

    slots: torch.Tensor  # [S] int64: segment g's slot
    scales: torch.Tensor  # [S] fp32: that slot's alpha/rank
    offsets: torch.Tensor  # [S] int32: segment g's end
    source: torch.Tensor  # [S] int64: 0..S-1, segment g's compute row


def routed_slots(routing: SlotRouting) -> list[int]:
    """The slots of the current forward, ascending (the order of ``PooledRows.compute_rows``)."""
    return sorted({seg.slot for seg in routing.segments})


@dataclass(frozen=True)
class GroupLayout:
    """The grouped-matmul layout of one forward for one module group.

    Segment ``g`` of the packed stream ends at row ``offsets[g]`` and takes its weights from row
    ``source[g]`` of the forward's compute rows (``PooledRows.compute_rows``): its slot's row, or
    the all-zero row after them for a slot that does not train these modules.
    """

    rank: int  # the largest rank among the slots that train these modules
    source: torch.Tensor  # [G] int64
    offsets: torch.Tensor  # [G] int32, cumulative; the last one is T
    real: torch.Tensor  # int64: the groups whose slot trains these modules
    real_slots: torch.Tensor  # int64: the slot of each of them (where its gradient goes)
    real_scale: torch.Tensor  # fp32: that slot's alpha/rank (its B's gradient is scaled by it)
    every: bool  # every group is real: a gradient needs no selection of its real groups
    scale: float | None  # the real groups' one alpha/rank where they share it
    identity: bool = False  # source is 0..G-1: the groups' weights are the first G compute rows
    first_slot: int | None = None  # the real groups' slots are this one and the next ones, in order


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs here for ``x``'s device and dtype (checked once each).

    It runs on CPU for any float dtype, and on CUDA for bf16 on SM90+ with alignment rules. A
    small forward and backward with uneven groups is tried once per (device type, dtype); where
    it raises or disagrees with the plain per-group products, the per-segment path is used.
    """
    if not hasattr(torch, "_grouped_mm") or (
        x.is_cuda and (x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 9)
    ):
        return False
    return GROUPED_MM.usable(x.device.type, x.dtype)


def _grouped_mm_mismatch(device_type: str, dtype: torch.dtype) -> str:
    """Why ``torch._grouped_mm`` may not serve ("" where a small grouped matmul with an empty
    group, forward and backward, agrees with the per-group products)."""
    device = torch.device(device_type)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(13, 16, generator=gen).to(device, dtype).requires_grad_()
    w = torch.randn(3, 8, 16, generator=gen).to(device, dtype).requires_grad_()  # [G, r, in]
    offsets = torch.tensor([5, 5, 13], dtype=torch.int32, device=device)  # an empty group too
    y = torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)
    y.backward(torch.ones_like(y))
    ref = torch.cat([x[:5] @ w[0].t(), x[5:13] @ w[2].t()])
    tolerance = 5e-2 if dtype == torch.bfloat16 else 1e-4
    if not bool((y.float() - ref.float()).abs().max() <= tolerance * max(1.0, float(ref.float().abs().max()))):
        return "differs from the per-group products"
    return ""


GROUPED_MM = KernelProbe("torch._grouped_mm", "one matmul per segment", _grouped_mm_mismatch)


class SlotAdapter(nn.Module):
    """The slot-indexed LoRA tensors of one adapted linear and its forward-hook math."""

    def __init__(
        self,
        target: TargetSpec,
        shape: ModelShape,
        num_slots: int,
        max_rank: int,
        routing: SlotRouting,
        device: str | torch.device,
        rows: PooledRows,
    ) -> None:
        super().__init__()
        self.target = target
        self.routing = routing
        self.rows = rows
        self.max_rank = max_rank
        self.parts = target.num_parts
        # (slots, parts, r_max, in) and (slots, out, r_max); fp32 whatever the model's dtype
        self.a_name, self.b_name = f"{target.path}.lora_A", f"{target.path}.lora_B"
        self.a_shape, self.b_shape = self.shapes(target, num_slots, max_rank)
        self.lora_A = rows.parameter(self.a_name, self.a_shape)
        self.lora_B = rows.parameter(self.b_name, self.b_shape)
        parts = row_parts(target, shape)
        self.part_mask: torch.Tensor | None  # [out, parts]: the one-hot of each local row's part
        self.row_part: torch.Tensor | None  # [out] int32: the part itself, for the CUDA kernels
        self.part_index: torch.Tensor | None  # [out, 1, r_max]: each row's part, for gathers
        if parts is None:
            self.part_mask = self.row_part = self.part_index = None
        else:
            mask = parts.view(-1, 1) == torch.arange(self.parts).view(1, -1)
            self.register_buffer("part_mask", mask.to(device), persistent=False)
            self.register_buffer("row_part", parts.to(device, torch.int32), persistent=False)
            index = parts.view(-1, 1, 1).expand(-1, 1, max_rank).contiguous()
            self.register_buffer("part_index", index.to(device), persistent=False)

    @staticmethod
    def shapes(target: TargetSpec, num_slots: int, max_rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """This TP rank's ``lora_A`` and ``lora_B`` shapes for ``target``."""
        in_local = _local(target.in_features, target.a_kind, dim_is_split=True)
        out_local = _local(target.out_features, target.b_kind, dim_is_split=True)
        return (num_slots, target.num_parts, max_rank, in_local), (num_slots, out_local, max_rank)

    def _compute(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, dict[int, int]]:
        """This module's ``A`` and scaled ``B`` of the forward's slots in the compute rows
        (``PooledRows.compute_rows``), shaped like ``lora_A`` and ``lora_B`` but one entry per
        routed slot, and each slot's position; no autograd history."""
        rows, positions = self.rows.compute_rows(self.routing, dtype)
        n = rows.shape[0]
        a = self.rows.view(rows, self.a_name, (n, *self.a_shape[1:]))
        return a, self.rows.view(rows, self.b_name, (n, *self.b_shape[1:])), positions

    def _a(self, slot: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """``[parts*rank, in]``: every part's first ``rank`` rows of the slot's ``A`` in ``dtype``,
        part after part. Its gradient goes to the slot's gradient row (``_ToRows``)."""
        a_rows, _, positions = self._compute(dtype)
        a = a_rows[positions[slot], :, :rank].flatten(0, 1)
        grads = self.lora_A.grad
        assert grads is not None
        index = None if self.routing.static is None else self.routing.static.slots

        def sink(g: torch.Tensor) -> None:
            g = g.view(grads.shape[1], rank, grads.shape[3])
            if index is None:
                grads[slot, :, :rank].add_(g)
            else:  # one addition per element, as add_ (the index is one slot; add_ casts, index_add_ not)
                grads[:, :, :rank].index_add_(0, index, g.unsqueeze(0).to(grads.dtype))

        return _ToRows.apply(self.lora_A, a, sink)

    def _b(self, slot: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """``[out, parts*rank]``: the slot's ``(alpha/rank) * B`` (scaled in fp32, then cast),
        made block diagonal. Its gradient goes to the slot's gradient row (``_ToRows``)."""
        # contiguous, as a cast would leave it: the GEMMs' backward picks its layout by b's strides
        _, b_rows, positions = self._compute(dtype)
        b_slot = b_rows[positions[slot], :, :rank].contiguous()
        b = factor_rows.block_diagonal(b_slot, self.part_mask, self.row_part)
        scale = lora_scaling(self.routing.configs[slot].rank)
        grads = self.lora_B.grad
        assert grads is not None
        index = None if self.routing.static is None else self.routing.static.slots

        def sink(g: torch.Tensor) -> None:
            if index is None:
                grads[slot, :, :rank].add_(self._diagonal(g, rank), alpha=scale)
            else:
                source = self._diagonal(g, rank).unsqueeze(0).to(grads.dtype)
                grads[:, :, :rank].index_add_(0, index, source, alpha=scale)

        return _ToRows.apply(self.lora_B, b, sink)

    def _diagonal(self, g: torch.Tensor, rank: int) -> torch.Tensor:
        """The inverse of ``factor_rows.block_diagonal`` for gradients: ``[.., out, parts*rank]`` to
        ``[.., out, rank]``, each row's own part's block (a gather: exact)."""
        if self.part_index is None:
            return g
        out = g.shape[-2]
        index = self.part_index[:, :, :rank].expand(*g.shape[:-2], out, 1, rank)
        return g.unflatten(-1, (self.parts, rank)).gather(-2, index).squeeze(-2)

    def adapt(self, x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """``base`` (the adapted linear's output ``[T, 1, out_local]``) plus the LoRA update of
        the packed activations ``x: [T, 1, in_local]`` (``base`` itself where no slot trains
        this module).

        One slot covering the whole batch takes a plain path whose second GEMM adds onto
        ``base`` in its epilogue (``addmm``: no separate addition of two ``[T, out]`` tensors,
        one rounding instead of two). Several slots: with
        ``routing.stacked`` (the GPU default) one grouped matmul per projection whose groups are
        the segments (``torch._grouped_mm``): a fixed number of kernels however many tenants
        share the batch, and exactly each slot's own FLOPs; otherwise (the CPU default, or where
        grouped matmuls are not available) one small matmul per segment.  Either way a token
        only ever meets its own slot's tensors (see the module docstring on isolation).
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
        routing, group = self.routing, self.target.group
        active = [s for s in routing.segments if routing.configs[s.slot].trains(group)]
        if not active:
            return base
        slots = sorted({s.slot for s in active})
        covered = sum(s.end - s.start for s in active) == x.shape[0]
        # Plain 2-D matmuls: ``[T, 1, in] @ [in, r]`` would take a different kernel (and
        # rounding) with and without autograd, so forward_only would differ from forward_backward.
        rows = x.reshape(x.shape[0], x.shape[-1])  # [T, in]
        if len(slots) == 1 and covered:
            rank = routing.configs[slots[0]].rank
            a = self._a(slots[0], rank, x.dtype)  # [parts*r, in]
            b = self._b(slots[0], rank, x.dtype)  # [out, parts*r]
            h = region(rows @ a.t())  # [T, parts*r]
            return torch.addmm(base.reshape(rows.shape[0], -1), h, b.t().to(base.dtype)).view_as(base)
        # The sum is made as [T, out] and viewed back, as the one-slot path does: the gradient
        # that reaches ``base`` then has the canonical strides of [T, 1, out]. The incoming
        # gradient's size-1 dimension may carry any stride (the output layer's, through
        # GPTModel's transpose to [1, T, vocab]), and megatron's backward would then multiply it
        # by the weight as a batched matmul over every token (the weight broadcast: over a second
        # per step at 8B).
        flat = base.reshape(rows.shape[0], -1)
        if (routing.stacked or routing.static is not None) and grouped_mm_supported(x):
            total = self._grouped(rows, region, flat)
        else:
            total = flat + self._per_segment(rows, region).to(base.dtype)
        return total.view_as(base)  # [T, 1, out]

    def _grouped(
        self,
        rows: torch.Tensor,
        region: Callable[[torch.Tensor], torch.Tensor],
        base: torch.Tensor | None,
        weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``base`` ([T, out]) plus the LoRA term, both factors as grouped matmuls over the
        segments (one kernel each). ``torch._grouped_mm`` has no epilogue for the sum: on CUDA
        the second factor's kernel is ``grouped_addmm``'s, which adds ``base`` as it writes;
        elsewhere the sum is a separate addition (one ``addmm`` per segment instead, measured
        on the H200 at 16x256 of 8 tenants, cost the host more launches than the addition costs
        the GPU). With ``weight`` (the frozen linear's; TP=1), ``_GroupedAdaptedLinear`` forms
        ``rows``' whole gradient, and with ``base`` None (``base_in_epilogue``) the base product
        ``rows Wᵀ`` too, adding the grouped LoRA term in its epilogue.

        Only the largest active rank ``r`` is used (every slot's rows/columns past its rank are
        zero, part by part), and ``parts*r`` is rounded up to a multiple of 16 bytes (the
        kernel's alignment, on CPU as on CUDA; the padding is zeros). Each slot's ``alpha/rank`` scales its
        ``B`` (finite weights times a finite number), never the activations, so nothing
        multiplies another slot's values.
        """
        layout = self.routing.group_layout(self.target.group, rows)
        r = layout.rank
        a_rows, b_rows, _ = self._compute(rows.dtype)
        # each group's weights gathered straight from its row of the compute rows (one gather per
        # factor; none where group g's row is row g); a group whose slot does not train these
        # modules reads the all-zero row
        if layout.identity:
            groups = layout.offsets.shape[0]
            a_groups, b_groups = a_rows[:groups, :, :r], b_rows[:groups, :, :r]
        else:
            a_groups = a_rows[:, :, :r].index_select(0, layout.source)
            b_groups = b_rows[:, :, :r].index_select(0, layout.source)
        a = a_groups.flatten(1, 2)  # [G, parts*r, in]
        b = factor_rows.block_diagonal(b_groups, self.part_mask, self.row_part)  # [G, out, parts*r]
        pad = (-a.shape[1]) % max(1, 16 // rows.element_size())  # rows of 16-byte multiples
        if pad:
            a = torch.nn.functional.pad(a, (0, 0, 0, pad))  # [G, w, in]
            b = torch.nn.functional.pad(b, (0, pad))  # [G, out, w]
        width, parts = self.parts * r, self.parts
        a_grads, b_grads = self.lora_A.grad, self.lora_B.grad
        assert a_grads is not None and b_grads is not None

        # Each real group's gradient adds into its slot's row. On CUDA one kernel per factor reads
        # each real group's gradient where the grouped matmul wrote it (``factor_rows``). Elsewhere:
        # consecutive slots as one slice (an in-place addition that promotes bf16 itself), other
        # slots by index (whose addition takes fp32: one cast first). Each is one addition per element.
        first = layout.first_slot
        fused = factor_rows.fused_supported(rows)

        def into(grads: torch.Tensor, real: torch.Tensor, alpha: float = 1.0) -> None:
            if first is not None:
                grads[first : first + real.shape[0], :, :r].add_(real, alpha=alpha)
            else:
                grads[:, :, :r].index_add_(0, layout.real_slots, real.to(grads.dtype), alpha=alpha)

        def a_sink(g: torch.Tensor) -> None:  # [G, w, in]: each real group into its slot's row
            if fused:
                factor_rows.add_a_grads(a_grads, g, layout.real, layout.real_slots, r)
                return
            into(a_grads, (g if layout.every else g.index_select(0, layout.real))[:, :width].unflatten(1, (parts, r)))

        def b_sink(g: torch.Tensor) -> None:  # [G, out, w]
            if fused:
                factor_rows.add_b_grads(
                    b_grads, g, layout.real, layout.real_slots, layout.real_scale, r, self.row_part
                )
                return
            real = self._diagonal((g if layout.every else g.index_select(0, layout.real))[..., :width], r)
            if layout.scale is not None:  # one alpha/rank for all: the addition scales (no product)
                into(b_grads, real, alpha=layout.scale)
            else:
                into(b_grads, real.to(b_grads.dtype) * layout.real_scale.view(-1, 1, 1))

        a = _ToRows.apply(self.lora_A, a, a_sink)
        b = _ToRows.apply(self.lora_B, b, b_sink)
        if weight is not None:
            return _GroupedAdaptedLinear.apply(rows, base, weight, a, b, layout.offsets)  # [T, out]
        assert base is not None, "only the hook's path (with weight) computes the base product"
        h = region(torch._grouped_mm(rows, a.transpose(1, 2), offs=layout.offsets))  # [T, w]
        if grouped_addmm.fused_supported(h):
            return grouped_addmm.grouped_addmm(base, h, b, layout.offsets)  # [T, out]
        return base + torch._grouped_mm(h, b.transpose(1, 2), offs=layout.offsets).to(base.dtype)  # [T, out]

    def _per_segment(self, rows: torch.Tensor, region: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Each slot's segment through its own adapter: exact LoRA FLOPs, but kernels per segment.

        The better trade on a CPU, where FLOPs cost more than launches (docs/benchmarks.md).
        """
        routing = self.routing
        rank_of = {
            s.slot: routing.configs[s.slot].rank if routing.configs[s.slot].trains(self.target.group) else 0
            for s in routing.segments
        }
        width = self.parts * max(rank_of.values())
        hidden = []
        for seg in routing.segments:
            a = self._a(seg.slot, rank_of[seg.slot], rows.dtype)  # [parts*rank, in]
            h_seg = rows[seg.start : seg.end] @ a.t()  # [t, parts*rank]
            hidden.append(torch.nn.functional.pad(h_seg, (0, width - a.shape[0])))  # [t, width]
        h = region(torch.cat(hidden, dim=0))  # [T, width]: one collective per module and forward
        out = []
        for seg in routing.segments:
            rank = rank_of[seg.slot]
            b = self._b(seg.slot, rank, rows.dtype)  # [out, parts*r]
            out.append(h[seg.start : seg.end, : self.parts * rank] @ b.t())  # [t, out]
        return torch.cat(out, dim=0)  # [T, out]

    def grouped(self, x: torch.Tensor) -> bool:
        """Whether ``adapt`` takes the grouped matmuls for ``x``: a slot trains this module, no one
        slot covers the batch, and ``routing.stacked`` or a static step asks for them where
        ``torch._grouped_mm`` runs."""
        routing, group = self.routing, self.target.group
        if not any(routing.configs[s.slot].trains(group) for s in routing.segments) or self.sole_slot(x) is not None:
            return False
        return (routing.stacked or routing.static is not None) and grouped_mm_supported(x)

    def sole_slot(self, x: torch.Tensor) -> int | None:
        """The one slot whose segments cover all of ``x``'s tokens and train this module, if one does."""
        routing, group = self.routing, self.target.group
        active = [s for s in routing.segments if routing.configs[s.slot].trains(group)]
        slots = {s.slot for s in active}
        if len(slots) == 1 and sum(s.end - s.start for s in active) == x.shape[0]:
            return slots.pop()
        return None

    def pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Before the base linear, at TP=1, where one slot covers the batch or the grouped matmuls
        serve several: the hook computes the adapted output itself (``_AdaptedLinear``,
        ``_GroupedAdaptedLinear``), which then forms ``x``'s whole gradient, so the base gets ``x``
        detached (its frozen weight records no backward). Where ``base_in_epilogue`` holds (CUDA)
        the hook computes the base product too, so the base gets no rows at all; elsewhere it
        gets them only where ``x`` needs a gradient, and otherwise nothing changes."""
        x = args[0]
        self.routing.handed_inputs.pop(id(self), None)
        if tp_size() != 1:
            return None
        fused = base_in_epilogue(module, x)
        if not (fused or (torch.is_grad_enabled() and x.requires_grad)):
            return None
        slot = self.sole_slot(x)
        if slot is None and not self.grouped(x):
            return None
        self.routing.handed_inputs[id(self)] = (x, slot, fused)
        given = x.detach()
        return (given[:0] if fused else given, *args[1:]), kwargs

    def hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        base, bias = output
        handed_input = self.routing.handed_inputs.pop(id(self), None)
        if handed_input is None:
            return self.adapt(args[0], base), bias
        x, slot, fused = handed_input
        handed = kwargs.get("weight")  # the output layer may be handed its (tied) weight
        weight: torch.Tensor = module.weight if handed is None else handed  # type: ignore[assignment]
        rows = x.reshape(x.shape[0], x.shape[-1])
        flat = None if fused else base.reshape(rows.shape[0], -1)
        if slot is None:  # the grouped matmuls (pre_hook)
            out = self._grouped(rows, lambda t: t, flat, weight)
        else:
            rank = self.routing.configs[slot].rank
            a, b = self._a(slot, rank, x.dtype), self._b(slot, rank, x.dtype)
            out = _AdaptedLinear.apply(rows, flat, weight, a, b)
        # [T, 1, out] with the canonical strides (see ``adapt``)
        return out.view(*x.shape[:-1], out.shape[-1]), bias


BASE_IN_EPILOGUE_DEVICES: frozenset[str] = frozenset({"cuda"})
"""Device types on which ``base_in_epilogue`` holds. On CUDA it is measured as fast at 1,024
tokens and faster from 2,048 at every workload of ``bench/gpu_trainer.py`` (whose
``separate-base`` rows time the path without it), and
``test_lora_shape.py -k cuda`` checks it against fp32. On the CPU the frozen linears' order keeps
a slot's bits independent of its neighbours; ``test_lora_shape.py -k epilogue`` checks the path
there by forcing it."""


def base_in_epilogue(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether the adapter computes ``module``'s base product itself, in the epilogue of its LoRA
    GEMM: on the devices of ``BASE_IN_EPILOGUE_DEVICES``, for megatron's own bias-free linears.
    Their output ``x Wᵀ + (x Aᵀ) Bᵀ`` is then one base GEMM that adds the LoRA term (written first,
    by the rank-``r`` GEMM) as it writes, where the frozen linear's output is otherwise written,
    read back and written again by the LoRA GEMM that adds onto it; the input gradient ``g W +
    (g B) A`` likewise, ``(g B) A`` first. One rounding of the LoRA term, then one of the sum
    (otherwise: one of ``x Wᵀ``, then one of the sum). On a CPU the default order also keeps a
    slot's training bit-identical however its units are composed (``test_slot_isolation.py``)."""
    if x.device.type not in BASE_IN_EPILOGUE_DEVICES:  # the CPU: no import on the hot path
        return False
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return isinstance(module, ColumnParallelLinear | RowParallelLinear) and getattr(module, "bias", None) is None


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


ROW_ALIGN = 64
"""Every entry of a ``PooledRows`` row starts at a multiple of this many floats (256 bytes)."""


class _ToRows(torch.autograd.Function):
    """A weight of the LoRA math, read from ``PooledRows``' compute rows (no autograd history of
    its own), whose gradient ``sink`` adds into the pool's fp32 gradient rows directly: each
    gradient is one in-place (type-promoting) addition into its slot's rows, instead of a cast and
    a slot-indexing backward that fills a pool-sized tensor of zeros for every tensor. ``anchor``
    (the fp32 parameter) only puts the op on the autograd graph; it receives no gradient."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, weight: torch.Tensor, sink: Callable[[torch.Tensor], None]) -> Any:
        ctx.sink = sink
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        with torch.no_grad():
            ctx.sink(grad)
        return None, None, None


class _AdaptedLinear(torch.autograd.Function):
    """``x Wᵀ + (x Aᵀ) Bᵀ`` (``x [T, in]``, ``A [w, in]``, ``B [out, w]``, ``W`` the frozen
    linear's weight). With ``base`` None (``base_in_epilogue``) the LoRA term is written first and
    the base GEMM adds its product onto it in its epilogue; otherwise ``base`` is the frozen
    linear's own ``x Wᵀ`` (computed from ``x`` detached) and the LoRA GEMM adds onto it. Either
    way this backward forms ``x``'s whole gradient ``g W + (g B) A`` in one GEMM and its epilogue
    (in the forward's order), instead of two ``[T, in]`` gradients that autograd then adds in a
    kernel of its own (one per adapted linear and step: a fifth of the elementwise time of a
    4,096-token step of the 8B shape)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        base: torch.Tensor | None,
        weight: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
    ) -> torch.Tensor:
        h = x @ a.t()  # [T, w]
        ctx.save_for_backward(x, h, weight, a, b)
        ctx.base_in_epilogue = base is None
        if base is None:
            return (h @ b.t()).addmm_(x, weight.t())
        return torch.addmm(base, h, b.t())

    @staticmethod
    def backward(
        ctx: Any, g: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, torch.Tensor, torch.Tensor]:
        x, h, weight, a, b = ctx.saved_tensors
        dh = g @ b  # [T, w]
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (dh @ a).addmm_(g, weight) if ctx.base_in_epilogue else (g @ weight).addmm_(dh, a)
        return dx, None if ctx.base_in_epilogue else g, None, dh.t() @ x, g.t() @ h


class _GroupedAdaptedLinear(torch.autograd.Function):
    """``_AdaptedLinear`` for the grouped matmuls of a step of several slots (TP=1): ``x Wᵀ +
    (x A_gᵀ) B_gᵀ``, each group ``g`` of rows (``offsets``: the groups' ends, the last one the
    stream's) by its own ``A_g [w, in]`` and ``B_g [out, w]``. With ``base`` None
    (``base_in_epilogue``) the grouped LoRA term is written first and the base GEMM adds onto it;
    otherwise ``base`` is the frozen linear's ``x Wᵀ`` and ``grouped_addmm`` adds it on CUDA. The
    backward forms ``x``'s whole gradient: the LoRA part ``(g B_g) A_g`` by a grouped matmul,
    then, on CUDA, ``g W`` added onto it in one GEMM's epilogue (``addmm_``), where autograd would
    add two ``[T, in]`` gradients in a kernel of its own. On the CPU the sum keeps the one-slot
    path's order (``g W`` first), so that a slot's training stays bit-identical however its units
    are composed (``test_slot_isolation.py``). The factors' gradients are grouped matmuls over
    the tokens (ragged along K), written in the factors' own layouts ``[G, w, in]`` and ``[G,
    out, w]``, so that the sinks read them contiguously as they add them into the slots' rows
    (transposed views of ``xᵀ dh`` and ``hᵀ g`` would be read across their strides)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        base: torch.Tensor | None,
        weight: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        offsets: torch.Tensor,
    ) -> torch.Tensor:
        h = torch._grouped_mm(x, a.transpose(1, 2), offs=offsets)  # [T, w]
        ctx.base_in_epilogue = base is None
        if base is None:  # every row lies in a group, so the grouped product writes every row
            out = torch._grouped_mm(h, b.transpose(1, 2), offs=offsets).addmm_(x, weight.t())
        elif grouped_addmm.fused_supported(h):
            out = grouped_addmm.grouped_addmm(base, h, b, offsets)
        else:
            out = base + torch._grouped_mm(h, b.transpose(1, 2), offs=offsets).to(base.dtype)
        ctx.save_for_backward(x, h, weight, a, b, offsets)
        return out  # [T, out]

    @staticmethod
    def backward(
        ctx: Any, g: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, Any, Any, None]:
        x, h, weight, a, b, offsets = ctx.saved_tensors
        dh = torch._grouped_mm(g, b, offs=offsets)  # [T, w]
        dx = None
        if ctx.needs_input_grad[0]:
            lora_part = torch._grouped_mm(dh, a, offs=offsets)  # [T, in]: dh A_g
            if ctx.base_in_epilogue or g.is_cuda:  # g W added onto it in the GEMM's epilogue
                dx = lora_part.addmm_(g, weight)
            else:  # g W first, as the one-slot path sums: a slot's bits do not depend on its neighbours
                dx = (g @ weight).add_(lora_part)
        da = torch._grouped_mm(dh.t(), x, offs=offsets)  # [G, w, in]
        db = torch._grouped_mm(g.t(), h, offs=offsets)  # [G, out, w]
        return dx, None if ctx.base_in_epilogue else g, None, da, db, None


class PooledRows:
    """Every adapter tensor of a pool as columns of two slot-major fp32 buffers, ``values`` and
    ``grads`` (``[slots, width]``): slot ``s``'s part of every parameter lies in row ``s``.

    Each parameter is the view ``values[:, offset : offset + n]`` reshaped to its own shape, and
    its ``.grad`` the same view of ``grads``, which the backward adds into (``_ToRows``). One
    slot's whole state is then one contiguous row, and ``SlotAdamW`` norms, clips, zeroes and
    updates a slot (or a run of consecutive slots) as one tensor instead of one per parameter: a
    few launches and host microseconds however many tensors a slot has.

    Columns of TP-sharded tensors come first, ``[0, sharded)``, replicated ones after (a
    gradient norm sums the first over TP ranks and counts the second once); within each, ``A``
    before ``B``. Entries start at multiples of ``ROW_ALIGN`` floats; the gaps, like every entry a
    slot does not train (a rank below the pool's, a disabled module), hold zeros that stay zero
    (their gradients are exactly zero).
    """

    def __init__(self, entries: list[tuple[str, tuple[int, ...], bool]], device: str | torch.device) -> None:
        """``entries``: (name, shape ``[slots, ...]``, TP-sharded) of every tensor."""
        self.num_slots = entries[0][1][0]
        self.offsets: dict[str, tuple[int, int]] = {}
        width = self.sharded = 0
        runs: list[tuple[bool, int, int]] = []  # (is B, first column, end) of each run of one kind
        # sharded first, then A before B within each (stable): four runs of columns in all
        for name, shape, sharded in sorted(entries, key=lambda e: (not e[2], e[0].endswith(".lora_B"))):
            n = math.prod(shape[1:])
            self.offsets[name] = (width, n)
            end = width + -(-n // ROW_ALIGN) * ROW_ALIGN
            is_b = name.endswith(".lora_B")
            if runs and runs[-1][0] == is_b:
                runs[-1] = (is_b, runs[-1][1], end)
            else:
                runs.append((is_b, width, end))
            width = end
            if sharded:
                self.sharded = width
        self.width = width
        self.runs = runs
        self.values = torch.zeros(self.num_slots, width, device=device)
        self.grads = torch.zeros_like(self.values)
        self.params: dict[str, nn.Parameter] = {}
        self._compute: torch.Tensor | None = None  # see compute_rows
        self._computed_for: tuple[int, torch.dtype] | None = None
        self._positions: dict[int, int] = {}
        self._grads: list[tuple[nn.Parameter, torch.Tensor]] = []

    def view(self, buffer: torch.Tensor, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Entry ``name`` of ``buffer`` (``[slots, width]``, laid out like ``values``) as ``shape``."""
        offset, n = self.offsets[name]
        return buffer[:, offset : offset + n].view(shape)

    def parameter(self, name: str, shape: tuple[int, ...]) -> nn.Parameter:
        param = nn.Parameter(self.view(self.values, name, shape))
        param.grad = self.view(self.grads, name, shape)
        self.params[name] = param
        self._grads.append((param, param.grad))
        return param

    def compute_rows(self, routing: SlotRouting, dtype: torch.dtype) -> tuple[torch.Tensor, dict[int, int]]:
        """The rows of the current forward's slots in the compute ``dtype``, every ``B`` scaled
        by its slot's ``alpha/rank`` (the product in fp32, then one rounding), and each slot's
        position among them (the forward's slots in ascending order, ``routed_slots``); with
        several slots, one all-zero row follows theirs (``GroupLayout.source``).

        Built once per forward (``routing.generation``): two kernels per run of columns and slot,
        instead of a cast and a product per tensor in every module's forward. Only the routed
        slots' rows exist, so the copy costs no memory for the pool's other slots. Each forward
        gets a new tensor (the caching allocator hands back the previous one's memory once its
        backward has freed it): the weights an autograd graph saved are never overwritten."""
        slots = routed_slots(routing)
        key = (routing.generation, dtype)
        if self._computed_for != key:
            self._compute = None  # released first: its memory is reused unless a graph still holds it
            zero_row = len(slots) > 1  # the grouped path's row for slots that do not train a module
            buffer = self._compute = torch.empty(
                len(slots) + zero_row, self.width, dtype=dtype, device=self.values.device
            )
            with torch.no_grad():
                if zero_row:
                    buffer[len(slots)].zero_()
                if routing.static is not None:  # the rows the device tensors name, all at once
                    st = routing.static
                    source = self.values.index_select(0, st.slots)  # [S, width]
                    for is_b, lo, hi in self.runs:
                        if is_b:
                            torch.mul(source[:, lo:hi], st.scales[:, None], out=buffer[: len(slots), lo:hi])
                        else:
                            buffer[: len(slots), lo:hi].copy_(source[:, lo:hi])
                else:  # each slot's row by its number (no index tensor to upload)
                    for i, slot in enumerate(slots):
                        scale = lora_scaling(routing.configs[slot].rank)
                        for is_b, lo, hi in self.runs:
                            if is_b:
                                torch.mul(self.values[slot, lo:hi], scale, out=buffer[i, lo:hi])
                            else:
                                buffer[i, lo:hi].copy_(self.values[slot, lo:hi])
            self._computed_for, self._positions = key, {slot: i for i, slot in enumerate(slots)}
        assert self._compute is not None
        return self._compute, self._positions

    def intact(self) -> bool:
        """Whether every parameter's ``.grad`` is still its view of ``grads`` (code that sets a
        ``.grad`` of its own, or to None, takes that parameter's gradient out of the rows)."""
        return all(param.grad is grad for param, grad in self._grads)


class AdapterPool(nn.Module):
    """All slot adapters of one model, their routing, and each slot's configuration."""

    def __init__(self, shape: ModelShape, num_slots: int, max_rank: int, device: str = "cpu") -> None:
        super().__init__()
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.routing = SlotRouting()
        self.targets = adapter_targets(shape)
        entries: list[tuple[str, tuple[int, ...], bool]] = []
        for t in self.targets:
            a_shape, b_shape = SlotAdapter.shapes(t, num_slots, max_rank)
            entries.append((f"{t.path}.lora_A", a_shape, t.a_kind is not ShardKind.REPLICATED))
            entries.append((f"{t.path}.lora_B", b_shape, t.b_kind is not ShardKind.REPLICATED))
        self.rows = PooledRows(entries, device)
        self.adapters = nn.ModuleDict(
            {
                _key(t.path): SlotAdapter(t, shape, num_slots, max_rank, self.routing, device, self.rows)
                for t in self.targets
            }
        )
        self._handles: list[Any] = []
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
        """Register a forward pre-hook and a forward hook on each adapted linear of ``model``."""
        modules = dict(model.named_modules())
        for target in self.targets:
            adapter, module = self.adapter(target.path), modules[target.path]
            self._handles.append(module.register_forward_pre_hook(adapter.pre_hook, with_kwargs=True))
            self._handles.append(module.register_forward_hook(adapter.hook, with_kwargs=True))

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

    def clear_slot(self, slot: int) -> None:
        """Zero the slot's tensors and gradients and forget its config."""
        self._check_slot(slot)
        with torch.no_grad():
            self.rows.values[slot].zero_()
            self.rows.grads[slot].zero_()
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
