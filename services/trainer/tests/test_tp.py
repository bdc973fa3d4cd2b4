"""TP=2 over gloo (two spawned CPU processes) computes what TP=1 computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from services.trainer.engine import EngineConfig, TrainerEngine
from services.trainer.parallel import free_port
from services.trainer.tests.helpers import assert_close_scaled
from services.trainer.tests.tp_worker import run_rank, scenario


def test_tp2_matches_tp1(qwen_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Logprobs, losses, grad norms, updated adapters and Adam moments agree to 1e-5."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.start_processes(
        run_rank,
        args=(2, free_port(), str(qwen_dir), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    tp2 = torch.load(tmp_path / "tp.pt", weights_only=False)
    tp1_engine = TrainerEngine(EngineConfig(str(qwen_dir), num_slots=4, max_lora_rank=8))
    tp1 = scenario(tp1_engine)

    qkv_rows = (tp1_engine.shape.num_heads + 2 * tp1_engine.shape.num_groups) * tp1_engine.shape.head_dim
    assert tp2["local_qkv_rows"] == qkv_rows // 2  # really sharded over the two ranks
    for a, b in zip(tp2["logprobs"], tp1["logprobs"], strict=True):
        assert_close_scaled(torch.from_numpy(a), torch.from_numpy(b), 1e-5, "logprobs")
    assert_close_scaled(torch.tensor(tp2["losses"]), torch.tensor(tp1["losses"]), 1e-5, "losses")
    assert_close_scaled(torch.tensor(tp2["grad_norms"]), torch.tensor(tp1["grad_norms"]), 1e-5, "grad norms")
    for table in ("adapters", "exp_avg_sq"):
        for slot, tensors in tp1[table].items():
            assert set(tp2[table][slot]) == set(tensors)
            for name, want in tensors.items():
                assert_close_scaled(tp2[table][slot][name], want, 1e-5, f"{table}[{slot}].{name}")
    for name, want in tp1["peft"].items():
        assert_close_scaled(tp2["peft"][name], want, 1e-5, name)
