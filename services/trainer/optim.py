"""Per-slot AdamW over slot-indexed adapter tensors, with TP-aware gradient clipping.

The math is ``torch.optim.AdamW``'s single-tensor path (decoupled weight decay), written out
so that state lives in tensors shaped like the slot-indexed parameters and is keyed by slot:
``exp_avg[name][slot]``, ``exp_avg_sq[name][slot]``, ``steps[slot]``.  Per request:

    norm   = sqrt(sum over the slot's tensors of ||g||^2)   (sharded tensors summed over TP,
                                                             replicated ones counted once)
    if norm is not finite: zero the slot's grads, report applied=False, stop
    if clip > 0: g *= min(clip / (norm + 1e-6), 1)          (torch.nn.utils.clip_grad_norm_)
    step += 1
    p *= 1 - lr*wd;  m = lerp(m, g, 1-b1);  v = b2*v + (1-b2)*g*g
    p -= lr/(1-b1^step) * m / (sqrt(v)/sqrt(1-b2^step) + eps)
    if any of p, m, v is now not finite (a finite gradient whose square overflows, an extreme
    learning rate or weight decay): put p, m, v and step back as they were, zero the grads,
    report applied=False

Several slots in one call (``SlotAdamW.step_many``): every slot's gradient norm comes from one
``_foreach_norm`` over all of their gradients and one host sync. On CUDA (or with ``fused=True``)
the update is ``torch._fused_adamw_`` (one pass over p, g, m, v) for all slots that share their
hyper-parameters and step count, bit-equal to ``torch.optim.AdamW(fused=True)`` on CUDA (the
kernel is elementwise). The engine's pool keeps every slot's tensors as one row of slot-major
buffers (``lora.PooledRows``); given them (``rows``), such a step norms, clips, zeroes and
updates each slot as its whole row (``_RowPlan``): two norm entries per slot, and one
``_fused_adamw_`` tensor per run of consecutive slots, instead of a few hundred of each per
slot. (On the CPU the kernel rounds the last elements of a tensor whose size is no multiple of
its vector width in a scalar loop; the rows' entries start at multiples of 64 floats, so an entry
of another size may differ there by a rounding from a per-tensor step.) Without rows, or where a
slot's tensors are not all in them, the update takes each tensor as it is. A slot's norm, clip
coefficient and result never depend on which other slots share the call. The finiteness check is
folded into that sync: with the largest |p|, |m| and v of each slot (one more
``_foreach_norm``, on a slot's first fused step; after it the same bounds are carried forward on
the host from the step's own arithmetic, ``_next_bounds``) and its clipped gradient norm, a bound
in float64 shows that the step cannot leave a non-finite value (``_fused_step_is_safe``); only a
slot for which the bound fails (extreme learning rates, eps = 0, gradients near float32's range)
takes the checked path above, with its rollback copy. The carried bounds hold because nothing but
``step_many`` changes a slot's values and moments between two calls of ``reset_slot`` (which every
load of a slot, ``init_slot``, ``set_slot_state`` and ``release_slot``, makes first); a checked
step forgets them.

Invariant: a step touches only the requested slot's parameter rows, moments and counter,
and always leaves that slot's gradients zero; a slot's parameters and moments are always
finite after it; every TP rank takes the same decisions because the norm and the finiteness
count are all-reduced before they are tested.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from libs.contracts.common import AdamParams
from services.trainer.convert import ShardKind
from services.trainer.lora import PooledRows, SlotTensor
from services.trainer.parallel import tp_all_reduce_sum


@dataclass(frozen=True)
class StepReport:
    """What ``optim_step`` did for one slot."""

    applied: bool
    grad_norm: float  # before clipping
    step: int  # the slot's step count after this call
    reason: str | None = None  # why the step was skipped


@dataclass
class _SlotViews:
    """A slot's per-tensor views, built once and reused while the slot's layout is unchanged.

    Slicing a slot-indexed parameter (and its gradient and moments) for each of a slot's few
    hundred tensors costs more host time than the whole update on the GPU; the views stay valid
    as long as the slot's tensors (names, ranks) and the parameters' gradient tensors are the same
    objects, which ``SlotAdamW._views`` checks on every step.
    """

    tensors: list[SlotTensor]  # the list the views were made from (the pool's, reused while valid)
    key: list[tuple[str, tuple[Any, ...]]]  # (name, index) of each of the slot's tensors
    grad_sources: list[torch.Tensor | None]  # each parameter's .grad when the views were made
    values: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]
    sharded: torch.Tensor | None  # (len(present grads),) bool: TP-sharded, else replicated
    dense: bool  # every value, gradient and moment view is contiguous (what the fused kernel takes)
    scratch: list[list[torch.Tensor]] | None = None  # views of SlotAdamW._scratch, see _scratch_views
    scratch_buffer: torch.Tensor | None = None  # the buffer those views are of


@dataclass
class _RowPlan:
    """A fused step of one slot over its whole rows of ``PooledRows`` (values, grads, moments).

    Exact: every entry of the row that the slot does not train is zero in all four (the pool
    zeroes a slot's row when it is loaded or cleared, ``reset_slot`` its moments, no gradient
    reaches those entries), and an AdamW step with eps > 0 (which every fused step has) leaves
    zeros zero; the kernel is elementwise, so the trained entries get the bits a per-tensor call
    gives them. The gradient norm is one ``_foreach_norm`` entry per row part (TP-sharded
    columns, replicated columns) instead of one per tensor."""

    rows: PooledRows
    exp_avg: torch.Tensor  # [slots, width]
    exp_avg_sq: torch.Tensor
    slot: int

    def grad_parts(self) -> tuple[list[torch.Tensor], list[bool]]:
        """The row's gradient as (sharded columns, replicated columns), empty parts left out."""
        g, cut = self.rows.grads[self.slot], self.rows.sharded
        parts = [(g[:cut], True), (g[cut:], False)]
        kept = [(t, sharded) for t, sharded in parts if t.numel()]
        return [t for t, _ in kept], [sharded for _, sharded in kept]

    def state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.rows.values[self.slot], self.exp_avg[self.slot], self.exp_avg_sq[self.slot]


class SlotAdamW:
    """AdamW moments and step counters for every slot, keyed by tensor name then slot."""

    def __init__(self, fused: bool | None = None, rows: PooledRows | None = None) -> None:
        """``fused``: use ``torch._fused_adamw_`` where the step is provably finite; ``None``
        means on CUDA tensors only (the CPU default stays bit-equal to torch.optim.AdamW's
        default single-tensor path). ``rows``: the pool's ``PooledRows``; the moments of its
        tensors are laid out like it, and a fused step of a slot whose tensors are all in it
        works on the slot's whole rows (see ``_RowPlan``)."""
        self.fused = fused
        self.rows = rows
        self.exp_avg: dict[str, torch.Tensor] = {}
        self.exp_avg_sq: dict[str, torch.Tensor] = {}
        self.exp_avg_rows: torch.Tensor | None = None  # [slots, width] like rows.values
        self.exp_avg_sq_rows: torch.Tensor | None = None
        self._in_rows: dict[int, tuple[list[SlotTensor], bool]] = {}  # slot -> (its tensors, all in rows)
        self._masks: dict[tuple[tuple[bool, ...], torch.device], torch.Tensor] = {}
        self.steps: dict[int, int] = {}
        self._cached: dict[int, _SlotViews] = {}
        self._scratch: torch.Tensor | None = None  # rollback copy of (p, m, v) and sqrt(v)
        self._bounds: dict[int, tuple[float, float, float]] = {}  # slot -> upper bounds of |p|, |m|, v

    def moments(self, tensor: SlotTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This slot's (exp_avg, exp_avg_sq) views for ``tensor``, allocated on first use."""
        if tensor.name not in self.exp_avg:
            rows = self.rows
            if rows is not None and rows.params.get(tensor.name) is tensor.param:
                if self.exp_avg_rows is None or self.exp_avg_sq_rows is None:
                    self.exp_avg_rows = torch.zeros_like(rows.values)
                    self.exp_avg_sq_rows = torch.zeros_like(rows.values)
                shape = tuple(tensor.param.shape)
                self.exp_avg[tensor.name] = rows.view(self.exp_avg_rows, tensor.name, shape)
                self.exp_avg_sq[tensor.name] = rows.view(self.exp_avg_sq_rows, tensor.name, shape)
            else:
                self.exp_avg[tensor.name] = torch.zeros_like(tensor.param.data)
                self.exp_avg_sq[tensor.name] = torch.zeros_like(tensor.param.data)
        return self.exp_avg[tensor.name][tensor.index], self.exp_avg_sq[tensor.name][tensor.index]

    def reset_slot(self, slot: int) -> None:
        self._bounds.pop(slot, None)  # the slot's values are about to be replaced
        if self.exp_avg_rows is not None and self.exp_avg_sq_rows is not None:
            self.exp_avg_rows[slot].zero_()
            self.exp_avg_sq_rows[slot].zero_()
        for table in (self.exp_avg, self.exp_avg_sq):
            for name, full in table.items():
                if self.rows is None or name not in self.rows.params:
                    full[slot].zero_()
        self.steps.pop(slot, None)

    def _row_plan(self, slot: int, tensors: list[SlotTensor]) -> _RowPlan | None:
        """The slot's whole-row plan when every one of its tensors lies in ``self.rows``."""
        rows = self.rows
        if rows is None or not tensors:
            return None
        cached = self._in_rows.get(slot)
        if cached is None or cached[0] is not tensors:
            inside = all(rows.params.get(t.name) is t.param for t in tensors)
            if inside:
                for t in tensors:  # the row moments, allocated on first use
                    self.moments(t)
            cached = self._in_rows[slot] = (tensors, inside)
        if not cached[1]:
            return None
        assert self.exp_avg_rows is not None and self.exp_avg_sq_rows is not None
        return _RowPlan(rows, self.exp_avg_rows, self.exp_avg_sq_rows, slot)

    def _views(self, slot: int, tensors: list[SlotTensor]) -> _SlotViews:
        cached = self._cached.get(slot)
        if (
            cached is not None
            and (cached.tensors is tensors or cached.key == [(t.name, t.index) for t in tensors])
            and all(t.param.grad is g for t, g in zip(tensors, cached.grad_sources, strict=True))
        ):
            cached.tensors = tensors
            return cached
        moments = [self.moments(t) for t in tensors]
        grads = [t.grad() for t in tensors]
        present = [t for t, g in zip(tensors, grads, strict=True) if g is not None]
        device = tensors[0].param.device if tensors else torch.device("cpu")
        sharded = (
            torch.tensor([t.kind is not ShardKind.REPLICATED for t in present], device=device)
            if present
            else None
        )
        values = [t.value() for t in tensors]
        present_grads = [g for g in grads if g is not None]
        views = _SlotViews(
            tensors=tensors,
            key=[(t.name, t.index) for t in tensors],
            grad_sources=[t.param.grad for t in tensors],
            values=values,
            grads=grads,
            exp_avg=[m for m, _ in moments],
            exp_avg_sq=[v for _, v in moments],
            sharded=sharded,
            dense=all(
                t.is_contiguous()
                for t in [*values, *present_grads, *(m for m, _ in moments), *(v for _, v in moments)]
            ),
        )
        self._cached[slot] = views
        return views

    def _scratch_views(self, views: _SlotViews, copies: int) -> list[list[torch.Tensor]]:
        """``copies`` lists of tensors shaped like the slot's values, carved from one buffer that
        every slot reuses (grown when a slot needs more); the views are kept with the slot's."""
        like = views.values
        if not like:
            return [[] for _ in range(copies)]
        total = sum(t.numel() for t in like)
        ref = like[0]
        buffer = self._scratch
        if (
            buffer is None
            or buffer.numel() < total * copies
            or buffer.device != ref.device
            or buffer.dtype != ref.dtype
        ):
            buffer = self._scratch = torch.empty(total * copies, dtype=ref.dtype, device=ref.device)
        if views.scratch is not None and views.scratch_buffer is buffer and len(views.scratch) == copies:
            return views.scratch
        out, offset = [], 0
        for _ in range(copies):
            part = []
            for t in like:
                part.append(buffer[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()
            out.append(part)
        views.scratch, views.scratch_buffer = out, buffer
        return out

    def step(self, slot: int, tensors: list[SlotTensor], hp: AdamParams) -> StepReport:
        """Apply one AdamW step to ``slot`` (``tensors`` = its adapter tensors), then zero grads."""
        return self.step_many([(slot, tensors, hp)])[slot]

    def step_many(self, requests: list[tuple[int, list[SlotTensor], AdamParams]]) -> dict[int, StepReport]:
        """One AdamW step for each ``(slot, tensors, hp)`` (distinct slots), then zero their grads.

        Each slot's result is the one ``step`` alone would give it; the slots share the norm
        kernels, one host sync and, where their hyper-parameters and step counts agree, one
        fused update."""
        if not requests:
            return {}
        device = next((t[0].param.device for _, t, _ in requests if t), torch.device("cpu"))
        fusing = self.fused if self.fused is not None else device.type == "cuda"
        by_rows = fusing and self.rows is not None and self.rows.intact()
        plans = [self._row_plan(slot, tensors) if by_rows else None for slot, tensors, _ in requests]
        # per-tensor views only for the slots stepped tensor by tensor (a row plan needs none)
        views = [
            self._views(slot, tensors) if plan is None else None
            for (slot, tensors, _), plan in zip(requests, plans, strict=True)
        ]
        presents = [[g for g in v.grads if g is not None] if v is not None else [] for v in views]
        fused = [
            p is not None or (fusing and v is not None and v.dense and bool(v.values))
            for v, p in zip(views, plans, strict=True)
        ]
        known = [
            self._bounds.get(slot) if f else None for (slot, _, _), f in zip(requests, fused, strict=True)
        ]
        measure = [f and b is None for f, b in zip(fused, known, strict=True)]
        norm_grads: list[list[torch.Tensor]] = []
        norm_masks: list[torch.Tensor | None] = []
        states: list[tuple[list[torch.Tensor], ...] | None] = []
        for v, present, plan, m in zip(views, presents, plans, measure, strict=True):
            if plan is not None:
                parts, sharded = plan.grad_parts()
                norm_grads.append(parts)
                norm_masks.append(self._mask(tuple(sharded), device))
                states.append(tuple([t] for t in plan.state()) if m else None)
            else:
                assert v is not None
                norm_grads.append(present)
                norm_masks.append(v.sharded)
                states.append((v.values, v.exp_avg, v.exp_avg_sq) if m else None)
        norms, measured = _norms_and_peaks(norm_grads, norm_masks, states, device)
        peaks = [b if b is not None else m for b, m in zip(known, measured, strict=True)]
        reports: dict[int, StepReport] = {}
        groups: dict[tuple[float, float, float, float, float, int], list[int]] = {}
        for i, ((slot, tensors, hp), v, present) in enumerate(zip(requests, views, presents, strict=True)):
            norm = norms[i]
            grads = norm_grads[i]  # the slot's gradient, as one or more tensors
            if not math.isfinite(norm):
                _zero(grads)
                reports[slot] = StepReport(
                    False, norm, self.steps.get(slot, 0), f"non-finite gradient norm ({norm})"
                )
                continue
            coef = min(hp.grad_clip_norm / (norm + 1e-6), 1.0) if hp.grad_clip_norm > 0 else 1.0
            if coef != 1.0 and grads:  # a product by 1.0 is exact: skipping it changes no bit
                torch._foreach_mul_(grads, coef)
            step = self.steps.get(slot, 0) + 1
            if fused[i] and _fused_step_is_safe(hp, step, norm * coef, *peaks[i]):
                self.steps[slot] = step
                self._bounds[slot] = _next_bounds(hp, step, norm * coef, *peaks[i])
                key = (hp.learning_rate, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, step)
                groups.setdefault(key, []).append(i)
                reports[slot] = StepReport(True, norm, step)
            else:
                self._bounds.pop(slot, None)  # measured again before its next fused step
                if v is None:  # a row plan the bound cannot certify: the checked path, per tensor
                    v = self._views(slot, tensors)
                    present = [g for g in v.grads if g is not None]
                reports[slot] = self._checked_step(slot, tensors, v, present, norm, hp)
        for (lr, beta1, beta2, eps, wd, step), members in groups.items():
            params: list[torch.Tensor] = []
            group_grads: list[torch.Tensor] = []
            exp_avg: list[torch.Tensor] = []
            exp_avg_sq: list[torch.Tensor] = []
            to_zero: list[torch.Tensor] = []
            in_rows: list[int] = []
            for i in members:
                v = views[i]
                if v is None:  # a row plan
                    in_rows.append(requests[i][0])
                    continue
                params += v.values
                group_grads += [
                    torch.zeros_like(p) if g is None else g for p, g in zip(v.values, v.grads, strict=True)
                ]
                exp_avg += v.exp_avg
                exp_avg_sq += v.exp_avg_sq
                to_zero += presents[i]
            if in_rows:
                rows, m_rows, v_rows = self.rows, self.exp_avg_rows, self.exp_avg_sq_rows
                assert rows is not None and m_rows is not None and v_rows is not None
                for start, stop in _runs(in_rows):  # one tensor per run of consecutive slots
                    params.append(rows.values[start:stop])
                    group_grads.append(rows.grads[start:stop])
                    exp_avg.append(m_rows[start:stop])
                    exp_avg_sq.append(v_rows[start:stop])
                    to_zero.append(rows.grads[start:stop])
            counter = torch.full((), float(step), dtype=torch.float32, device=device)
            with torch.no_grad():
                torch._fused_adamw_(
                    params,
                    group_grads,
                    exp_avg,
                    exp_avg_sq,
                    [],
                    [counter] * len(params),  # read, not written: one shared counter is enough
                    lr=lr,
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=wd,
                    eps=eps,
                    amsgrad=False,
                    maximize=False,
                )
            _zero(to_zero)
        return reports

    def _mask(self, sharded: tuple[bool, ...], device: torch.device) -> torch.Tensor:
        """A (cached) device tensor of ``sharded``, the TP mask of a row plan's gradient parts."""
        key = (sharded, device)
        mask = self._masks.get(key)
        if mask is None:
            mask = self._masks[key] = torch.tensor(sharded, dtype=torch.bool, device=device)
        return mask

    def _checked_step(
        self,
        slot: int,
        tensors: list[SlotTensor],
        views: _SlotViews,
        present: list[torch.Tensor],
        norm: float,
        hp: AdamParams,
    ) -> StepReport:
        """The step with a rollback copy and a finiteness check after it (grads already clipped)."""
        step = self.steps.get(slot, 0) + 1
        self.steps[slot] = step
        params = views.values
        group_grads = (
            present
            if len(present) == len(params)
            else [torch.zeros_like(p) if g is None else g for p, g in zip(params, views.grads, strict=True)]
        )
        exp_avg, exp_avg_sq = views.exp_avg, views.exp_avg_sq
        state = [*params, *exp_avg, *exp_avg_sq]
        with torch.no_grad():
            # The rollback copy and sqrt(v) live in one reused buffer: no allocation per tensor.
            scratch = self._scratch_views(views, 4)
            before = [*scratch[0], *scratch[1], *scratch[2]]
            if state:
                torch._foreach_copy_(before, state)  # to roll back a step that leaves non-finite values
            try:
                self._update(params, group_grads, exp_avg, exp_avg_sq, hp, step, denom=scratch[3])
                problem = (
                    None if all_finite(state, tensors) else "would have left non-finite weights or moments"
                )
            except RuntimeError as exc:  # e.g. a learning rate whose bias-corrected step overflows
                problem = f"could not be computed ({exc})"
            if problem is not None:
                torch._foreach_copy_(state, before)
                if step > 1:
                    self.steps[slot] = step - 1
                else:
                    del self.steps[slot]
                _zero(present)
                return StepReport(
                    False,
                    norm,
                    step - 1,
                    f"the step {problem} (gradient norm {norm:.3g}, learning_rate {hp.learning_rate:g}); "
                    "it was rolled back",
                )
        _zero(present)
        return StepReport(True, norm, step)

    @staticmethod
    def _update(
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avg: list[torch.Tensor],
        exp_avg_sq: list[torch.Tensor],
        hp: AdamParams,
        step: int,
        denom: list[torch.Tensor] | None = None,
    ) -> None:
        """The same elementwise math as torch.optim.AdamW, as one kernel per op for all of the
        slot's tensors (`_foreach_*`) instead of one per tensor: a few launches, not hundreds.
        ``denom``: tensors shaped like ``params`` to hold sqrt(v) (allocated when not given)."""
        if not params:
            return
        bias1 = 1 - hp.beta1**step
        bias2_sqrt = (1 - hp.beta2**step) ** 0.5
        step_size = hp.learning_rate / bias1
        if hp.weight_decay != 0:
            torch._foreach_mul_(params, 1 - hp.learning_rate * hp.weight_decay)
        torch._foreach_lerp_(exp_avg, grads, 1 - hp.beta1)
        torch._foreach_mul_(exp_avg_sq, hp.beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - hp.beta2)
        if denom is None:
            roots = list(torch._foreach_sqrt(exp_avg_sq))
        else:
            torch._foreach_copy_(denom, exp_avg_sq)
            torch._foreach_sqrt_(denom)
            roots = denom
        torch._foreach_div_(roots, bias2_sqrt)
        torch._foreach_add_(roots, hp.eps)
        torch._foreach_addcdiv_(params, exp_avg, roots, value=-step_size)


_F32_MAX = torch.finfo(torch.float32).max

def _runs(slots: list[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` of each maximal run of consecutive numbers in ``slots`` (distinct)."""
    out: list[tuple[int, int]] = []
    for s in sorted(slots):
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], s + 1)
        else:
            out.append((s, s + 1))
    return out


def _next_bounds(
    hp: AdamParams, step: int, grad_norm: float, p_max: float, m_max: float, v_max: float
) -> tuple[float, float, float]:
    """Upper bounds of |p|, |m| and v after the step (see ``_fused_step_is_safe``), each widened by
    1e-6 relative for the step's roundings; inf where a bound cannot be given."""
    g = grad_norm * (1 + 1e-6)
    m_new = max(m_max, g)
    v_new = max(v_max, g * g)
    c1 = 1 - hp.beta1**step
    if not (hp.eps > 0 and c1 > 0):
        return math.inf, math.inf, math.inf
    p_new = p_max * abs(1 - hp.learning_rate * hp.weight_decay) + abs(hp.learning_rate) / c1 * m_new / hp.eps
    widen = 1 + 1e-6
    return p_new * widen, m_new * widen, v_new * widen


def _fused_step_is_safe(
    hp: AdamParams, step: int, grad_norm: float, p_max: float, m_max: float, v_max: float
) -> bool:
    """True when an AdamW step cannot leave a non-finite value, from upper bounds of the slot's
    |p|, |m|, v and its (clipped) gradient norm, which bounds every |g|. In exact arithmetic
    |m'| <= max(|m|, |g|) (a convex combination), v' <= max(v, g^2), the denominator
    sqrt(v')/c2 + eps >= eps, so |p'| <= |p| |1 - lr wd| + lr/c1 * |m'| / eps; each bound is
    checked with a factor of 4 below float32's largest value, far more than the few roundings of
    the kernel can add."""
    if not (hp.eps > 0 and 0 <= hp.beta1 < 1 and 0 <= hp.beta2 < 1 and math.isfinite(hp.learning_rate)):
        return False
    c2 = math.sqrt(1 - hp.beta2**step)
    if c2 <= 0:
        return False
    g = grad_norm * (1 + 1e-6)
    p_new, m_new, v_new = _next_bounds(hp, step, grad_norm, p_max, m_max, v_max)
    bounds = (g * g, p_new, m_new, v_new, math.sqrt(v_new) / c2 + hp.eps)
    return all(math.isfinite(b) and b < _F32_MAX / 4 for b in bounds)


def _norms_and_peaks(
    grads: list[list[torch.Tensor]],
    sharded: list[torch.Tensor | None],
    states: list[tuple[list[torch.Tensor], ...] | None],
    device: torch.device,
) -> tuple[list[float], list[tuple[float, float, float]]]:
    """Each slot's gradient norm (as ``_grad_norm``: the same fp64 kernel, its sums masked rather
    than indexed) from its gradient tensors ``grads[i]`` (``sharded[i]``: which are TP-sharded)
    and, for the slots with ``states[i]`` (values, exp_avg, exp_avg_sq lists), the largest |p|,
    |m| and v, all-reduced over TP (a sum of the ranks' maxima: an upper bound, equal on every
    rank) and read back with one host sync."""
    all_grads = [g for slot_grads in grads for g in slot_grads]
    squares = _vector(torch._foreach_norm(all_grads, 2, dtype=torch.float64)) ** 2 if all_grads else None
    zero = torch.zeros((), dtype=torch.float64, device=device)
    sharded_sums, replicated_sums = [], []
    offset = 0
    for slot_grads, mask in zip(grads, sharded, strict=True):
        if slot_grads:
            assert squares is not None and mask is not None
            part = squares[offset : offset + len(slot_grads)]  # masked sums: no host sync (no nonzero)
            sharded_sums.append(torch.where(mask, part, 0.0).sum())
            replicated_sums.append(torch.where(mask, 0.0, part).sum())
            offset += len(slot_grads)
        else:
            sharded_sums.append(zero)
            replicated_sums.append(zero)
    columns = [torch.stack(sharded_sums)]
    state = [t for st in states if st is not None for table in st for t in table]
    if state:
        peaks_all = _vector(torch._foreach_norm(state, float("inf"))).to(torch.float64)
        peaks, offset = [], 0
        for st in states:
            if st is not None:
                n = len(st[0])
                block = peaks_all[offset : offset + 3 * n].view(3, n)
                peaks.append(block.amax(dim=1))
                offset += 3 * n
            else:
                peaks.append(torch.zeros(3, dtype=torch.float64, device=device))
        columns.append(torch.stack(peaks).T)
    n = len(grads)
    reduced = torch.cat([c.reshape(-1, n) for c in columns])
    tp_all_reduce_sum(reduced)
    norms_t = torch.sqrt(reduced[0] + torch.stack(replicated_sums))
    values = torch.cat([norms_t, reduced[1:].reshape(-1)]).tolist()
    norms = values[:n]
    rest = values[n:]
    out_peaks = [(rest[i], rest[n + i], rest[2 * n + i]) if state else (0.0, 0.0, 0.0) for i in range(n)]
    return norms, out_peaks


def _vector(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(parts)`` for the 0-d results of one ``_foreach_norm``, without the copy
    where they are the consecutive elements of one buffer (what the CUDA kernel returns):
    stacking thousands of scalars costs a few host microseconds each, the buffer nothing."""
    base = parts[0]._base if parts and parts[0].dim() == 0 else None
    if (
        base is not None
        and base.dim() == 1
        and base.numel() == len(parts)
        and base.is_contiguous()
        and all(
            p._base is base and p.dim() == 0 and p.data_ptr() == base.data_ptr() + i * base.element_size()
            for i, p in (
                (0, parts[0]),
                (len(parts) // 2, parts[len(parts) // 2]),
                (len(parts) - 1, parts[-1]),
            )
        )
    ):
        return base
    return torch.stack(list(parts))


def _zero(grads: list[torch.Tensor]) -> None:
    if grads:
        torch._foreach_zero_(grads)


def _grad_norm(present: list[torch.Tensor], sharded: torch.Tensor | None, tensors: list[SlotTensor]) -> float:
    """``grad_norm`` over prepared views: fp64 accumulation without fp64 copies of the grads."""
    device = tensors[0].param.device if tensors else torch.device("cpu")
    total_sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    if present:
        assert sharded is not None
        squares = torch.stack(torch._foreach_norm(present, 2, dtype=torch.float64)) ** 2
        total_sharded = squares[sharded].sum()
        replicated = squares[~sharded].sum()
    tp_all_reduce_sum(total_sharded)
    return float(torch.sqrt(total_sharded + replicated))


def all_finite(values: list[torch.Tensor], tensors: list[SlotTensor]) -> bool:
    """True when every element of ``values`` is finite, on every TP rank (one reduction)."""
    device = tensors[0].param.device if tensors else torch.device("cpu")
    if not values:
        return True
    peaks = torch.stack(torch._foreach_norm(values, float("inf")))  # max |x|: NaN or inf if any is
    bad = (~torch.isfinite(peaks)).sum().to(torch.float64).to(device)
    tp_all_reduce_sum(bad)
    return float(bad) == 0.0


def grad_norm(tensors: list[SlotTensor]) -> float:
    """L2 norm of the slot's full (TP-gathered) gradient; identical on every TP rank."""
    device = tensors[0].param.device if tensors else torch.device("cpu")
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    present = [(t, g) for t in tensors if (g := t.grad()) is not None]
    if present:
        norms = torch._foreach_norm([g.double() for _, g in present], 2)  # one kernel for all tensors
        squares = torch.stack(norms) ** 2
        is_sharded = torch.tensor([t.kind is not ShardKind.REPLICATED for t, _ in present], device=device)
        sharded = squares[is_sharded].sum()
        replicated = squares[~is_sharded].sum()
    tp_all_reduce_sum(sharded)
    return float(torch.sqrt(sharded + replicated))


def zero_grads(tensors: list[SlotTensor]) -> None:
    for tensor in tensors:
        g = tensor.grad()
        if g is not None:
            g.zero_()
