"""Shared bench helpers: model shapes, the FLOP model behind MFU, timing and results files.

FLOP model (``train_flops``) for one ``forward_backward`` over a packed batch of documents
with lengths ``l_1..l_D`` (``T = sum l_d`` tokens) through a *frozen* base with LoRA:

    linear     4 * N * T        N = weights of every matmul a token passes through: per layer
                                qkv + proj + fc1 (gate and up) + fc2, times layers, plus the
                                lm_head (hidden * vocab); the embedding lookup is no matmul.
                                2*N*T forward + 2*N*T for the input gradients; the base weights
                                are frozen, so the 2*N*T weight-gradient term of the usual
                                6*N*T does not exist and is not counted.
    attention  6 * layers * heads * head_dim * sum_d l_d * (l_d + 1)
                                forward QK^T and PV over the causal pairs of each document
                                (l(l+1)/2 pairs, 2*head_dim FLOPs each, two matmuls), backward
                                twice the forward (no credit for FlashAttention's recompute).
    lora       6 * r * sum_m (in_m + out_m) * T
                                per adapted linear m: forward x@A^T and h@B^T, backward the
                                input gradient and the A and B gradients (3 x 2 FLOPs per MAC),
                                one adapter per HF projection (q, k, v, o, gate, up, down; the
                                trainer's LoRA shape, as Tinker's) plus the lm_head adapter. The
                                trainer's block-diagonal B (one GEMM for q/k/v, one for gate/up)
                                spends more; that excess is not credited.

MFU = (linear + attention + lora) / step time / ``H200_PEAK_BF16`` (dense bf16, datasheet).
Norms, RoPE, SwiGLU, softmax-cross-entropy and other elementwise work are not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

H200_PEAK_BF16 = 989.4e12
"""Dense bf16 tensor-core peak of an H100/H200 SXM (NVIDIA datasheet), FLOP/s."""


@dataclass(frozen=True)
class Shape:
    """A dense Qwen3-style decoder (GQA, SwiGLU MLP, untied lm_head)."""

    hidden: int
    layers: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int

    def hf_config(self) -> dict[str, Any]:
        """A Hugging Face ``config.json`` for this shape (Qwen3 family)."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.groups,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "torch_dtype": "bfloat16",
        }


QWEN3_8B = Shape(hidden=4096, layers=36, heads=32, groups=8, head_dim=128, ffn=12288, vocab=151936)
TINY = Shape(hidden=64, layers=2, heads=4, groups=2, head_dim=16, ffn=128, vocab=512)


def linear_dims(shape: Shape) -> list[tuple[int, int]]:
    """(in, out) of every matmul with weights, in the trainer's fused layout."""
    h, d = shape.hidden, shape.head_dim
    layer = [
        (h, (shape.heads + 2 * shape.groups) * d),  # qkv
        (shape.heads * d, h),  # proj
        (h, 2 * shape.ffn),  # fc1 = gate and up
        (shape.ffn, h),  # fc2
    ]
    return layer * shape.layers + [(h, shape.vocab)]  # + lm_head


def lora_modules(shape: Shape) -> dict[str, tuple[int, int]]:
    """Every adapted HF projection, by module name: (in, out). Per layer q, k, v, o, gate, up,
    down, then the lm_head (the order PEFT adapters are built in by the GPU benches)."""
    h, d = shape.hidden, shape.head_dim
    q, kv = shape.heads * d, shape.groups * d
    layer = {
        "self_attn.q_proj": (h, q),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h),
        "mlp.gate_proj": (h, shape.ffn),
        "mlp.up_proj": (h, shape.ffn),
        "mlp.down_proj": (shape.ffn, h),
    }
    modules = {f"model.layers.{i}.{name}": dims for i in range(shape.layers) for name, dims in layer.items()}
    modules["lm_head"] = (h, shape.vocab)
    return modules


def lora_dims(shape: Shape) -> list[tuple[int, int]]:
    """(in, out) of every adapted HF projection: q, k, v, o, gate, up, down per layer, lm_head."""
    return list(lora_modules(shape).values())


def base_matmul_params(shape: Shape) -> int:
    return sum(i * o for i, o in linear_dims(shape))


def train_flops(shape: Shape, doc_lens: Sequence[int], lora_rank: int) -> dict[str, float]:
    """The FLOPs one forward_backward needs (module docstring), by term and in total."""
    tokens = sum(doc_lens)
    linear = 4.0 * base_matmul_params(shape) * tokens
    pairs = sum(n * (n + 1) for n in doc_lens)
    attention = 6.0 * shape.layers * shape.heads * shape.head_dim * pairs
    lora = 6.0 * lora_rank * sum(i + o for i, o in lora_dims(shape)) * tokens
    return {"linear": linear, "attention": attention, "lora": lora, "total": linear + attention + lora}


def mfu(flops: float, seconds: float, peak: float = H200_PEAK_BF16) -> float:
    return flops / seconds / peak


def time_calls(
    fn: Callable[[], Any], warmup: int, iters: int, sync: Callable[[], None]
) -> tuple[list[float], Any]:
    """Wall seconds of ``iters`` calls after ``warmup`` ones, synchronised before and after each."""
    result = None
    for _ in range(warmup):
        result = fn()
    sync()
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - start)
    return times, result


def cuda_median_ms(fn: Callable[[], object], reps: int, warmup: int = 0) -> float:
    """The median milliseconds of ``fn`` on the current CUDA stream over ``reps`` calls, each
    between two CUDA events (after ``warmup`` untimed calls)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(statistics.median(times))


def summarize(times: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


class Results:
    """A JSON results file rewritten after every record, so a killed run keeps what it had."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"sections": {}, "errors": []}

    def put(self, section: str, key: str, value: Any) -> None:
        self.data["sections"].setdefault(section, {})[key] = value
        self.flush()

    def error(self, section: str, text: str) -> None:
        self.data["errors"].append({"section": section, "error": text})
        self.flush()

    def flush(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=_json_default))


class BenchRun:
    """What the GPU benches' runs share: a results file (``Results``, in ``out``), a clock against
    ``deadline`` seconds, sections that record their error and let the next one run, and result
    tables kept in memory and under ``results[table_key]``.

    torch is imported only by the methods that synchronise or free memory (``cuda`` runs)."""

    def __init__(self, out: Path, deadline: float, cuda: bool, table_key: str = "tables") -> None:
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.results = Results(self.out / "results.json")
        self.deadline = deadline
        self.cuda = cuda
        self.start = time.monotonic()
        self.tables: dict[str, list[dict[str, Any]]] = {}
        self._table_key = table_key

    def log(self, *parts: Any) -> None:
        print(f"[{time.monotonic() - self.start:7.1f}s]", *parts, flush=True)

    def time_left(self) -> float:
        return float(self.deadline - (time.monotonic() - self.start))

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def row(self, table: str, row: dict[str, Any]) -> None:
        """Append ``row`` to ``table`` (logged, and the results file rewritten)."""
        self.tables.setdefault(table, []).append(row)
        self.results.put(self._table_key, table, self.tables[table])
        self.log(table, row)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Run a section: an exception is recorded (results ``errors``) and the run goes on.

        The section starts by freeing what the one before left (``release``): a failed section's
        frames, and the GPU memory they hold, live on in its exception's traceback until the
        ``with`` statement has finished, so they cannot be freed at its own end."""
        self.release()
        self.log(f"== {name}")
        try:
            yield
        except Exception:
            text = traceback.format_exc()
            self.log(f"!! {name} failed:\n{text}")
            self.results.error(name, text)

    def attempt(self, key: str, fn: Callable[[], T]) -> T | None:
        """``fn()``, or None with the error recorded under ``key`` (one row out of memory on a
        smaller card leaves the section's other rows)."""
        try:
            return fn()
        except Exception:
            self.results.error(key, traceback.format_exc())
            self.log("!!", key, traceback.format_exc().splitlines()[-1])
        # Outside the handler: while it runs, the exception's traceback keeps the failed step's
        # frames, and their tensors, alive, and a collection there frees none of them.
        self.release()
        return None

    def release(self) -> None:
        """Collect garbage and hand the GPU memory torch's allocator caches back to the driver
        (another process, a stack's trainer or sampler, may need it)."""
        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.empty_cache()


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    return str(obj)


def markdown_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """``columns`` = (header, row key); floats get 3 significant digits."""

    def fmt(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for _, k in columns) + " |" for r in rows]
    return "\n".join(lines)


# ---- CPU benchmarks (gateway_overhead, trainer_cpu, sampler_cpu, recovery) -------------------
#
# Every CPU script prints the machine line, its repetitions and markdown tables; comparisons are
# measured side by side in one run (interleaved where it matters) and reported as ratios, because
# the test machine is shared and its absolute numbers move from run to run.


def cpu_parser(description: str) -> argparse.ArgumentParser:
    """The scripts' command line (``--quick``); also silences transformers' progress bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes (< 1 minute), for the smoke test")
    return parser


def machine() -> str:
    """One line: CPU model, usable cores, load average, python, torch and its thread count."""
    import os
    import platform

    import torch

    model = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    cores = len(os.sched_getaffinity(0))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{model}; {cores} usable cores; load average {load}; python {platform.python_version()}; "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads)"
    )


def code_version() -> str:
    """The commit the scripts run on, and whether the working tree differs from it."""
    import subprocess

    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + (" + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def header(title: str, quick: bool, **sizes: object) -> None:
    import os

    from tinkerd.launcher import launch_mode

    print(f"# {title}{' (--quick)' if quick else ''}")
    print(f"machine: {machine()}")
    print(f"code: {code_version()}")
    print(f"stack services started by: {launch_mode(dict(os.environ))} (TINKERD_LAUNCH)")
    print("sizes: " + ", ".join(f"{k}={v}" for k, v in sizes.items()))
    print(flush=True)


def footer() -> None:
    """The load average at the end of a run (the header has it at the start)."""
    import os

    print("load average at end: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()), flush=True)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default); q in [0, 100]."""
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else float("nan")


def dist(values: Sequence[float], scale: float = 1.0) -> dict[str, float | int]:
    """n, min, p50, p99, mean and max of ``values`` times ``scale``."""
    scaled = [v * scale for v in values]
    return {
        "n": len(scaled),
        "min": min(scaled) if scaled else float("nan"),
        "p50": percentile(scaled, 50),
        "p99": percentile(scaled, 99),
        "mean": statistics.fmean(scaled) if scaled else float("nan"),
        "max": max(scaled) if scaled else float("nan"),
    }


def table(title: str, rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> None:
    print(f"## {title}\n\n{markdown_table(rows, columns)}\n", flush=True)


@contextlib.contextmanager
def running_stack(
    env: dict[str, str] | None = None, services: tuple[str, ...] | None = None
) -> Iterator[Any]:
    """A real Tinkerd stack (``tests.harness.Stack``) in a temporary directory."""
    import os
    import tempfile

    from tests.harness import Stack

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    with tempfile.TemporaryDirectory(prefix="tinkerd-bench-") as tmp:
        stack = Stack(Path(tmp), env_overrides=env or {})
        if services is not None:
            stack.services = services
        try:
            yield stack.start()
        finally:
            stack.stop()


def stream_messages(nats_url: str, stream: str, subject: str, decode: Callable[[Any], Any]) -> list[Any]:
    """``decode(msg)`` of every message of ``stream`` matching ``subject`` so far, in stream order."""
    import asyncio

    from infra.bus import Bus, last_seq, replay

    async def read() -> list[Any]:
        bus = await Bus.connect(nats_url, "bench")
        out: list[Any] = []
        try:
            await replay(bus, stream, subject, await last_seq(bus, stream), lambda m: out.append(decode(m)))
        finally:
            await bus.close()
        return out

    return asyncio.run(read())


def events(nats_url: str) -> list[Any]:
    """All operation events so far (the `tinkerd events --replay` view), decoded."""
    from libs.contracts import codec
    from libs.contracts import subjects as s

    return stream_messages(
        nats_url, s.STREAM_EVENTS, s.EVENTS_ALL, lambda m: codec.event_decoder.decode(m.data)
    )


def event_tag(event: Any) -> str:
    return str(type(event).__struct_config__.tag)


def sft_datum(tokens: Sequence[int]) -> Any:
    """A cross-entropy ``tinker.types.Datum`` predicting ``tokens[1:]`` from ``tokens[:-1]``."""
    import numpy as np
    from tinker import types

    n = len(tokens) - 1
    inputs: dict[str, Any] = {
        "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
        "weights": np.ones(n, dtype=np.float32),
    }
    return types.Datum(model_input=types.ModelInput.from_ints(list(tokens[:-1])), loss_fn_inputs=inputs)




def random_tokens(seed: int, n: int, vocab: int, low: int = 4) -> list[int]:
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(low, vocab, size=n)]


QWEN3_100M = Shape(hidden=768, layers=12, heads=12, groups=4, head_dim=64, ffn=2048, vocab=32000)
"""A roughly 100M-parameter Qwen3 (untied embeddings: 2 x 24.6M + 12 x 6.3M)."""


def random_qwen3(out_dir: Path, shape: Shape, seed: int = 0) -> Path:
    """A randomly initialised Qwen3 of ``shape`` as config.json + model.safetensors (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = shape.hf_config() | {"torch_dtype": "float32", "max_position_embeddings": 4096}
    config.pop("architectures")
    config.pop("model_type")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**config), dtype=torch.float32)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def shaped_model_dir(out: Path, shape: Shape, dtype: str, name: str, tokenizer_root: Path) -> Path:
    """A Qwen3 model directory of ``shape`` without weights in ``out``: its config.json (``dtype``)
    and the project's tiny tokenizer files (the tiny model built under ``tokenizer_root``)."""
    import shutil

    from libs.models.tiny import TinyPreset, build_tiny, model_config

    tiny = build_tiny(tokenizer_root)
    out.mkdir(parents=True)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(tiny / file, out / file)
    preset = TinyPreset(
        name=name,
        arch="qwen3",
        architecture="Qwen3ForCausalLM",
        rope_theta=1_000_000.0,
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.groups,
        head_dim=shape.head_dim,
        max_position_embeddings=40960,
    )
    config = model_config(preset)
    config.update(torch_dtype=dtype, dtype=dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def random_peft_adapter(base_dir: Path, out_dir: Path, seed: int, rank: int) -> Path:
    """A PEFT LoRA on every attention and MLP projection, with random non-zero A and B."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, local_files_only=True)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * (0.1 if "lora_A" in name else 0.05))
    model.save_pretrained(str(out_dir))
    return out_dir


def shape_of(model_dir: Path) -> Shape:
    """The ``Shape`` of a Hugging Face Qwen3/Llama directory (its config.json)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    return Shape(
        hidden=int(cfg["hidden_size"]),
        layers=int(cfg["num_hidden_layers"]),
        heads=heads,
        groups=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        ffn=int(cfg["intermediate_size"]),
        vocab=int(cfg["vocab_size"]),
    )


def stepped_pool(model_shape: Any, slots: int, rank: int, device: str = "cpu") -> Any:
    """An `AdapterPool` (torch and the trainer imported here) whose every slot holds random
    adapters and gradients under a rank-`rank` config: what `SlotAdamW.step_many` benches step."""
    import torch

    from libs.contracts.common import LoraConfig
    from services.trainer.lora import AdapterPool

    with torch.device(device):
        pool = AdapterPool(model_shape, slots, rank, device=device)
    with torch.no_grad():
        for p in pool.parameters():
            p.normal_(0.0, 0.01)
            assert p.grad is not None  # in place: the grads are views of the pool's rows
            p.grad.normal_(0.0, 1e-3)
    for s in range(slots):
        pool.routing.configs[s] = LoraConfig(rank=rank, seed=s)
    return pool
