"""Host cost of ``SlotAdamW.step_many`` on the CPU: a 64-slot pool with the Qwen3-8B tensor count
(36 layers and the unembedding: 290 adapter tensors per slot) but tiny tensors, so that the time
is the host's work per call, not arithmetic. ``fused=True`` takes the path CUDA takes.

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
    optimizer = SlotAdamW(fused=True)
    hp = AdamParams(learning_rate=1e-5)

    def step(count: int) -> None:
        optimizer.step_many([(s, pool.slot_tensors(s), hp) for s in range(count)])

    step(slots)  # allocates the moments, measures the bounds
    print(f"tensors per slot: {len(pool.slot_tensors(0))}")
    print("| slots stepped | ms per call (median of 5) | aten ops |\n|---|---|---|")
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
        print(f"| {count} | {sorted(times)[2] * 1e3:.1f} | {ops} |")


if __name__ == "__main__":
    main()
