"""The TP scenario run both in-process (TP=1) and by spawned gloo ranks (TP=2).

Kept in its own importable module because ``torch.multiprocessing`` spawn pickles the target
function by qualified name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.trainer.engine import AdamParams, DatumInput, EngineConfig, LoraConfig, TrainerEngine

# eps=1 keeps each update a smooth function of its gradient.  With a tiny eps Adam's first step
# is lr*sign(g), which turns fp32 reduction-order noise in near-zero gradient entries (TP=2 sums
# in another order than TP=1) into +-lr differences that say nothing about correctness.
HP = AdamParams(learning_rate=1e-2, eps=1.0, weight_decay=0.01, grad_clip_norm=20.0)


def scenario(engine: TrainerEngine) -> dict[str, Any]:
    """Two slots, three steps (cross_entropy, ppo, then top-K cross_entropy with K = 3: the
    vocab-parallel log-sum-exp path), packed mixed batches; returns everything."""
    engine.init_slot(0, LoraConfig(rank=4, seed=1))
    engine.init_slot(2, LoraConfig(rank=2, seed=2, train_mlp=False))
    rng = np.random.default_rng(0)
    datums = []
    for slot, n in ((2, 6), (0, 9), (0, 4), (2, 7)):
        seq = rng.integers(0, 2048, n + 1)
        datums.append(
            DatumInput(
                slot, seq[:-1], {"target_tokens": seq[1:], "weights": rng.normal(size=n).astype(np.float32)}
            )
        )
    first = engine.forward_backward(datums, "cross_entropy")
    reports = [engine.optim_step({0: HP, 2: HP})]
    policy = [
        DatumInput(
            d.slot,
            d.tokens,
            {
                "target_tokens": d.loss_inputs["target_tokens"],
                "logprobs": (o.logprobs + rng.normal(scale=0.2, size=d.num_tokens)).astype(np.float32),
                "advantages": rng.normal(size=d.num_tokens).astype(np.float32),
            },
        )
        for d, o in zip(datums, first, strict=True)
    ]
    second = engine.forward_backward(policy, "ppo")
    reports.append(engine.optim_step({0: HP, 2: HP}))
    top_k = [
        DatumInput(
            d.slot,
            d.tokens,
            {
                "target_tokens": rng.integers(0, 2048, (d.num_tokens, 3)),
                "weights": rng.normal(size=(d.num_tokens, 3)).astype(np.float32),
            },
        )
        for d in datums
    ]
    third = engine.forward_backward(top_k, "cross_entropy")
    reports.append(engine.optim_step({0: HP, 2: HP}))
    states = {slot: engine.get_slot_state(slot) for slot in (0, 2)}
    peft = engine.export_peft(0)[0]
    return {
        "logprobs": [o.logprobs for o in first + second + third],
        "losses": [o.loss for o in first + second + third],
        "grad_norms": [r[s].grad_norm for r in reports for s in (0, 2)],
        "adapters": {s: st.adapter for s, st in states.items()},
        "exp_avg_sq": {s: st.exp_avg_sq for s, st in states.items()},
        "peft": peft,
    }


def run_rank(rank: int, world: int, store: str, model_dir: str, out_dir: str, fused: bool = False) -> None:
    """Entry point of one spawned TP rank; rank 0 saves the scenario's results. ``fused``: the
    one-column losses through fused_ce.py, in pieces of 5 tokens (cut inside segments)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        config = EngineConfig(model_dir, num_slots=4, max_lora_rank=8, fused_cross_entropy=fused)
        engine = TrainerEngine(config)
        engine.fused_ce_chunk = 5 if fused else None
        assert engine.tp_size == world
        results = scenario(engine)
        results["local_qkv_rows"] = int(
            engine.pool.adapter("decoder.layers.0.self_attention.linear_qkv").lora_B.shape[1]
        )
        if rank == 0:
            torch.save(results, Path(out_dir) / "tp.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
