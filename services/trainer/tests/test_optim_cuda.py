"""``SlotAdamW`` on CUDA: the same step as ``torch.optim.AdamW`` there, and slots stay isolated.

A unit test of the optimizer alone (no model): slot-indexed parameters shaped like the engine's
(``[slots, rank, in]`` for A, ``[slots, out, rank]`` for B), stepped through ``SlotTensor`` views.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.trainer.convert import ShardKind
from services.trainer.lora import SlotTensor
from services.trainer.optim import AdamParams, SlotAdamW

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
U32 = 2.0**-24


@pytest.fixture(autouse=True)
def _model_parallel() -> None:
    from services.trainer.parallel import ensure_model_parallel

    ensure_model_parallel("cuda")  # the step's norm is all-reduced over TP (one rank here)


def _pool(slots: int, rank: int, seed: int) -> list[nn.Parameter]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(slots, rank, 64), (slots, 96, rank), (slots, rank, 48), (slots, 64, rank)]
    params = [nn.Parameter(torch.randn(s, generator=gen, device="cuda") * 0.1) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, device="cuda") * 1e-2
    return params


def _tensors(params: list[nn.Parameter], slot: int, rank: int) -> list[SlotTensor]:
    out = []
    for i, p in enumerate(params):
        index = (slot, slice(0, rank)) if i % 2 == 0 else (slot, slice(None), slice(0, rank))
        out.append(SlotTensor(f"t{i}", p, index, ShardKind.REPLICATED))
    return out


def test_slot_adamw_equals_torch_adamw_on_cuda() -> None:
    """Three steps of one slot equal torch.optim.AdamW on copies of that slot's tensors, within
    eight fp32 roundings of |p| plus the update (the two may order the elementwise ops differently)."""
    params = _pool(slots=3, rank=8, seed=0)
    opt = SlotAdamW()
    hp = AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1)
    ref = [nn.Parameter(t.value().clone()) for t in _tensors(params, 1, 8)]
    ref_opt = torch.optim.AdamW(
        ref, lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay
    )
    gen = torch.Generator(device="cuda").manual_seed(5)
    for step in range(1, 4):
        for p, r, t in zip(params, ref, _tensors(params, 1, 8), strict=True):
            g = torch.randn(t.value().shape, generator=gen, device="cuda") * 1e-2
            p.grad[t.index] = g  # type: ignore[index]
            r.grad = g.clone()
        report = opt.step(1, _tensors(params, 1, 8), hp)
        ref_opt.step()
        assert report.applied and report.step == step
        bound_scale = step * 8 * U32
        for t, r in zip(_tensors(params, 1, 8), ref, strict=True):
            diff = (t.value() - r.detach()).abs()
            assert bool(
                (diff <= bound_scale * (r.detach().abs() + hp.learning_rate / (1 - hp.beta2) ** 0.5)).all()
            ), t.name
        assert all(float(t.grad().abs().max()) == 0 for t in _tensors(params, 1, 8))  # type: ignore[union-attr]


def test_slot_adamw_on_cuda_touches_only_the_stepped_slot() -> None:
    """Stepping slot 0 then slot 2 leaves slot 1's parameters and gradients bit-identical."""
    params = _pool(slots=3, rank=8, seed=1)
    before = [(t.value().clone(), t.grad().clone()) for t in _tensors(params, 1, 8)]  # type: ignore[union-attr]
    opt = SlotAdamW()
    hp = AdamParams(learning_rate=1e-2)
    for slot in (0, 2, 0):
        assert opt.step(slot, _tensors(params, slot, 8), hp).applied
    for (value, grad), t in zip(before, _tensors(params, 1, 8), strict=True):
        assert torch.equal(value, t.value()) and torch.equal(grad, t.grad())  # type: ignore[arg-type]
