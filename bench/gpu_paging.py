"""Page-out / page-in of one 8B-shaped rank-32 adapter with its Adam state, on the H200.

The engine is `bench/gpu_trainer.py`'s (Qwen3-8B shape, bf16, random weights, 8 slots, LoRA rank
32 on every linear and the unembedding). One slot trains one forward_backward + optim_step +
forward_backward (moments and pending gradients exist), then is paged out and back in through
the trainer's `PageStore`, to host memory and to disk (host budget 0), `--reps` times each; the
state after the round trips is checked equal to the state before (bit for bit).

    python3 -m bench.gpu_paging --out DIR [--tiny] [--reps N]      (--tiny: CPU, a few seconds)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/gpu-paging")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--deadline", type=float, default=500.0)
    args = parser.parse_args()

    import numpy as np
    import torch

    from bench.gpu_trainer import LORA_RANK, Bench
    from services.trainer.engine import AdamParams, LoraConfig
    from services.trainer.state import files
    from services.trainer.state.paging import PageStore
    from services.trainer.state.slots import capture

    bench = Bench(args)
    engine = bench.build_engine("auto", num_slots=8)
    engine.init_slot(0, LoraConfig(rank=LORA_RANK, seed=1))
    datums = bench.datums(bench.doc_len(1024), 1, 1)
    engine.forward_backward(datums, "cross_entropy")
    engine.optim_step({0: AdamParams(learning_rate=1e-5)})
    engine.forward_backward(datums, "cross_entropy")  # gradients pending, as mid-window
    bench.sync()
    before = capture(engine, 0)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gpu-paging-") as tmp:
        for where, budget in (("host", 1 << 42), ("disk", 0)):
            store = PageStore(Path(tmp) / where, budget)
            outs, ins = [], []
            for _ in range(args.reps):
                bench.sync()
                t0 = time.perf_counter()
                moved = store.page_out(engine, 0, "m")
                bench.sync()
                outs.append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                store.page_in(engine, 0, "m")
                bench.sync()
                ins.append((time.perf_counter() - t0) * 1e3)
            rows.append(
                {
                    "where": where,
                    "mib": moved.nbytes / 2**20,
                    "reps": args.reps,
                    "out_ms_p50": float(np.median(outs)),
                    "out_ms_min": min(outs),
                    "in_ms_p50": float(np.median(ins)),
                    "in_ms_min": min(ins),
                }
            )
            bench.log("paging", rows[-1])
    after = capture(engine, 0)
    want, got = files.encode(before, "m"), files.encode(after, "m")
    exact = want.header == got.header and all(torch.equal(want.tensors[k], got.tensors[k]) for k in want.tensors)
    result = {"device": str(bench.device), "shape": "tiny" if args.tiny else "qwen3-8b", "rank": LORA_RANK, "rows": rows, "exact": exact}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paging.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    assert exact, "the state after paging differs from the state before"


if __name__ == "__main__":
    main()
