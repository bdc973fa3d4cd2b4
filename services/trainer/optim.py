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

Invariant: a step touches only the requested slot's parameter rows, moments and counter,
and always leaves that slot's gradients zero; a slot's parameters and moments are always
finite after it; every TP rank takes the same decisions because the norm and the finiteness
count are all-reduced before they are tested.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from libs.contracts.common import AdamParams
from services.trainer.convert import ShardKind
from services.trainer.lora import SlotTensor
from services.trainer.parallel import tp_all_reduce_sum


@dataclass(frozen=True)
class StepReport:
    """What ``optim_step`` did for one slot."""

    applied: bool
    grad_norm: float  # before clipping
    step: int  # the slot's step count after this call
    reason: str | None = None  # why the step was skipped


class SlotAdamW:
    """AdamW moments and step counters for every slot, keyed by tensor name then slot."""

    def __init__(self) -> None:
        self.exp_avg: dict[str, torch.Tensor] = {}
        self.exp_avg_sq: dict[str, torch.Tensor] = {}
        self.steps: dict[int, int] = {}

    def moments(self, tensor: SlotTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This slot's (exp_avg, exp_avg_sq) views for ``tensor``, allocated on first use."""
        if tensor.name not in self.exp_avg:
            self.exp_avg[tensor.name] = torch.zeros_like(tensor.param.data)
            self.exp_avg_sq[tensor.name] = torch.zeros_like(tensor.param.data)
        return self.exp_avg[tensor.name][tensor.index], self.exp_avg_sq[tensor.name][tensor.index]

    def reset_slot(self, slot: int) -> None:
        for table in (self.exp_avg, self.exp_avg_sq):
            for full in table.values():
                full[slot].zero_()
        self.steps.pop(slot, None)

    def step(self, slot: int, tensors: list[SlotTensor], hp: AdamParams) -> StepReport:
        """Apply one AdamW step to ``slot`` (``tensors`` = its adapter tensors), then zero grads."""
        grads = [t.grad() for t in tensors]
        norm = grad_norm(tensors)
        if not math.isfinite(norm):
            zero_grads(tensors)
            return StepReport(False, norm, self.steps.get(slot, 0), f"non-finite gradient norm ({norm})")
        if hp.grad_clip_norm > 0:
            coef = min(hp.grad_clip_norm / (norm + 1e-6), 1.0)
            for g in grads:
                if g is not None:
                    g.mul_(coef)
        step = self.steps.get(slot, 0) + 1
        self.steps[slot] = step
        params = [t.value() for t in tensors]
        grads_ = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
        exp_avg, exp_avg_sq = zip(*(self.moments(t) for t in tensors), strict=True) if tensors else ((), ())
        state = [*params, *exp_avg, *exp_avg_sq]
        with torch.no_grad():
            before = [t.clone() for t in state]  # to roll back a step that leaves non-finite values
            try:
                self._update(params, grads_, list(exp_avg), list(exp_avg_sq), hp, step)
                problem = None if all_finite(state, tensors) else "would have left non-finite weights or moments"
            except RuntimeError as exc:  # e.g. a learning rate whose bias-corrected step overflows
                problem = f"could not be computed ({exc})"
            if problem is not None:
                torch._foreach_copy_(state, before)
                if step > 1:
                    self.steps[slot] = step - 1
                else:
                    del self.steps[slot]
                zero_grads(tensors)
                return StepReport(
                    False,
                    norm,
                    step - 1,
                    f"the step {problem} (gradient norm {norm:.3g}, learning_rate {hp.learning_rate:g}); "
                    "it was rolled back",
                )
        zero_grads(tensors)
        return StepReport(True, norm, step)

    @staticmethod
    def _update(
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avg: list[torch.Tensor],
        exp_avg_sq: list[torch.Tensor],
        hp: AdamParams,
        step: int,
    ) -> None:
        """The same elementwise math as torch.optim.AdamW, as one kernel per op for all of the
        slot's tensors (`_foreach_*`) instead of one per tensor: a few launches, not hundreds."""
        bias1 = 1 - hp.beta1**step
        bias2_sqrt = (1 - hp.beta2**step) ** 0.5
        step_size = hp.learning_rate / bias1
        if hp.weight_decay != 0:
            torch._foreach_mul_(params, 1 - hp.learning_rate * hp.weight_decay)
        torch._foreach_lerp_(exp_avg, grads, 1 - hp.beta1)
        torch._foreach_mul_(exp_avg_sq, hp.beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - hp.beta2)
        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, hp.eps)
        torch._foreach_addcdiv_(params, exp_avg, denom, value=-step_size)


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
