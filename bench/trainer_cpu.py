"""Trainer on CPU: ``TrainerEngine.forward_backward`` tokens/s, and what packing costs.

Two base models: ``tiny-qwen3`` (2.4M parameters) and a randomly initialised ~100M Qwen3
(hidden 768, 12 layers, 12 heads, 4 kv heads, head_dim 64, ffn 2048, vocab 32000) written to a
temporary directory. Each engine has 8 LoRA slots (max rank 64, the trainer's default; each slot
rank 32, the SDK default, on attention + MLP + unembedding); every call is a cross-entropy
``forward_backward`` over 8 documents of ``L`` tokens (T = 8 L):

    1 tenant           one slot, 8 datums, one call             (the baseline)
    8 tenants, packed  8 slots x 1 datum, one call              (what the planner builds)
    8 tenants, apart   8 calls of 1 datum, one slot each        (the same work without packing)

The three run interleaved, repetition by repetition, so machine noise hits them alike; the
ratios are of medians and of minimums (the least disturbed repetition) from this one run. GFLOP/s counts the FLOP model of ``bench/common.py``
(frozen base: 4 N T, causal attention, LoRA).

    .venv/bin/python bench/trainer_cpu.py [--quick]        (--quick: tiny model only)
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    QWEN3_100M,
    cpu_parser,
    dist,
    footer,
    header,
    random_qwen3,
    random_tokens,
    shape_of,
    table,
    train_flops,
)

SLOTS = 8
RANK = 32  # the rank a client gets when it names none
MAX_RANK = 64  # the trainer's default max_lora_rank: the slot tensors are this wide


def datum(slot: int, seed: int, length: int, vocab: int) -> Any:
    import numpy as np

    from services.trainer.engine import DatumInput

    tokens = np.asarray(random_tokens(seed, length + 1, vocab), dtype=np.int64)
    return DatumInput(
        slot=slot,
        tokens=tokens[:-1],
        loss_inputs={"target_tokens": tokens[1:], "weights": np.ones(length, dtype=np.float32)},
    )


def measure(name: str, model_dir: Path, length: int, reps: int) -> list[dict[str, Any]]:
    from services.trainer.engine import EngineConfig, LoraConfig, TrainerEngine

    engine = TrainerEngine(
        EngineConfig(base_model_dir=str(model_dir), num_slots=SLOTS, max_lora_rank=MAX_RANK)
    )
    for slot in range(SLOTS):
        engine.init_slot(slot, LoraConfig(rank=RANK, seed=slot))
    shape = shape_of(model_dir)
    vocab = shape.vocab
    one = [datum(0, i, length, vocab) for i in range(SLOTS)]
    packed = [datum(slot, slot, length, vocab) for slot in range(SLOTS)]

    def apart() -> None:
        for d in packed:
            engine.forward_backward([d], "cross_entropy")

    configs: dict[str, Callable[[], Any]] = {
        "1 tenant, 8 datums, 1 call": lambda: engine.forward_backward(one, "cross_entropy"),
        "8 tenants packed, 1 call": lambda: engine.forward_backward(packed, "cross_entropy"),
        "8 tenants apart, 8 calls": apart,
    }
    for run in configs.values():  # warm-up
        run()
    times: dict[str, list[float]] = {label: [] for label in configs}
    for _ in range(reps):
        for label, run in configs.items():
            start = time.perf_counter()
            run()
            times[label].append(time.perf_counter() - start)
    tokens = SLOTS * length
    flops = train_flops(shape, [length] * SLOTS, RANK)["total"]
    base = dist(times["1 tenant, 8 datums, 1 call"])
    rows = []
    for label, values in times.items():
        d = dist(values)
        rows.append(
            {
                "model": name,
                "config": label,
                "tokens": tokens,
                "reps": d["n"],
                "p50_ms": d["p50"] * 1e3,
                "p99_ms": d["p99"] * 1e3,
                "tok_s": tokens / d["p50"],
                "gflops": flops / d["p50"] / 1e9,
                "ratio": base["p50"] / d["p50"],
                "ratio_min": base["min"] / d["min"],
            }
        )
    return rows


def main() -> None:
    args = cpu_parser(__doc__ or "").parse_args()
    from libs.models.registry import ensure_tiny

    runs: list[tuple[str, int, int]] = [("tiny-qwen3", 128, 10 if args.quick else 30)]
    if not args.quick:
        runs.append(("qwen3-100m (random)", 128, 7))
    header(
        "TrainerEngine forward_backward on CPU",
        args.quick,
        slots=SLOTS,
        lora_rank=RANK,
        max_lora_rank=MAX_RANK,
        **{f"{name} doc_len x docs / reps": f"{length} x {SLOTS} / {reps}" for name, length, reps in runs},
    )
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tinkerd-bench-") as tmp:
        for name, length, reps in runs:
            if name == "tiny-qwen3":
                model_dir = ensure_tiny(Path(tmp))
            else:
                model_dir = random_qwen3(Path(tmp) / "qwen3-100m", QWEN3_100M)
            rows += measure(name, model_dir, length, reps)
    table(
        "forward_backward throughput (ratio = baseline time / this time; > 1 is faster)",
        rows,
        [
            ("model", "model"),
            ("configuration", "config"),
            ("tokens/call", "tokens"),
            ("reps", "reps"),
            ("p50 ms", "p50_ms"),
            ("p99 ms", "p99_ms"),
            ("tokens/s", "tok_s"),
            ("GFLOP/s", "gflops"),
            ("vs 1 tenant (p50)", "ratio"),
            ("vs 1 tenant (min)", "ratio_min"),
        ],
    )

    footer()


if __name__ == "__main__":
    main()
