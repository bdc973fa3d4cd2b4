"""The LoRA products of one training step, one slot against several: where the grouped path's
extra GEMM time goes.

For each adapted linear of Qwen3-8B (rank 32; fused QKV and gate/up as the trainer holds them:
``w = parts * r`` columns) at ``--tokens`` packed tokens, the six products of a step, timed as
one slot's plain ``mm`` over every token, as ``torch._grouped_mm`` over ``--groups`` equal
segments (the trainer's grouped path), and as one ``mm`` per segment:

    h      = x [T, in] @ A_gᵀ          (forward)
    lora   = h [T, w] @ B_gᵀ           (forward; the base GEMM adds it in its epilogue)
    dh     = g [T, out] @ B_g          (backward)
    dx     = dh [T, w] @ A_g           (backward; g W is added in the epilogue)
    dA     = dhᵀ @ x  -> [G, w, in]    (backward, ragged along K)
    dB     = gᵀ @ h   -> [G, out, w]   (backward, ragged along K)

Each time is the median of CUDA-event timings of ``--reps`` calls after warm-up; the floor is the
product's operands and output read and written once at ``--bandwidth`` bytes/s.

    python3 -m bench.gpu_grouped_products --out $OUT/products
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import cuda_median_ms

LAYERS = 36
MODULES = {  # name: (in, out, parts, count per step)
    "qkv": (4096, 6144, 3, LAYERS),
    "proj": (4096, 4096, 1, LAYERS),
    "fc1": (4096, 24576, 2, LAYERS),
    "fc2": (12288, 4096, 1, LAYERS),
    "output": (4096, 151936, 1, 1),
}


Product = tuple[Callable[[], object], Callable[[], object], Callable[[], object], int]


def products(
    x: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor,
    dh: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    bounds: list[tuple[int, int]],
) -> dict[str, Product]:
    """Each product as (one slot's mm, the grouped matmul, one mm per segment, the grouped
    product's bytes read and written once)."""
    t, d_in = x.shape
    d_out, w = b.shape[1], b.shape[2]
    n_groups = a.shape[0]
    a1, b1 = a[0], b[0]
    two = 2  # bytes per bf16 value
    return {
        "h": (
            lambda: x @ a1.t(),
            lambda: torch._grouped_mm(x, a.transpose(1, 2), offs=offs),
            lambda: [x[s:e] @ a[k].t() for k, (s, e) in enumerate(bounds)],
            two * (t * d_in + n_groups * w * d_in + t * w),
        ),
        "lora": (
            lambda: h @ b1.t(),
            lambda: torch._grouped_mm(h, b.transpose(1, 2), offs=offs),
            lambda: [h[s:e] @ b[k].t() for k, (s, e) in enumerate(bounds)],
            two * (t * w + n_groups * d_out * w + t * d_out),
        ),
        "dh": (
            lambda: g @ b1,
            lambda: torch._grouped_mm(g, b, offs=offs),
            lambda: [g[s:e] @ b[k] for k, (s, e) in enumerate(bounds)],
            two * (t * d_out + n_groups * d_out * w + t * w),
        ),
        "dx": (
            lambda: dh @ a1,
            lambda: torch._grouped_mm(dh, a, offs=offs),
            lambda: [dh[s:e] @ a[k] for k, (s, e) in enumerate(bounds)],
            two * (t * w + n_groups * w * d_in + t * d_in),
        ),
        "dA": (
            lambda: dh.t() @ x,
            lambda: torch._grouped_mm(dh.t(), x, offs=offs),
            lambda: [dh[s:e].t() @ x[s:e] for s, e in bounds],
            two * (t * w + t * d_in + n_groups * w * d_in),
        ),
        "dB": (
            lambda: g.t() @ h,
            lambda: torch._grouped_mm(g.t(), h, offs=offs),
            lambda: [g[s:e].t() @ h[s:e] for s, e in bounds],
            two * (t * d_out + t * w + n_groups * d_out * w),
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s of the card's HBM")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev, bf = torch.device("cuda"), torch.bfloat16
    t, n_groups = args.tokens, args.groups
    seg = t // n_groups
    offs = torch.arange(1, n_groups + 1, device=dev, dtype=torch.int32) * seg
    offs[-1] = t
    bounds = [(k * seg, t if k == n_groups - 1 else (k + 1) * seg) for k in range(n_groups)]
    rows = []
    for name, (d_in, d_out, parts, count) in MODULES.items():
        w = parts * args.rank
        x = torch.randn(t, d_in, device=dev, dtype=bf)
        g = torch.randn(t, d_out, device=dev, dtype=bf)
        h = torch.randn(t, w, device=dev, dtype=bf)
        dh = torch.randn(t, w, device=dev, dtype=bf)
        a = torch.randn(n_groups, w, d_in, device=dev, dtype=bf)
        b = torch.randn(n_groups, d_out, w, device=dev, dtype=bf)
        for product, (one, grouped, loop, grouped_bytes) in products(x, g, h, dh, a, b, offs, bounds).items():
            row = {
                "module": name,
                "product": product,
                "count": count,
                "mm_ms": cuda_median_ms(one, args.reps, warmup=3),
                "grouped_ms": cuda_median_ms(grouped, args.reps, warmup=3),
                "per_segment_ms": cuda_median_ms(loop, args.reps, warmup=3),
                "floor_ms": grouped_bytes / args.bandwidth * 1e3,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        del x, g, h, dh, a, b
        torch.cuda.empty_cache()
    (args.out / "products.json").write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1)
    )
    lines = [
        f"{torch.cuda.get_device_name()}, T={t}, {n_groups} groups, rank {args.rank}; ms per call, and per step (x count)",
        "",
        "| module | product | mm | grouped | per segment | floor | step: mm | step: grouped | step: per segment |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    totals = [0.0, 0.0, 0.0]
    for r in rows:
        step = [r[k] * r["count"] for k in ("mm_ms", "grouped_ms", "per_segment_ms")]
        totals = [a + b for a, b in zip(totals, step, strict=True)]
        lines.append(
            f"| {r['module']} | {r['product']} | {r['mm_ms']:.4f} | {r['grouped_ms']:.4f} | {r['per_segment_ms']:.4f} "
            f"| {r['floor_ms']:.4f} | {step[0]:.2f} | {step[1]:.2f} | {step[2]:.2f} |"
        )
    lines.append(f"| all | | | | | | **{totals[0]:.2f}** | **{totals[1]:.2f}** | **{totals[2]:.2f}** |")
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
