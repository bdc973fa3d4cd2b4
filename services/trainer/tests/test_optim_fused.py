"""``SlotAdamW.step_many`` with the fused update: several slots in one call, each exactly as
``torch.optim.AdamW(fused=True)`` on copies of that slot's tensors; steps the finiteness bound
cannot certify take the checked path (rollback) without disturbing the others.

A unit test of the optimizer alone (no model): slot-indexed parameters shaped like the engine's
(``[slots, rank, in]`` for A, ``[slots, out, rank]`` for B), stepped through ``SlotTensor`` views.
Each test runs on the CPU (``fused=True`` forces the fused kernel there) and, where there is one,
on CUDA (the default picks it).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from services.trainer.convert import ShardKind
from services.trainer.lora import SlotTensor
from services.trainer.optim import AdamParams, SlotAdamW

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


@pytest.fixture(autouse=True)
def _model_parallel() -> None:
    from services.trainer.parallel import ensure_model_parallel

    ensure_model_parallel("cuda" if torch.cuda.is_available() else "cpu")  # the norms are all-reduced over TP


def _pool(slots: int, rank: int, device: str, seed: int) -> list[nn.Parameter]:
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = [(slots, rank, 64), (slots, 96, rank), (slots, rank, 48), (slots, 64, rank)]
    return [nn.Parameter(torch.randn(s, generator=gen, device=device) * 0.1) for s in shapes]


def _tensors(params: list[nn.Parameter], slot: int, rank: int) -> list[SlotTensor]:
    out = []
    for i, p in enumerate(params):
        index = (slot, slice(0, rank)) if i % 2 == 0 else (slot, slice(None), slice(0, rank))
        out.append(SlotTensor(f"t{i}", p, index, ShardKind.REPLICATED))
    return out


def _set_grads(
    params: list[nn.Parameter], slot: int, rank: int, gen: torch.Generator, scale: float
) -> list[torch.Tensor]:
    out = []
    for p, t in zip(params, _tensors(params, slot, rank), strict=True):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        g = torch.randn(t.value().shape, generator=gen, device=p.device) * scale
        p.grad[t.index] = g  # type: ignore[index]
        out.append(g)
    return out


def _torch_fused_adamw(
    refs: dict[int, list[nn.Parameter]], hps: dict[int, AdamParams]
) -> dict[int, torch.optim.AdamW]:
    """The reference: one `torch.optim.AdamW(fused=True)` per slot, with that slot's parameters."""
    return {
        s: torch.optim.AdamW(
            refs[s],
            lr=hp.learning_rate,
            betas=(hp.beta1, hp.beta2),
            eps=hp.eps,
            weight_decay=hp.weight_decay,
            fused=True,
        )
        for s, hp in hps.items()
    }


def _optimizer(device: str) -> SlotAdamW:
    return SlotAdamW(fused=True) if device == "cpu" else SlotAdamW()


@pytest.mark.parametrize("device", DEVICES)
def test_fused_step_many_equals_torch_fused_adamw_per_slot(device: str) -> None:
    """Three calls stepping slots 0, 1 and 3 together (0 and 3 with the same hyper-parameters,
    1 with others and gradient clipping): every slot's weights equal torch.optim.AdamW(fused=True)
    (after clip_grad_norm_ for slot 1) bit for bit, the reported norms equal the reference's within
    fp64 rounding, every stepped slot's gradients are zero, and slot 2 is untouched."""
    rank, slots = 8, 4
    params = _pool(slots, rank, device, seed=0)
    gen = torch.Generator(device=device).manual_seed(3)
    for slot in range(slots):
        _set_grads(params, slot, rank, gen, 0.0)
    hps = {
        0: AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1),
        1: AdamParams(
            learning_rate=3e-3, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.0, grad_clip_norm=0.05
        ),
        3: AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1),
    }
    refs = {s: [nn.Parameter(t.value().detach().clone()) for t in _tensors(params, s, rank)] for s in hps}
    ref_opts = _torch_fused_adamw(refs, hps)
    untouched = [t.value().detach().clone() for t in _tensors(params, 2, rank)]
    opt = _optimizer(device)
    for step in range(1, 4):
        for s in hps:
            for r, g in zip(refs[s], _set_grads(params, s, rank, gen, 1e-2), strict=True):
                r.grad = g.clone()
        reports = opt.step_many([(s, _tensors(params, s, rank), hp) for s, hp in hps.items()])
        for s, hp in hps.items():
            clip = hp.grad_clip_norm if hp.grad_clip_norm > 0 else math.inf
            ref_norm = float(torch.nn.utils.clip_grad_norm_(refs[s], clip, foreach=True))
            ref_opts[s].step()
            assert reports[s].applied and reports[s].step == step, (s, reports[s])
            assert math.isclose(reports[s].grad_norm, ref_norm, rel_tol=1e-6), (
                s,
                reports[s].grad_norm,
                ref_norm,
            )
            for t, r in zip(_tensors(params, s, rank), refs[s], strict=True):
                if hp.grad_clip_norm > 0:
                    # the clip coefficient comes from an fp64 norm here and an fp32 one in torch: the
                    # clipped gradients differ by a rounding, which Adam carries into the update
                    bound = (
                        step * 8 * 2.0**-24 * (r.detach().abs() + hp.learning_rate / math.sqrt(1 - hp.beta2))
                    )
                    assert bool(((t.value() - r.detach()).abs() <= bound).all()), (s, t.name)
                else:
                    assert torch.equal(t.value(), r.detach()), (s, t.name)
                assert float(t.grad().abs().max()) == 0, (s, t.name)  # type: ignore[union-attr]
    for before, t in zip(untouched, _tensors(params, 2, rank), strict=True):
        assert torch.equal(before, t.value())


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_the_bound_cannot_certify_is_rolled_back_alone(device: str) -> None:
    """In one call, slot 0 with a learning rate that overflows float32 takes the checked path: its
    step is reported as rolled back, and its weights, moments and step count are as before; slot 1
    in the same call is stepped exactly as torch.optim.AdamW(fused=True) steps it."""
    rank = 8
    params = _pool(2, rank, device, seed=1)
    gen = torch.Generator(device=device).manual_seed(4)
    _set_grads(params, 0, rank, gen, 1e-2)
    good_hp = AdamParams(learning_rate=1e-2)
    ref = [nn.Parameter(t.value().detach().clone()) for t in _tensors(params, 1, rank)]
    for r, g in zip(ref, _set_grads(params, 1, rank, gen, 1e-2), strict=True):
        r.grad = g.clone()
    opt = _optimizer(device)
    before = [t.value().detach().clone() for t in _tensors(params, 0, rank)]
    reports = opt.step_many(
        [
            (0, _tensors(params, 0, rank), AdamParams(learning_rate=1e38)),
            (1, _tensors(params, 1, rank), good_hp),
        ]
    )
    assert not reports[0].applied and reports[0].step == 0
    assert reports[0].reason is not None and "rolled back" in reports[0].reason
    assert all(torch.equal(b, t.value()) for b, t in zip(before, _tensors(params, 0, rank), strict=True))
    assert all(float(m.abs().max()) == 0 for m in opt.exp_avg.values() for m in [m[0]])
    assert 0 not in opt.steps
    torch.optim.AdamW(
        ref,
        lr=good_hp.learning_rate,
        betas=(good_hp.beta1, good_hp.beta2),
        eps=good_hp.eps,
        weight_decay=good_hp.weight_decay,
        fused=True,
    ).step()
    assert reports[1].applied and reports[1].step == 1
    assert all(
        torch.equal(t.value(), r.detach()) for t, r in zip(_tensors(params, 1, rank), ref, strict=True)
    )


def test_a_slot_below_the_pool_rank_takes_the_unfused_path_bit_equal_to_torch() -> None:
    """A slot whose rank is below the pool's (its B views are strided, which the fused kernel does
    not take) is stepped by the checked path, bit-equal to torch.optim.AdamW's default on the CPU,
    even with ``fused=True``."""
    params = _pool(2, 8, "cpu", seed=2)
    gen = torch.Generator().manual_seed(5)
    hp = AdamParams(learning_rate=1e-2, weight_decay=0.05)
    ref = [nn.Parameter(t.value().detach().clone()) for t in _tensors(params, 0, 4)]
    ref_opt = torch.optim.AdamW(
        ref, lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay
    )
    opt = SlotAdamW(fused=True)
    for step in range(1, 3):
        for r, g in zip(ref, _set_grads(params, 0, 4, gen, 1e-2), strict=True):
            r.grad = g.clone()
        report = opt.step_many([(0, _tensors(params, 0, 4), hp)])[0]
        ref_opt.step()
        assert report.applied and report.step == step
        assert all(
            torch.equal(t.value(), r.detach()) for t, r in zip(_tensors(params, 0, 4), ref, strict=True)
        )


def test_bounds_are_measured_again_after_a_slot_is_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    """The finiteness bounds carried from step to step are forgotten by ``reset_slot`` (what every
    load of a slot does first): a slot reloaded with weights near float32's largest value is not
    given to the fused kernel (counted here), and its step is still applied and finite."""
    calls: list[int] = []
    real = torch._fused_adamw_

    def counting(*args: object, **kwargs: object) -> None:
        calls.append(1)
        real(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(torch, "_fused_adamw_", counting)
    params = _pool(1, 8, "cpu", seed=3)
    gen = torch.Generator().manual_seed(6)
    opt = SlotAdamW(fused=True)
    hp = AdamParams(learning_rate=1e-3)
    for _ in range(2):
        _set_grads(params, 0, 8, gen, 1e-2)
        assert opt.step_many([(0, _tensors(params, 0, 8), hp)])[0].applied
    assert len(calls) == 2
    opt.reset_slot(0)
    with torch.no_grad():
        for t in _tensors(params, 0, 8):
            t.value().fill_(1e38)
    _set_grads(params, 0, 8, gen, 1e-2)
    report = opt.step_many([(0, _tensors(params, 0, 8), hp)])[0]
    assert len(calls) == 2, "a reloaded slot with extreme weights reached the fused kernel"
    assert report.applied and all(bool(torch.isfinite(t.value()).all()) for t in _tensors(params, 0, 8))


def _rows_pool(slots: int, rank: int, device: str, seed: int) -> tuple[Any, list[nn.Parameter]]:
    """A ``PooledRows`` whose every slot trains whole rows (its rank is the pool's), random."""
    from services.trainer.lora import PooledRows

    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = [(slots, rank, 48), (slots, 32, rank), (slots, rank, 16), (slots, 64, rank)]
    rows = PooledRows([(f"t{i}", s, False) for i, s in enumerate(shapes)], device)
    params = [rows.parameter(f"t{i}", s) for i, s in enumerate(shapes)]
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.1)
    return rows, params


def _rows_optimizer(device: str, rows: Any) -> SlotAdamW:
    return SlotAdamW(fused=True, rows=rows) if device == "cpu" else SlotAdamW(rows=rows)


@pytest.mark.parametrize("device", DEVICES)
def test_consecutive_slots_are_updated_as_one_tensor_per_run_bit_equal_to_torch_per_slot(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slots 0-2 and 4 share hyper-parameters, slot 3 has others, slot 5 is not stepped. The fused
    kernel is given one tensor per run of consecutive slots of the pool's rows (runs 0-2 and 4,
    then 3: 3 tensors, not 20), and over three calls every stepped slot's weights equal
    torch.optim.AdamW(fused=True) on copies of that slot alone bit for bit, its gradients are
    zero, and slot 5's weights, gradients and moments are untouched."""
    rank, slots = 4, 6
    rows, params = _rows_pool(slots, rank, device, seed=7)
    gen = torch.Generator(device=device).manual_seed(8)
    for slot in range(slots):
        _set_grads(params, slot, rank, gen, 1e-2)
    shared = AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1)
    hps = {0: shared, 1: shared, 2: shared, 3: AdamParams(learning_rate=3e-3), 4: shared}
    refs = {s: [nn.Parameter(t.value().detach().clone()) for t in _tensors(params, s, rank)] for s in hps}
    ref_opts = _torch_fused_adamw(refs, hps)
    untouched = (rows.values[5].clone(), rows.grads[5].clone())
    sizes: list[int] = []
    real = torch._fused_adamw_

    def counting(params_: list[torch.Tensor], *args: object, **kwargs: object) -> None:
        sizes.append(len(params_))
        real(params_, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(torch, "_fused_adamw_", counting)
    opt = _rows_optimizer(device, rows)
    for step in range(1, 4):
        for s in hps:
            for r, g in zip(refs[s], _set_grads(params, s, rank, gen, 1e-2), strict=True):
                r.grad = g.clone()
        sizes.clear()
        reports = opt.step_many([(s, _tensors(params, s, rank), hp) for s, hp in hps.items()])
        assert sorted(sizes) == [1, 2], sizes
        for s in hps:
            ref_opts[s].step()
            assert reports[s].applied and reports[s].step == step, (s, reports[s])
            for t, r in zip(_tensors(params, s, rank), refs[s], strict=True):
                assert torch.equal(t.value(), r.detach()), (step, s, t.name)
            assert int(torch.count_nonzero(rows.grads[s])) == 0, s
    assert torch.equal(rows.values[5], untouched[0]) and torch.equal(rows.grads[5], untouched[1])
    assert opt.exp_avg_rows is not None and opt.exp_avg_sq_rows is not None
    assert int(torch.count_nonzero(opt.exp_avg_rows[5])) == 0 and int(torch.count_nonzero(opt.exp_avg_sq_rows[5])) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_norm_results_are_read_as_one_vector_equal_to_stacking_them(device: str) -> None:
    """``_vector`` of ``_foreach_norm``'s results, of the elements of one buffer and of a strided
    view's elements each equals ``torch.stack`` of the same scalars (the buffer itself is reused
    only where the scalars are its consecutive elements)."""
    from services.trainer.optim import _vector

    gen = torch.Generator(device=device).manual_seed(9)
    tensors = [torch.randn(n, generator=gen, device=device) for n in (3, 70, 1, 513)]
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float64)
    assert torch.equal(_vector(norms), torch.stack(norms))
    buffer = torch.arange(7.0, device=device)
    assert _vector(list(buffer.unbind(0))) is buffer
    strided = list(torch.arange(12.0, device=device)[::3].unbind(0))
    assert torch.equal(_vector(strided), torch.stack(strided))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


@pytest.mark.parametrize("device", DEVICES)
def test_pooled_rows_are_clipped_by_each_slots_own_norm_as_when_stepped_alone(device: str) -> None:
    """Slots 0-3 of a pool's rows, every slot training its whole row, are clipped (a clip norm far below
    their gradients' norms) and stepped in one call; on copies of the same pool each of them is
    stepped alone. Their reported norms, weights and moments are bit-identical both ways (a
    slot's norm and clip coefficient come from its own rows only), and slot 4, which is not
    stepped and holds a pending gradient with a NaN, keeps that gradient bit for bit."""
    rank, slots = 4, 5
    hp = AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1, grad_clip_norm=1e-3)
    built = [_rows_pool(slots, rank, device, seed=11) for _ in range(2)]
    pools = [params for _, params in built]
    for params in pools:
        _set_grads(params, 4, rank, torch.Generator(device=device).manual_seed(12), 1.0)
        params[0].grad[4, 0, 0] = float("nan")  # type: ignore[index]
    pending = [_bits(t.grad()) for t in _tensors(pools[0], 4, rank)]  # type: ignore[arg-type]
    together, alone = _rows_optimizer(device, built[0][0]), _rows_optimizer(device, built[1][0])
    for step in range(2):
        for params in pools:
            gen = torch.Generator(device=device).manual_seed(13 + step)
            for slot in range(4):
                _set_grads(params, slot, rank, gen, 1.0)
        shared = together.step_many([(s, _tensors(pools[0], s, rank), hp) for s in range(4)])
        single = {s: alone.step(s, _tensors(pools[1], s, rank), hp) for s in range(4)}
        for s in range(4):
            assert shared[s].applied and single[s].applied
            assert (
                shared[s].grad_norm == single[s].grad_norm and shared[s].grad_norm > 100 * hp.grad_clip_norm
            )
            for a, b in zip(_tensors(pools[0], s, rank), _tensors(pools[1], s, rank), strict=True):
                assert torch.equal(_bits(a.value()), _bits(b.value())), (s, a.name)
                m_a, v_a = together.moments(a)
                m_b, v_b = alone.moments(b)
                assert torch.equal(_bits(m_a), _bits(m_b)) and torch.equal(_bits(v_a), _bits(v_b)), (
                    s,
                    a.name,
                )
        for t, before in zip(_tensors(pools[0], 4, rank), pending, strict=True):
            assert torch.equal(_bits(t.grad()), before), t.name  # type: ignore[arg-type]


@pytest.mark.parametrize("device", DEVICES)
def test_pooled_rows_step_equals_torch_fused_adamw_per_slot(device: str) -> None:
    """Parameters laid out as a pool's ``PooledRows`` (pool rank 16): slots 0 (rank 16) and 2
    (rank 8, clipped) stepped in one call, three times, whole rows at a time. Each slot's trained
    entries equal torch.optim.AdamW(fused=True) on copies of them (bit for bit unclipped, within the
    clip coefficient's rounding clipped), every entry it does not train stays exactly zero, its
    gradient row is zero after each step, and slot 1's row is untouched."""
    from services.trainer.lora import PooledRows

    pool_rank, slots = 16, 3
    shapes = [(slots, pool_rank, 64), (slots, 96, pool_rank), (slots, pool_rank, 48), (slots, 64, pool_rank)]
    rows = PooledRows([(f"t{i}", s, i % 2 == 0) for i, s in enumerate(shapes)], device)
    params = [rows.parameter(f"t{i}", s) for i, s in enumerate(shapes)]
    ranks = {0: 16, 1: 16, 2: 8}
    gen = torch.Generator(device=device).manual_seed(5)
    with torch.no_grad():
        for s, rank in ranks.items():
            for t in _tensors(params, s, rank):
                t.value().copy_(torch.randn(t.value().shape, generator=gen, device=device) * 0.1)
    hps = {
        0: AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1),
        2: AdamParams(learning_rate=3e-3, weight_decay=0.01, grad_clip_norm=0.05),
    }
    refs = {s: [nn.Parameter(t.value().detach().clone()) for t in _tensors(params, s, ranks[s])] for s in hps}
    ref_opts = _torch_fused_adamw(refs, hps)
    untouched = rows.values[1].clone()
    opt = SlotAdamW(fused=True, rows=rows) if device == "cpu" else SlotAdamW(rows=rows)
    for step in range(1, 4):
        for s in hps:
            for r, g in zip(refs[s], _set_grads(params, s, ranks[s], gen, 1e-2), strict=True):
                r.grad = g.clone()
        reports = opt.step_many([(s, _tensors(params, s, ranks[s]), hp) for s, hp in hps.items()])
        for s, hp in hps.items():
            clip = hp.grad_clip_norm if hp.grad_clip_norm > 0 else math.inf
            ref_norm = float(torch.nn.utils.clip_grad_norm_(refs[s], clip, foreach=True))
            ref_opts[s].step()
            assert reports[s].applied and reports[s].step == step, (s, reports[s])
            assert math.isclose(reports[s].grad_norm, ref_norm, rel_tol=1e-6), (s, reports[s].grad_norm, ref_norm)
            trained = torch.zeros(rows.width, dtype=torch.bool, device=device)
            for t, r in zip(_tensors(params, s, ranks[s]), refs[s], strict=True):
                mask = rows.view(trained[None].expand(slots, -1), t.name, tuple(t.param.shape))
                mask[t.index] = True  # type: ignore[index]
                if hp.grad_clip_norm > 0:
                    bound = step * 8 * 2.0**-24 * (r.detach().abs() + hp.learning_rate / math.sqrt(1 - hp.beta2))
                    assert bool(((t.value() - r.detach()).abs() <= bound).all()), (s, t.name)
                else:
                    assert torch.equal(t.value(), r.detach()), (s, t.name)
            assert int(torch.count_nonzero(rows.values[s][~trained])) == 0, f"slot {s}: an untrained entry moved"
            assert int(torch.count_nonzero(rows.grads[s])) == 0, f"slot {s}: gradients left after the step"
    assert torch.equal(rows.values[1], untouched)


def test_a_replaced_grad_is_stepped_from_that_grad_not_from_the_rows() -> None:
    """A parameter of the rows whose ``.grad`` was set to a tensor of its own (the rows no longer
    hold its gradient): the optimizer notices and steps every tensor from its own ``.grad``,
    exactly as an optimizer without rows does."""
    from services.trainer.lora import PooledRows

    shapes = [(2, 8, 64), (2, 64, 8)]
    results = []
    for with_rows in (True, False):
        rows = PooledRows([(f"t{i}", s, False) for i, s in enumerate(shapes)], "cpu")
        params = [rows.parameter(f"t{i}", s) for i, s in enumerate(shapes)]
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in params:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        params[1].grad = torch.randn(params[1].shape, generator=gen) * 1e-2  # replaced, not in the rows
        assert params[0].grad is not None
        params[0].grad.copy_(torch.randn(params[0].shape, generator=gen) * 1e-2)
        assert rows.intact() is False
        opt = SlotAdamW(fused=True, rows=rows if with_rows else None)
        tensors = _tensors(params, 0, 8)
        report = opt.step_many([(0, tensors, AdamParams(learning_rate=1e-2))])[0]
        assert report.applied
        results.append([t.value().clone() for t in tensors])
    for got, want in zip(results[0], results[1], strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_a_row_plan_the_bound_cannot_certify_is_rolled_back_alone(device: str) -> None:
    """The pool's rows: in one call, slot 0 with a learning rate that overflows float32 leaves the
    whole-row update for the checked path, is reported as rolled back, and keeps its weights,
    moments and step count; slot 1 in the same call is stepped exactly as
    torch.optim.AdamW(fused=True) steps copies of its tensors."""
    rank = 4
    rows, params = _rows_pool(2, rank, device, seed=21)
    gen = torch.Generator(device=device).manual_seed(22)
    _set_grads(params, 0, rank, gen, 1e-2)
    good_hp = AdamParams(learning_rate=1e-2)
    ref = [nn.Parameter(t.value().detach().clone()) for t in _tensors(params, 1, rank)]
    for r, g in zip(ref, _set_grads(params, 1, rank, gen, 1e-2), strict=True):
        r.grad = g.clone()
    opt = _rows_optimizer(device, rows)
    before = rows.values[0].clone()
    reports = opt.step_many(
        [
            (0, _tensors(params, 0, rank), AdamParams(learning_rate=1e38)),
            (1, _tensors(params, 1, rank), good_hp),
        ]
    )
    assert not reports[0].applied and reports[0].step == 0
    assert reports[0].reason is not None and "rolled back" in reports[0].reason
    assert torch.equal(rows.values[0], before) and 0 not in opt.steps
    assert opt.exp_avg_rows is not None and int(torch.count_nonzero(opt.exp_avg_rows[0])) == 0
    assert int(torch.count_nonzero(rows.grads[0])) == 0
    _torch_fused_adamw({1: ref}, {1: good_hp})[1].step()
    assert reports[1].applied and reports[1].step == 1
    assert all(torch.equal(t.value(), r.detach()) for t, r in zip(_tensors(params, 1, rank), ref, strict=True))
