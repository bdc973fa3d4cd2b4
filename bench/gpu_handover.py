"""Where an ephemeral save's handover spends its time, at the Qwen3-8B shape (rank 32, every
target and the lm_head: 369 MB of fp32 PEFT tensors), on one CUDA device.

The trainer's side runs in this process: ``Handover`` (one device buffer, the tensors copied into
its views, pickled with torch's multiprocessing reductions), timed whole. The engine's
side runs in a second process, as the sampler is one: it unpickles the payload
(``services.sampler.handover.decode``: CUDA IPC opens), validates and copies the tensors
(``lora.adapter_from_tensors``) and loads them into a slot of an 8-slot bf16 ``LoRAPool``; beside
them, what a finiteness check read back module by module would cost. Each
part is timed with the device synchronized at its end; ``--tries`` fresh handovers.

    python -m bench.gpu_handover --out DIR           # on a CUDA machine
    python -m bench.gpu_handover --out DIR --tiny    # CPU smoke run (a 2-layer shape, a /dev/shm segment)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.common import QWEN3_8B, TINY, Shape, lora_modules

RANK = 32
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peft_tensors(shape: Shape, device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for module, (fan_in, fan_out) in lora_modules(shape).items():
        key = f"base_model.model.{module}"
        out[f"{key}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=gen, device=device) * 0.01
        out[f"{key}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=gen, device=device) * 0.01
    return out


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and its milliseconds, the device idle at both ends."""
    sync()
    started = time.perf_counter()
    value = fn(*args)
    sync()
    return value, (time.perf_counter() - started) * 1e3


def check_each_module(adapter: Any) -> bool:
    return all(
        bool(torch.isfinite(w.a).all()) and bool(torch.isfinite(w.b).all()) for w in adapter.modules.values()
    )


def engine_side(shape: Shape, device: str, tries: int) -> None:
    """Read one handover per stdin line, print one JSON line of timings per handover."""
    from services.sampler import handover
    from services.sampler.lora import LoRAPool, adapter_from_tensors

    dims = lora_modules(shape)
    bases: dict[str, nn.Linear] = {}
    for module, (fan_in, fan_out) in dims.items():
        linear = nn.Linear(fan_in, fan_out, bias=False, device="meta")
        linear.weight = nn.Parameter(torch.empty(1, device=device), requires_grad=False)  # its device
        bases[module] = linear
    groups: dict[str, tuple[str, ...]] = {name: (name,) for name in dims}
    pool = LoRAPool(groups, bases, slots=8, rank=RANK, device=torch.device(device), dtype=torch.bfloat16)
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 32, "target_modules": list(TARGETS)}
    print(json.dumps({"ready": True}), flush=True)
    for i in range(tries):
        payload = sys.stdin.readline().strip()
        tensors, decode_ms = timed(handover.decode, payload)
        adapter, validate_ms = timed(
            adapter_from_tensors, f"a{i}", "__tensor__", config, tensors, bases, RANK
        )
        _, pool_ms = timed(pool.acquire, adapter, set())
        # what a finiteness check read back per module (one host sync each) would add
        _, per_module_check_ms = timed(check_each_module, adapter)
        del tensors
        times = {"decode_ms": decode_ms, "validate_ms": validate_ms, "pool_ms": pool_ms}
        print(json.dumps({**times, "per_module_check_ms": per_module_check_ms}), flush=True)


def trainer_side(out: Path, tiny: bool, tries: int) -> None:
    from services.trainer.handover import Handover

    shape, device = (TINY, "cpu") if tiny else (QWEN3_8B, "cuda")
    tensors = peft_tensors(shape, device)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    engine = subprocess.Popen(
        [sys.executable, "-m", "bench.gpu_handover", "--engine-side", "--tries", str(tries)]
        + (["--tiny"] if tiny else []),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert engine.stdin is not None and engine.stdout is not None
    assert json.loads(engine.stdout.readline())["ready"]
    rows: list[dict[str, float]] = []
    kept: list[Handover] = []  # the sender keeps its memory while the engine reads it
    for i in range(tries):
        handover, handover_ms = timed(Handover, f"request-{i}", tensors, {})
        kept.append(handover)
        payload = handover.ref.tensors
        engine.stdin.write(payload + "\n")
        engine.stdin.flush()
        row = {"handover_ms": handover_ms, "payload_kb": len(payload) / 1e3}
        row.update(json.loads(engine.stdout.readline()))
        rows.append(row)
        print(json.dumps(row), flush=True)
    engine.stdin.close()
    engine.wait(timeout=60)
    for handover in kept:
        handover.release()
    summary = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "adapter_mb": nbytes / 1e6,
        "tensors": len(tensors),
        "tries": rows,
        "median": summary,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "handover.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({"median": summary, "adapter_mb": nbytes / 1e6, "tensors": len(tensors)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--tries", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer shape on the CPU (smoke run)")
    parser.add_argument("--engine-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_side:
        engine_side(TINY if args.tiny else QWEN3_8B, "cpu" if args.tiny else "cuda", args.tries)
    else:
        trainer_side(args.out, args.tiny, args.tries)


if __name__ == "__main__":
    main()
