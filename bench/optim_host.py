"""Host cost of ``SlotAdamW.step_many`` on the CPU: a 64-slot pool with the Qwen3-8B tensor count
(36 layers and the unembedding: 290 adapter tensors per slot) but tiny tensors, so that the time
is the host's work per call, not arithmetic. ``fused=True`` takes the path CUDA takes. Two
optimizers step the same pool: the engine's, which steps each slot's whole row of the pool's
``PooledRows``, and one without ``rows`` (one tensor per parameter and run of slots).

    python -m bench.optim_host          # prints ms per call and aten ops for 1, 8 and 64 slots
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoConfig

    from bench.common import Shape, stepped_pool
    from libs.contracts.common import AdamParams
    from services.trainer.convert import ModelShape
    from services.trainer.optim import SlotAdamW
    from services.trainer.parallel import ensure_model_parallel

    torch.set_num_threads(1)
    ensure_model_parallel("cpu")
    tiny = Shape(hidden=16, layers=36, heads=2, groups=1, head_dim=8, ffn=16, vocab=32)
    model_dir = Path(tempfile.mkdtemp(prefix="optim-host-"))
    (model_dir / "config.json").write_text(json.dumps(tiny.hf_config()))
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(str(model_dir)))
    slots, rank = 64, 4
    pool = stepped_pool(shape, slots, rank)
    hp = AdamParams(learning_rate=1e-5)
    print(f"tensors per slot: {len(pool.slot_tensors(0))}")
    print("| optimizer | slots stepped | ms per call (median of 5) | aten ops |\n|---|---|---|---|")
    for label, optimizer in (
        ("pooled rows", SlotAdamW(fused=True, rows=pool.rows)),
        ("per tensor", SlotAdamW(fused=True)),
    ):

        def step(count: int, optimizer: SlotAdamW = optimizer) -> None:
            optimizer.step_many([(s, pool.slot_tensors(s), hp) for s in range(count)])

        step(slots)  # allocates the moments, measures the bounds
        for count in (1, 8, slots):
            step(count)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                step(count)
                times.append(time.perf_counter() - t0)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step(count)
            ops = sum(1 for e in prof.events() if e.name.startswith("aten::"))
            print(f"| {label} | {count} | {sorted(times)[2] * 1e3:.1f} | {ops} |")


if __name__ == "__main__":
    main()
