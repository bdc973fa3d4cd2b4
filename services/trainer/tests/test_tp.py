"""TP=2 over gloo (two spawned CPU processes) computes what TP=1 computes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoConfig

from services.trainer.engine import EngineConfig, TrainerEngine
from services.trainer.tests.tp_worker import HP, run_rank, scenario
from tests.numerics import ChainShape, assert_within, gamma

pytestmark = pytest.mark.numerics  # also run under other thread counts and CPU paths (tests/infra)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused-ce", "fused-ce"])
def test_tp2_matches_tp1(qwen_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fused: bool) -> None:
    """Logprobs, losses, grad norms, updated adapters and Adam moments agree within fp32 rounding;
    ``fused-ce``: the TP=2 ranks run the one-column losses through the chunked fused linear
    cross-entropy (vocab-sharded log-sum-exp and target logit), the TP=1 side stays unfused."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.start_processes(
        run_rank,
        args=(2, str(tmp_path / "store"), str(qwen_dir), str(tmp_path), fused),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    tp2 = torch.load(tmp_path / "tp.pt", weights_only=False)
    tp1_engine = TrainerEngine(EngineConfig(str(qwen_dir), num_slots=4, max_lora_rank=8))
    tp1 = scenario(tp1_engine)

    qkv_rows = (tp1_engine.shape.num_heads + 2 * tp1_engine.shape.num_groups) * tp1_engine.shape.head_dim
    assert tp2["local_qkv_rows"] == qkv_rows // 2  # really sharded over the two ranks

    # Both sides are fp32 computations of the same math (TP=2 splits reductions and adds an
    # all-reduce), so each value agrees within twice one fp32 bound (tests.numerics). The scenario's
    # terms stay inside the worker, so the bounds are norm-wise: relative to each tensor's largest
    # entry rather than to the magnitude of each entry's terms.
    chain = ChainShape.of_hf_config(AutoConfig.from_pretrained(str(qwen_dir)))
    g = gamma(chain.backward_depth(9) + 3 * 26 + 2)  # longest datum 9 tokens, 26 x K=3 scored, all-reduce
    for a, b in zip(tp2["logprobs"], tp1["logprobs"], strict=True):
        assert_within(a, b, 2 * g * np.abs(b).max(), "logprobs")
    losses = np.asarray(tp1["losses"])
    assert_within(tp2["losses"], losses, 2 * g * np.abs(losses).max() * 27, "losses")  # sums of <= 9 * 3 terms
    norms = np.asarray(tp1["grad_norms"])
    assert_within(tp2["grad_norms"], norms, 2 * g * norms, "grad norms")  # a sum of squares: no cancellation
    # Adam with eps = 1: an update moves by at most lr * (gradient error) <= lr * g * |grad|, per step
    drift = 2 * HP.learning_rate * g * float(norms.max())
    for slot, tensors in tp1["adapters"].items():
        assert set(tp2["adapters"][slot]) == set(tensors)
        for name, want in tensors.items():
            bound = 2 * g * float(want.abs().max()) + drift
            assert_within(tp2["adapters"][slot][name], want, bound, f"adapters[{slot}].{name}")
    for slot, tensors in tp1["exp_avg_sq"].items():
        assert set(tp2["exp_avg_sq"][slot]) == set(tensors)
        for name, want in tensors.items():  # (1 - b2) g^2: twice the gradient's relative error
            assert_within(tp2["exp_avg_sq"][slot][name], want, 2 * 2 * g * float(want.abs().max()), f"exp_avg_sq[{slot}].{name}")
    for name, want in tp1["peft"].items():
        assert_within(tp2["peft"][name], want, 2 * g * float(want.abs().max()) + drift, name)
