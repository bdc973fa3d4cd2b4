"""Where an ephemeral save's handover spends its time, at the Qwen3-8B shape (rank 32, every
target and the lm_head: 369 MB of fp32 PEFT tensors), on one CUDA device.

The trainer's side runs in this process: ``Handover`` (one device buffer, the tensors copied into
its views, pickled with torch's multiprocessing reductions), timed as its two parts. The engine's
side runs in a second process, as the sampler is one: it unpickles the payload
(``services.sampler.handover.decode``: CUDA IPC opens), validates and copies the tensors
(``lora.adapter_from_tensors``) and loads them into a slot of an 8-slot bf16 ``LoRAPool``; beside
them, what a finiteness check read back module by module would cost. Each
part is timed with the device synchronized at its end; ``--tries`` fresh handovers.

    python -m bench.gpu_handover --out DIR           # on a CUDA machine
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.common import QWEN3_8B, Shape

RANK = 32
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_dims(shape: Shape) -> dict[str, tuple[int, int]]:
    """Every LoRA target of the HF model: module name -> (in, out)."""
    q, kv = shape.heads * shape.head_dim, shape.groups * shape.head_dim
    per_layer = {
        "self_attn.q_proj": (shape.hidden, q),
        "self_attn.k_proj": (shape.hidden, kv),
        "self_attn.v_proj": (shape.hidden, kv),
        "self_attn.o_proj": (q, shape.hidden),
        "mlp.gate_proj": (shape.hidden, shape.ffn),
        "mlp.up_proj": (shape.hidden, shape.ffn),
        "mlp.down_proj": (shape.ffn, shape.hidden),
    }
    dims = {f"model.layers.{i}.{m}": d for i in range(shape.layers) for m, d in per_layer.items()}
    dims["lm_head"] = (shape.hidden, shape.vocab)
    return dims


def peft_tensors(shape: Shape, device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for module, (fan_in, fan_out) in module_dims(shape).items():
        key = f"base_model.model.{module}"
        out[f"{key}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=gen, device=device) * 0.01
        out[f"{key}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=gen, device=device) * 0.01
    return out


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and its milliseconds, the device idle at both ends."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    value = fn(*args)
    torch.cuda.synchronize()
    return value, (time.perf_counter() - started) * 1e3


def check_each_module(adapter: Any) -> bool:
    return all(
        bool(torch.isfinite(w.a).all()) and bool(torch.isfinite(w.b).all()) for w in adapter.modules.values()
    )


def pickled(views: dict[str, torch.Tensor]) -> str:
    return base64.b64encode(bytes(ForkingPickler.dumps(views))).decode()


def engine_side(tries: int) -> None:
    """Read one handover per stdin line, print one JSON line of timings per handover."""
    from services.sampler import handover
    from services.sampler.lora import LoRAPool, adapter_from_tensors

    dims = module_dims(QWEN3_8B)
    bases: dict[str, nn.Linear] = {}
    for module, (fan_in, fan_out) in dims.items():
        linear = nn.Linear(fan_in, fan_out, bias=False, device="meta")
        linear.weight = nn.Parameter(torch.empty(1, device="cuda"), requires_grad=False)  # its device
        bases[module] = linear
    groups: dict[str, tuple[str, ...]] = {name: (name,) for name in dims}
    pool = LoRAPool(groups, bases, slots=8, rank=RANK, device=torch.device("cuda"), dtype=torch.bfloat16)
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


def trainer_side(out: Path, tries: int) -> None:
    from services.trainer import handover as trainer_handover

    tensors = peft_tensors(QWEN3_8B, "cuda")
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    engine = subprocess.Popen(
        [sys.executable, "-m", "bench.gpu_handover", "--engine-side", "--tries", str(tries)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert engine.stdin is not None and engine.stdout is not None
    assert json.loads(engine.stdout.readline())["ready"]
    rows: list[dict[str, float]] = []
    kept = []
    for _ in range(tries):
        views, pack_ms = timed(trainer_handover.pack, tensors)
        payload, pickle_ms = timed(pickled, views)
        kept.append(views)  # the sender keeps its memory while the engine reads it
        engine.stdin.write(payload + "\n")
        engine.stdin.flush()
        row = {"pack_ms": pack_ms, "pickle_ms": pickle_ms, "payload_kb": len(payload) / 1e3}
        row.update(json.loads(engine.stdout.readline()))
        rows.append(row)
        print(json.dumps(row), flush=True)
    engine.stdin.close()
    engine.wait(timeout=60)
    summary = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    result = {
        "device": torch.cuda.get_device_name(),
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
    parser.add_argument("--engine-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_side:
        engine_side(args.tries)
    else:
        trainer_side(args.out, args.tries)


if __name__ == "__main__":
    main()
