"""Host cost of one ``TrainerEngine.forward_backward`` on the CPU: a model with the Qwen3-8B
layer count (36 layers, every linear and the unembedding adapted, rank 8) but tiny widths, so
the time is the host's work per call, not arithmetic, and the aten ops dispatched per call are
what a small step on a GPU launches. The engine takes the CUDA LoRA path where the CPU has it
(grouped matmuls for several tenants); attention is the CPU's per-document SDPA and RoPE
megatron's own math (the CUDA kernel is not counted), the same on both sides of any comparison.

    python -m bench.trainer_host        # prints ms and aten ops per call, 1 and 8 tenants
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

VIEWS = frozenset(
    [
        "as_strided",
        "view",
        "slice",
        "select",
        "t",
        "transpose",
        "unsqueeze",
        "squeeze",
        "expand",
        "reshape",
        "_reshape_alias",
        "permute",
        "narrow",
        "alias",
        "detach",
        "resolve_conj",
        "resolve_neg",
        "unflatten",
        "flatten",
        "view_as",
        "split",
        "chunk",
        "unbind",
        "_unsafe_view",
        "lift_fresh",
        "numpy_T",
        "matrix_H",
        "contiguous",
        "to",
        "_to_copy_noop",
    ]
)
"""aten ops that only make views or return their input (most dispatch no kernel; ``to``,
``reshape`` and ``contiguous`` appear here and again as the ``_to_copy``/``clone`` they dispatch
when they do copy)."""


def main() -> None:
    from torch.profiler import ProfilerActivity, profile

    from bench.common import Shape
    from bench.gpu_trainer import Bench
    from libs.contracts.common import LoraConfig

    torch.set_num_threads(1)
    args = argparse.Namespace(
        out="/tmp/trainer-host", tiny=True, cpu=True, sections="", warmup=1, iters=1, deadline=1e9
    )
    bench = Bench(args)
    bench.shape = Shape(hidden=64, layers=36, heads=4, groups=2, head_dim=16, ffn=128, vocab=512)
    (bench.model_dir / "config.json").write_text(json.dumps(bench.shape.hf_config()))
    engine = bench.build_engine("sdpa_per_document", 8)
    engine.pool.routing.stacked = True  # the GPU's grouped LoRA path
    for slot in range(8):
        engine.init_slot(slot, LoraConfig(rank=8, seed=slot))
    print("| workload | forward_backward ms (median of 7) | aten ops | of them not views |")
    print("|---|---|---|---|")
    for tenants in (1, 8):
        datums = bench.datums(64, 8, tenants)
        engine.forward_backward(datums, "cross_entropy")
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            engine.forward_backward(datums, "cross_entropy")
            times.append(time.perf_counter() - t0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.forward_backward(datums, "cross_entropy")
        ops = [e.name for e in prof.events() if e.name.startswith("aten::")]
        compute = [n for n in ops if n.removeprefix("aten::") not in VIEWS]
        label = f"8x64, {tenants} tenant{'s' if tenants > 1 else ''}"
        print(f"| {label} | {statistics.median(times) * 1e3:.1f} | {len(ops)} | {len(compute)} |")


if __name__ == "__main__":
    main()
