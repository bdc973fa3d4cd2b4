"""The CUDA sampler engine alone at the Qwen3-8B shape: decode steps, their profile, prefill,
and Hugging Face ``generate`` with a compiled static cache beside it, in one process.

Sections (each isolated: an error is recorded and the next runs):

    env      the GPU, and the HBM copy bandwidth (device-to-device copy, bytes read + written)
             from which the decode floor follows: bf16 weight bytes / bandwidth
    decode   StaticCacheEngine (random bf16 weights, 8 rank-32 adapters on every target, lm_head
             too): each decode step's period in the engine loop (median interval between steps,
             host work included) and the graph replay alone, at batch 1 / 8 / 64 with 1 adapter
             and with 8 distinct adapters; prompts of 128 tokens, 128 new tokens
    profile  (also alone: ``--sections profile`` skips the decode timings) one decode step's kernels (torch.profiler over graph replays), grouped by what they
             do, against the replay's wall time; and the same step with the adapters off
    prefill  64 x 128 and 1 x 2,048 prompt tokens (one new token): tok/s and MFU
    hf       transformers ``generate`` with ``cache_implementation="static"`` (generate compiles
             the forward itself), no adapter, greedy: the median step period at batch 1 / 8 / 64

The weights are drawn on the GPU (no files): the model directory holds only ``config.json`` and
the tokenizer.  Outputs under ``--out``: results.json, summary.md.

    python -m bench.gpu_sampler --out DIR              # on the H200
    python -m bench.gpu_sampler --out DIR --tiny       # CPU smoke test (a 2-layer model)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import msgspec
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    H200_PEAK_BF16,
    QWEN3_8B,
    BenchRun,
    Shape,
    cuda_median_ms,
    lora_modules,
    markdown_table,
    shaped_model_dir,
)

RANK = 32
BATCHES = [1, 8, 64]
PROMPT, NEW = 128, 128
HF_NEW = 48
TINY = Shape(hidden=64, layers=2, heads=4, groups=2, head_dim=16, ffn=128, vocab=2048)


def model_dir(root: Path, shape: Shape, dtype: str) -> Path:
    """A model directory without weights: config.json and the project's tokenizer."""
    out = root / "model"
    if (out / "config.json").is_file():
        return out
    return shaped_model_dir(out, shape, dtype, "qwen3-8b-random", root / "tokenizer")


def random_model(path: Path, device: torch.device, dtype: torch.dtype) -> Any:
    """The architecture of ``path`` with N(0, 0.02) weights (norms 1), drawn on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * 0.02)
    return model.eval()


def adapter_dirs(root: Path, shape: Shape, count: int, device: torch.device) -> list[Path]:
    """``count`` random rank-32 PEFT adapters on every target module, lm_head included."""
    from safetensors.torch import save_file

    out = []
    for i in range(count):
        path = root / f"a{i}"
        out.append(path)
        if (path / "adapter_model.safetensors").is_file():
            continue
        path.mkdir(parents=True)
        gen = torch.Generator(device=device).manual_seed(100 + i)
        tensors: dict[str, torch.Tensor] = {}
        for module, (fan_in, fan_out) in lora_modules(shape).items():
            a = torch.randn(RANK, fan_in, generator=gen, device=device) / fan_in**0.5
            b = torch.randn(fan_out, RANK, generator=gen, device=device) * 0.01
            tensors[f"base_model.model.{module}.lora_A.weight"] = a.to(torch.bfloat16).cpu()
            tensors[f"base_model.model.{module}.lora_B.weight"] = b.to(torch.bfloat16).cpu()
        save_file(tensors, str(path / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": RANK, "lora_alpha": RANK, "target_modules": ["all-linear"]}
        (path / "adapter_config.json").write_text(json.dumps(config))
    return out


def prefill_flops(shape: Shape, lengths: list[int]) -> float:
    """Forward FLOPs of prompts of ``lengths``: 2 N T (matmuls, lm_head at every position counted
    once per prompt only: the engine unembeds the last position), causal attention, LoRA."""
    s = shape
    per_layer = s.hidden * ((s.heads + 2 * s.groups) * s.head_dim) + s.heads * s.head_dim * s.hidden
    per_layer += 3 * s.hidden * s.ffn
    tokens = sum(lengths)
    linear = 2 * per_layer * s.layers * tokens + 2 * s.hidden * s.vocab * len(lengths)
    attention = 2 * s.layers * s.heads * s.head_dim * sum(n * (n + 1) for n in lengths)
    lora_dims = (s.hidden + (s.heads + 2 * s.groups) * s.head_dim) + 2 * s.hidden + (s.hidden + 2 * s.ffn)
    lora_dims += s.ffn + s.hidden
    lora = 2 * RANK * lora_dims * s.layers * tokens
    return float(linear + attention + lora)


class Bench(BenchRun):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tiny = args.tiny
        super().__init__(Path(args.out), args.deadline, torch.cuda.is_available() and not args.tiny)
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.shape = TINY if self.tiny else QWEN3_8B
        self.work = Path(args.work or tempfile.mkdtemp(prefix="gpu-sampler-"))
        self.new = NEW if not self.tiny else 8
        self.prompt = PROMPT if not self.tiny else 16

    def tokens(self, seed: int, count: int) -> list[int]:
        rng = np.random.default_rng(seed)
        return [int(t) for t in rng.integers(16, self.shape.vocab, count)]

    # ---- env ----

    def env(self) -> None:
        info: dict[str, Any] = {"torch": torch.__version__, "device": str(self.device)}
        if self.cuda:
            import transformers
            import triton

            info |= {
                "gpu": torch.cuda.get_device_name(),
                "triton": triton.__version__,
                "transformers": transformers.__version__,
            }
            src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            copy_ms = cuda_median_ms(lambda: dst.copy_(src), reps=10, warmup=3)
            info["copy_tb_s"] = 2 * src.numel() / (copy_ms / 1e3) / 1e12
            del src, dst
        self.results.put("env", "info", info)
        self.log("env", info)

    # ---- the engine ----

    def engine(self, context: int) -> Any:
        from services.sampler.config import SamplerConfig
        from services.sampler.static_engine import StaticCacheEngine

        device, dtype = self.device, self.dtype

        class RandomEngine(StaticCacheEngine):
            def _load_model(self, model_dir: Path) -> Any:
                self.device, self.dtype = device, dtype
                return random_model(model_dir, device, dtype)

        path = model_dir(self.work, self.shape, "bfloat16" if self.cuda else "float32")
        t = time.perf_counter()
        engine = RandomEngine(
            SamplerConfig(
                model_path=str(path),
                device=self.device.type,
                engine="static",
                max_batch_size=64,
                max_loaded_loras=8,
                max_lora_rank=RANK,
                context_length=context,
            )
        )
        self.results.put("engine", "build_s", time.perf_counter() - t)
        return engine

    def decode_and_profile(self, timed: bool = True) -> None:
        from services.sampler.interface import SequenceRequest

        adapters = adapter_dirs(self.work / "adapters", self.shape, 8, self.device)
        engine = self.engine(2304 if not self.tiny else 512)
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        weight_bytes -= engine.model.get_input_embeddings().weight.nbytes  # a gather, not a read
        self.results.put("engine", "weight_bytes_read_per_step", weight_bytes)
        loop = asyncio.new_event_loop()
        stamps: list[float] = []
        original = engine._decode_step

        def stamped() -> None:
            original()
            stamps.append(time.perf_counter())

        engine._decode_step = stamped  # type: ignore[method-assign]
        try:
            for i, path in enumerate(adapters):
                loop.run_until_complete(engine.load_adapter(f"a{i}", str(path)))

            def requests(batch: int, n_adapters: int, seed: int, new: int, prompt: int) -> list[Any]:
                return [
                    SequenceRequest(
                        input_ids=self.tokens(seed + j, prompt),
                        max_new_tokens=new,
                        temperature=0.0,
                        ignore_eos=True,
                        lora_name=f"a{j % n_adapters}" if n_adapters else None,
                    )
                    for j in range(batch)
                ]

            def run(reqs: list[Any]) -> tuple[float, list[Any]]:
                stamps.clear()
                t = time.perf_counter()
                res = loop.run_until_complete(engine.generate(reqs))
                return time.perf_counter() - t, res

            for batch in BATCHES if timed else []:
                for n_adapters in (0, 1, 8):
                    if n_adapters > batch or (n_adapters == 0 and batch != 64 and not self.tiny):
                        continue
                    if self.args.quick and (batch, n_adapters) not in ((1, 1), (8, 8), (64, 1), (64, 8)):
                        continue
                    run(requests(batch, n_adapters, 5, self.new, self.prompt))  # captures the graphs
                    # the default (steps launched ahead of the host's read), then step by step
                    lookaheads = (True, False) if (batch, n_adapters) in ((1, 1), (8, 8), (64, 8)) else (True,)
                    for lookahead in lookaheads:
                        engine.config = msgspec.structs.replace(engine.config, decode_lookahead=lookahead)
                        wall, res = run(requests(batch, n_adapters, 7, self.new, self.prompt))
                        gaps = np.diff(stamps)[2:]
                        step = float(np.median(gaps)) if len(gaps) else float("nan")
                        self.row(
                            "decode",
                            {
                                "batch": batch,
                                "adapters": n_adapters,
                                "lookahead": lookahead,
                                "ms_per_step": step * 1e3,
                                "tok_s": batch / step,
                                "wall_s": wall,
                                "tokens": sum(len(r.output_ids) for r in res),
                            },
                        )
                    engine.config = msgspec.structs.replace(engine.config, decode_lookahead=True)
            with torch.inference_mode():
                self.profile(engine)
            for label, batch, length in (("64x128", 64, 128), ("1x2048", 1, 2048)):
                if self.tiny:
                    length = 64
                reqs = requests(batch, 1, 11, 1, length)
                run(reqs)
                times = [run(requests(batch, 1, 13 + k, 1, length))[0] for k in range(3)]
                wall = float(np.median(times))
                flops = prefill_flops(self.shape, [length] * batch)
                self.row(
                    "prefill",
                    {
                        "prompts": label,
                        "ms": wall * 1e3,
                        "tok_s": batch * length / wall,
                        "tflop_s": flops / wall / 1e12,
                        "mfu_pct": 100 * flops / wall / H200_PEAK_BF16,
                    },
                )
        finally:
            engine.close()
            loop.close()

    def profile(self, engine: Any) -> None:
        """Replays of one decode step's graph: wall (CUDA events) and its kernels, grouped."""
        if not self.cuda:
            return
        from torch.profiler import ProfilerActivity, profile

        from services.sampler import decode_ops as ops

        window = 256
        for batch, n_adapters in ((1, 1), (8, 1), (8, 8), (64, 8), (64, 0)):
            inputs = engine._inputs
            inputs[0, :batch] = torch.tensor(self.tokens(3, batch), device="cuda")
            inputs[1, :batch] = window - 8
            row_slots = [i % n_adapters if n_adapters else -1 for i in range(batch)]
            inputs[2, :batch] = torch.tensor(row_slots, device="cuda")
            span = engine.slot_span(row_slots)  # the graph the engine's own step would take
            engine._step_outputs(batch, window, span)

            def replay_ms(fn: Callable[[], Any]) -> float:
                return cuda_median_ms(fn, reps=20)

            def step(batch: int = batch, span: int = span) -> Any:
                return engine._step_outputs(batch, window, span)

            wall = replay_ms(step)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    engine._step_outputs(batch, window, span)
                torch.cuda.synchronize()
            groups: dict[str, list[float]] = {}
            for event in prof.events():
                if event.device_type.name != "CUDA":
                    continue
                groups.setdefault(kernel_group(event.name), []).append(event.device_time / 1e3)
            kernels = {k: {"count": len(v) / 5, "ms": sum(v) / 5} for k, v in sorted(groups.items())}
            busy = sum(g["ms"] for g in kernels.values())
            row = {"batch": batch, "adapters": n_adapters, "replay_ms": wall, "kernel_ms": busy}
            row["kernels_per_step"] = sum(g["count"] for g in kernels.values())
            row["gaps_ms"] = wall - busy
            self.results.put("profile", f"b{batch}_a{n_adapters}", {"row": row, "kernels": kernels})
            self.row("profile", row)
            for name, g in kernels.items():
                self.log(f"   {name:28s} {g['count']:7.0f} kernels {g['ms']:8.3f} ms")
            variants = []  # (decode_ops setting, the other choice, label), each timed in a graph of its own
            if batch <= ops.GROUP_ROWS and span != 0:  # the expand kernel's columns per program
                setting = "SMALL_CHUNK" if batch == 1 else "SMALL_CHUNK_SLOTS"
                other = 128 if getattr(ops, setting) != 128 else 1024
                variants.append((setting, other, f"expand chunk {other}"))
            if batch <= ops.FUSED_EXPAND_ROWS and span != 0:  # columns per program of silu · up with LoRA
                other = 256 if ops.SILU_LORA_BLOCK != 256 else 64
                variants.append(("SILU_LORA_BLOCK", other, f"silu · up block {other}"))
            if batch <= ops.FUSED_EXPAND_ROWS and span != 0:  # q/k/v and gate/up terms in their own kernels
                variants.append(("FUSED_EXPAND_ROWS", 0, "q/k/v and gate/up expand kernels"))
            key = (batch, window, span)
            for setting, other, label in variants:
                chosen = getattr(ops, setting)
                try:
                    setattr(ops, setting, other)
                    engine._graphs.pop(key, None)
                    engine._step_outputs(batch, window, span)
                    self.row("profile_variants", {"batch": batch, "variant": label, "replay_ms": replay_ms(step)})
                finally:
                    setattr(ops, setting, chosen)
                    engine._graphs.pop(key, None)
                    engine._step_outputs(batch, window, span)
            ablate = getattr(engine, "profile_variants", None)
            if ablate is not None:
                for label, fn in ablate(batch, window).items():
                    self.row(
                        "profile_variants", {"batch": batch, "variant": label, "replay_ms": replay_ms(fn)}
                    )

    # ---- HF generate, compiled static cache ----

    def hf(self) -> None:
        from transformers import LogitsProcessor, LogitsProcessorList

        path = model_dir(self.work, self.shape, "bfloat16" if self.cuda else "float32")
        model = random_model(path, self.device, self.dtype)
        new = HF_NEW if not self.tiny else 6

        class Stamp(LogitsProcessor):
            def __init__(self) -> None:
                self.times: list[float] = []

            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                self.times.append(time.perf_counter())
                return scores

        for batch in BATCHES:
            if self.time_left() < 25:
                self.log("hf: deadline, skipping batch", batch)
                continue
            ids = torch.tensor([self.tokens(7 + j, self.prompt) for j in range(batch)], device=self.device)
            stamp = Stamp()
            kwargs: dict[str, Any] = dict(
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                cache_implementation="static",
                logits_processor=LogitsProcessorList([stamp]),
            )
            with torch.inference_mode():
                t = time.perf_counter()
                model.generate(input_ids=ids, **kwargs)  # compiles
                first = time.perf_counter() - t
                stamp.times.clear()
                model.generate(input_ids=ids, **kwargs)
                self.sync()
            step = float(np.median(np.diff(stamp.times)[2:]))
            self.row(
                "hf_static_compiled",
                {"batch": batch, "ms_per_step": step * 1e3, "tok_s": batch / step, "first_call_s": first},
            )
        del model

    def summary(self) -> None:
        specs = {
            "decode": [
                ("batch", "batch"),
                ("adapters", "adapters"),
                ("lookahead", "lookahead"),
                ("ms/step", "ms_per_step"),
                ("tok/s", "tok_s"),
            ],
            "profile": [
                ("batch", "batch"),
                ("adapters", "adapters"),
                ("replay ms", "replay_ms"),
                ("kernel ms", "kernel_ms"),
                ("kernels", "kernels_per_step"),
                ("gaps ms", "gaps_ms"),
            ],
            "prefill": [("prompts", "prompts"), ("ms", "ms"), ("tok/s", "tok_s"), ("MFU %", "mfu_pct")],
            "hf_static_compiled": [("batch", "batch"), ("ms/step", "ms_per_step"), ("tok/s", "tok_s")],
        }
        parts = [
            f"## {k}\n\n{markdown_table(self.tables[k], c)}\n" for k, c in specs.items() if self.tables.get(k)
        ]
        hf = {r["batch"]: r["tok_s"] for r in self.tables.get("hf_static_compiled", [])}
        ratios = [
            {"batch": r["batch"], "adapters": r["adapters"], "x": r["tok_s"] / hf[r["batch"]]}
            for r in self.tables.get("decode", [])
            if r["batch"] in hf and r["lookahead"]
        ]
        if ratios:
            cols = [("batch", "batch"), ("adapters", "adapters"), ("x HF static compiled", "x")]
            parts.append(f"## engine / HF\n\n{markdown_table(ratios, cols)}\n")
        text = "\n".join(parts)
        (self.out / "summary.md").write_text(text)
        print(text, flush=True)


def kernel_group(name: str) -> str:
    """What a CUDA kernel does, from its name."""
    n = name.lower()
    rules = [
        ("lora", ("lora",)),
        ("attention (triton)", ("decode_attention", "attn")),
        ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "splitk", "matmul")),
        ("norm", ("norm",)),
        ("silu * up", ("silu",)),
        ("rope / qk", ("rope", "rotary")),
        ("softmax / log_softmax", ("softmax",)),
        ("argmax / reduce", ("argmax", "reduce", "max")),
        ("copy / index", ("copy", "index", "scatter", "gather", "cat")),
        ("elementwise", ("elementwise", "vectorized", "unrolled", "triton")),
    ]
    for label, keys in rules:
        if any(k in n for k in keys):
            return label
    return "other: " + name[:40]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--work", default=None)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument(
        "--quick", action="store_true", help="decode at (1, 1), (8, 8), (64, 1), (64, 8) only"
    )
    parser.add_argument("--sections", default="env,decode,hf")
    parser.add_argument("--deadline", type=float, default=330.0)
    args = parser.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    bench = Bench(args)
    wanted = args.sections.split(",")
    if "env" in wanted:
        with bench.section("env"):
            bench.env()
    if "decode" in wanted or "profile" in wanted:
        with bench.section("decode"):
            bench.decode_and_profile(timed="decode" in wanted)
    if "hf" in wanted:
        with bench.section("hf"):
            bench.hf()
    with bench.section("summary"):
        bench.summary()
    bench.log("done; errors:", len(cast(list[Any], bench.results.data["errors"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
