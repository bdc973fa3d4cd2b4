"""The multi-slot LoRA on CUDA: the grouped path against per-segment, and isolation.

On a CUDA GPU (bf16, the trainer's GPU default, `routing.stacked`: grouped matmuls over the
segments), with a tiny-qwen3 engine:

1. agreement: one packed batch of three slots of different ranks (one without MLP adapters),
   grouped vs per-segment: the largest difference in logprobs and in each slot's gradients,
   relative to the largest value (bf16 rounding order differs, so not bit-identical);
2. isolation: the same batch with one tenant whose loss overflows (cross_entropy weights 3e38):
   every other slot's gradients are finite and bit-identical to those with a well-behaved
   tenant; the optimizer skips the bad tenant's step and applies the others';
3. timing: forward_backward of 8 slots packed vs the same tokens as 1 slot, grouped and per
   segment (median of 20 after 5 warm-ups; tiny model, so launches dominate).

    python -m bench.gpu_lora_isolation [--device cpu]     # the CPU run is a smoke test

Prints one JSON object per section and `PASS`/`FAIL`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from libs.models.tiny import build_tiny  # noqa: E402
from services.trainer.engine import (  # noqa: E402
    AdamParams,
    DatumInput,
    EngineConfig,
    LoraConfig,
    TrainerEngine,
)

SLOTS = {0: LoraConfig(rank=8, seed=1), 1: LoraConfig(rank=4, seed=2), 3: LoraConfig(rank=2, seed=3, train_mlp=False)}
BAD = 1


def setup(engine: TrainerEngine) -> None:
    for slot in range(engine.config.num_slots):
        engine.release_slot(slot)
    for slot, c in SLOTS.items():
        engine.init_slot(slot, c)
        state = engine.get_slot_state(slot)
        gen = torch.Generator().manual_seed(slot)
        state.adapter = {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in state.adapter.items()}
        engine.set_slot_state(slot, state, with_optimizer=False)


def batch(overflow: bool) -> list[DatumInput]:
    rng = np.random.default_rng(11)
    out = []
    for slot, n in ((BAD, 37), (0, 64), (3, 21), (BAD, 16), (0, 9)):
        seq = rng.integers(0, 2048, n + 1)
        weights = np.full(n, 3e38 if (overflow and slot == BAD) else 1.0, np.float32)
        out.append(DatumInput(slot, seq[:-1], {"target_tokens": seq[1:], "weights": weights}))
    return out


def run(
    engine: TrainerEngine, stacked: bool, overflow: bool
) -> tuple[list[np.ndarray], dict[int, dict[str, torch.Tensor]], dict]:
    engine.pool.routing.stacked = stacked
    setup(engine)
    outputs = engine.forward_backward(batch(overflow), "cross_entropy")
    grads = {slot: engine.get_slot_grads(slot) for slot in SLOTS}
    reports = engine.optim_step({slot: AdamParams(learning_rate=1e-2) for slot in SLOTS})
    return [o.logprobs for o in outputs], grads, {s: r.applied for s, r in reports.items()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / max(1e-12, float(b.double().abs().max())))


def timing(engine: TrainerEngine, device: str) -> dict[str, float]:
    rng = np.random.default_rng(3)
    for slot in range(8):
        engine.init_slot(slot, LoraConfig(rank=8, seed=slot))
    tokens = [rng.integers(0, 2048, 129) for _ in range(8)]
    packed = [DatumInput(slot, t[:-1], {"target_tokens": t[1:]}) for slot, t in enumerate(tokens)]
    alone = [DatumInput(0, t[:-1], {"target_tokens": t[1:]}) for t in tokens]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out: dict[str, float] = {}
    for name, datums, stacked in (
        ("1 slot", alone, True),
        ("8 slots grouped", packed, True),
        ("8 slots per-segment", packed, False),
    ):
        engine.pool.routing.stacked = stacked
        times = []
        for i in range(25):
            sync()
            start = time.perf_counter()
            engine.forward_backward(datums, "cross_entropy")
            sync()
            if i >= 5:
                times.append(time.perf_counter() - start)
        for slot in range(8):
            engine.discard_grads(slot)
        out[f"{name} ms"] = statistics.median(times) * 1e3
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny(Path(tmp) / "tiny", preset="tiny-qwen3")
        engine = TrainerEngine(EngineConfig(str(model), num_slots=8, max_lora_rank=8, device=args.device))
        ok = True

        lp_g, grads_g, _ = run(engine, True, False)
        lp_s, grads_s, _ = run(engine, False, False)
        agreement = {
            "logprobs_rel": max(
                rel(torch.from_numpy(a), torch.from_numpy(b)) for a, b in zip(lp_g, lp_s, strict=True)
            ),
            "grads_rel": max(rel(grads_g[s][k], grads_s[s][k]) for s in SLOTS for k in grads_s[s]),
        }
        tolerance = 3e-2 if args.device == "cuda" else 1e-5
        agreement["passed"] = agreement["logprobs_rel"] < tolerance and agreement["grads_rel"] < tolerance
        ok &= bool(agreement["passed"])
        print(json.dumps({"section": "agreement (grouped vs per-segment)", **agreement}), flush=True)

        for stacked in (True, False):
            _, clean, clean_applied = run(engine, stacked, False)
            _, dirty, dirty_applied = run(engine, stacked, True)
            others = [s for s in SLOTS if s != BAD]
            finite = all(bool(torch.isfinite(g).all()) for s in others for g in dirty[s].values())
            identical = all(torch.equal(dirty[s][k], clean[s][k]) for s in others for k in clean[s])
            bad_overflowed = not all(bool(torch.isfinite(g).all()) for g in dirty[BAD].values())
            steps = dirty_applied == {**clean_applied, BAD: False}
            passed = finite and identical and bad_overflowed and steps
            ok &= passed
            print(
                json.dumps(
                    {
                        "section": f"isolation ({'grouped' if stacked else 'per-segment'})",
                        "bad_tenant_overflowed": bad_overflowed,
                        "neighbours_finite": finite,
                        "neighbours_bit_identical": identical,
                        "steps_applied": {str(k): v for k, v in dirty_applied.items()},
                        "passed": passed,
                    }
                ),
                flush=True,
            )

        print(
            json.dumps({"section": "timing", "device": args.device, **timing(engine, args.device)}),
            flush=True,
        )
    print("PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
