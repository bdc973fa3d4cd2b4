"""The adapters' compute copies (lora.py): kept equal to their fp32 masters by every change of
a slot, and a bf16 forward over them agrees with an fp32 one.

CPU and CUDA: after init, a load (``set_slot_state``), ``optim_step``, a direct in-place write to
a master and a release, every slot's ``compute_A`` is its masters' ``A`` cast to the model's
dtype and ``compute_B`` the block-diagonal ``(alpha/rank) * B`` cast likewise, zeros elsewhere,
bit for bit, and gradients accumulate in fp32 in the masters. CUDA: a bf16 engine and an fp32
engine with the same weights and adapters agree within the stated bf16 bound.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.trainer.engine import AdamParams, EngineConfig, LoraConfig, TrainerEngine
from services.trainer.lora import SlotAdapter, lora_scaling
from services.trainer.tests.helpers import ce_datum, randomize_slot


def _expected_copies(adapter: SlotAdapter, slot: int, rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What the copies of ``slot`` must hold (rank None: an uninitialised slot, all zeros)."""
    dtype = adapter.compute_A.dtype
    a = torch.zeros_like(adapter.compute_A[slot])
    b = torch.zeros_like(adapter.compute_B[slot])
    if rank is None:
        return a, b
    full = adapter.parts * adapter.max_rank
    a[:full] = adapter.lora_A.data[slot].flatten(0, 1).to(dtype)
    scaled = (adapter.lora_B.data[slot] * lora_scaling(rank)).to(dtype)  # [out, r_max]
    if adapter.part_mask is None:
        b[:, : adapter.max_rank] = scaled
    else:
        parts = adapter.part_mask.long().argmax(1)
        for p in range(adapter.parts):
            rows = parts == p
            b[rows, p * adapter.max_rank : (p + 1) * adapter.max_rank] = scaled[rows]
    return a, b


def _assert_copies_current(engine: TrainerEngine) -> None:
    for adapter in engine.pool.adapters.values():
        assert isinstance(adapter, SlotAdapter)
        adapter.ensure_synced()
        for slot in range(engine.config.num_slots):
            config = engine.pool.configs.get(slot)
            a, b = _expected_copies(adapter, slot, config.rank if config else None)
            assert torch.equal(adapter.compute_A[slot], a), (adapter.target.path, slot, "A")
            assert torch.equal(adapter.compute_B[slot], b), (adapter.target.path, slot, "B")
        assert float(adapter.compute_A[-1].abs().max()) == 0 and float(adapter.compute_B[-1].abs().max()) == 0


def _copies_follow_every_change(engine: TrainerEngine) -> None:
    randomize_slot(engine, 0, LoraConfig(rank=8, seed=1), seed=1)
    randomize_slot(engine, 2, LoraConfig(rank=3, seed=2, train_attn=False), seed=2)
    _assert_copies_current(engine)  # after init and load
    rng = np.random.default_rng(0)
    engine.forward_backward([ce_datum(rng, 0, 9), ce_datum(rng, 2, 7)], "cross_entropy")
    grads = engine.pool.adapter("output_layer").lora_B.grad
    assert grads is not None and grads.dtype == torch.float32 and float(grads[0].abs().max()) > 0
    engine.optim_step({0: AdamParams(learning_rate=1e-2), 2: AdamParams(learning_rate=1e-2)})
    _assert_copies_current(engine)  # after a step
    adapter = engine.pool.adapter("decoder.layers.0.mlp.linear_fc1")
    with torch.no_grad():
        adapter.lora_B[0].mul_(2.0)  # a direct write to a master
    _assert_copies_current(engine)
    engine.release_slot(2)
    _assert_copies_current(engine)


def test_copies_follow_every_change_on_cpu(engine: TrainerEngine) -> None:
    """CPU (fp32 copies): init, load, step, a direct master write and a release."""
    _copies_follow_every_change(engine)


@pytest.fixture(scope="module")
def cuda_engines(qwen_dir: Path) -> dict[torch.dtype, TrainerEngine]:
    return {
        dtype: TrainerEngine(
            EngineConfig(
                str(qwen_dir),
                num_slots=4,
                max_lora_rank=8,
                device="cuda",
                dtype=dtype,
                attention_backend="sdpa_per_document",
            )
        )
        for dtype in (torch.bfloat16, torch.float32)
    }


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copies_follow_every_change(cuda_engines: dict[torch.dtype, TrainerEngine]) -> None:
    """CUDA (bf16 copies of fp32 masters): init, load, step, a direct master write, a release."""
    engine = cuda_engines[torch.bfloat16]
    try:
        _copies_follow_every_change(engine)
    finally:
        for slot in range(4):
            engine.release_slot(slot)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused", [False, True], ids=["unfused-ce", "fused-ce"])
def test_cuda_bf16_matches_fp32(cuda_engines: dict[torch.dtype, TrainerEngine], fused: bool) -> None:
    """Three co-packed slots (ranks 8, 4, 2; one without MLP adapters) on a bf16 engine (grouped
    matmuls over the bf16 copies) and an fp32 engine (per-segment, fp32). The bound is the bf16
    floor of the model itself: the largest logprob difference of the same batch with every
    adapter's B zero (the base model alone, rounded the same way). With the adapters on, the
    logprobs differ by at most twice that floor plus 0.05; every gradient (fp32 in the masters on
    both engines) is within 10 % of its tensor's largest entry; all finite."""
    runs: dict[tuple[torch.dtype, bool], tuple] = {}
    for dtype, engine in cuda_engines.items():
        engine.fused_ce = fused
        try:
            for adapted in (False, True):
                if adapted:
                    randomize_slot(engine, 0, LoraConfig(rank=8, seed=1), seed=1, std=0.1)
                    randomize_slot(engine, 1, LoraConfig(rank=4, seed=2), seed=2, std=0.1)
                    randomize_slot(engine, 3, LoraConfig(rank=2, seed=3, train_mlp=False), seed=3, std=0.1)
                else:  # B = 0: the base model alone
                    engine.init_slot(0, LoraConfig(rank=8, seed=1))
                    engine.init_slot(1, LoraConfig(rank=4, seed=2))
                    engine.init_slot(3, LoraConfig(rank=2, seed=3, train_mlp=False))
                rng = np.random.default_rng(4)
                datums = [ce_datum(rng, s, n) for s, n in ((1, 40), (0, 64), (3, 24), (0, 32), (1, 16))]
                outputs = engine.forward_backward(datums, "cross_entropy")
                runs[(dtype, adapted)] = (outputs, {s: engine.get_slot_grads(s) for s in (0, 1, 3)})
                for slot in range(4):
                    engine.release_slot(slot)
        finally:
            engine.fused_ce = None

    def worst(adapted: bool) -> float:
        pairs = zip(runs[(torch.bfloat16, adapted)][0], runs[(torch.float32, adapted)][0], strict=True)
        return max(float(np.abs(a.logprobs - b.logprobs).max()) for a, b in pairs)

    floor = worst(False)
    assert all(np.isfinite(o.logprobs).all() for o in runs[(torch.bfloat16, True)][0])
    assert worst(True) <= 2 * floor + 0.05, (worst(True), floor)
    low, high = runs[(torch.bfloat16, True)][1], runs[(torch.float32, True)][1]
    for slot, grads in high.items():
        for name, want in grads.items():
            got = low[slot][name]
            assert got.dtype == torch.float32 and bool(torch.isfinite(got).all()), name
            bound = 0.1 * float(want.abs().max())
            assert bound > 0, name
            assert float((got - want).abs().max()) <= bound, (slot, name, float((got - want).abs().max()), bound)
