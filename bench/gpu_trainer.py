"""One-shot GPU benchmark of the trainer engine against Hugging Face transformers + PEFT.

Everything runs in one process, in this order, each section isolated (an error is logged
and recorded, the next section still runs):

    env        versions, GPU, measured bf16 matmul ceiling
    attention  fused backends (varlen_flash, varlen_flash_cudnn, flex_attention) vs
               per-document SDPA on a GQA packed stream (varlen_flash_cudnn also on one
               4,096-token document, where it runs cuDNN): forward/backward error against an
               fp32 reference, and forward+backward time of the attention op alone
    engine     TrainerEngine.forward_backward on a Qwen3-8B-shaped megatron model (random
               bf16 weights built on the GPU), LoRA rank 32 on every linear and the lm_head:
               packed batches of 1k-8k tokens; 8 tenants vs 1 tenant on the same tokens;
               the loss on the engine's default path, and every workload again through
               each loss path by name ("fused-ce" rows: the chunked fused linear
               cross-entropy, fused_ce.py; "unfused-ce" rows: the output layer +
               vocab.target_logprobs); the main rows on the engine's default attention
               (engine.resolve_backend: varlen_flash_cudnn on CUDA) and its step graphs
               (the CUDA default), the batches within the step graphs' limit again eagerly,
               other backends on the 4k batches (varlen_flash on the one-document 4k
               and 8k batches, where it differs); torch.profiler tables of 4x1024, and of
               16x256 for one tenant and for eight
    optimizer  optim_step latency: 1 and 8 slots of the engine's pool, then 1, 8 and 64 slots
               of a 64-slot pool (rank 32), each count stepped in one SlotAdamW.step_many call
               (wall time, host time until the call returns, aten ops and kernels of one call)
    hf         the same single-tenant batches through transformers + PEFT (SDPA attention,
               rank 32 on q/k/v/o/gate/up/down and lm_head), same GPU; a profiler table
    liger      the same through transformers + PEFT with Liger kernels (RMSNorm, RoPE, SwiGLU,
               fused linear cross-entropy; CUDA only). Liger's fused loss reads
               ``lm_head.weight`` directly, so an lm_head adapter would be silently left out of
               the loss: this column adapts q/k/v/o/gate/up/down only (the lm_head LoRA is
               0.15 % of the step's FLOPs at this shape). Runs after ``hf`` (it patches the
               transformers Qwen3 classes in place)

Outputs under ``--out``: results.json (every number), summary.md (the tables),
profile_engine.txt and profile_hf.txt (top kernels), and whatever the caller tees the log to.

    python -m bench.gpu_trainer --out DIR            # the H200 run (docs/gpu.md)
    python -m bench.gpu_trainer --out DIR --tiny     # CPU smoke test of every code path
    python -m bench.gpu_trainer --out DIR --no-variants --iters 11   # the default rows, more steps
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    H200_PEAK_BF16,
    QWEN3_8B,
    TINY,
    BenchRun,
    Shape,
    markdown_table,
    mfu,
    stepped_pool,
    summarize,
    time_calls,
    train_flops,
)

LORA_RANK = 32

# (name, doc length, documents, tenants): tenants > 1 spreads the documents round-robin over
# that many adapter slots (the packer sorts them into one contiguous segment per slot).
ENGINE_WORKLOADS = [
    ("1x1024", 1024, 1, 1),
    ("2x1024", 1024, 2, 1),
    ("4x1024", 1024, 4, 1),
    ("1x4096", 4096, 1, 1),
    ("8x1024", 1024, 8, 1),
    ("2x4096", 4096, 2, 1),
    ("1x8192", 8192, 1, 1),
    ("16x256", 256, 16, 1),
    ("16x256 8 tenants", 256, 16, 8),
    ("8x1024 8 tenants", 1024, 8, 8),
]
HF_WORKLOADS = ["1x1024", "4x1024", "1x4096", "8x1024", "1x8192", "16x256"]
BACKEND_WORKLOADS = ["4x1024", "1x4096", "16x256"]
ONE_DOCUMENT_WORKLOADS = ["1x4096", "1x8192"]  # where varlen_flash_cudnn differs from varlen_flash
PROFILE_WORKLOAD = "4x1024"
TENANT_PROFILE_WORKLOADS = ["16x256", "16x256 8 tenants"]  # one tenant and eight, the same tokens
CE_PATHS = ("fused-ce", "unfused-ce")  # each loss path forced, beside the default, on every workload
TINY_LEN = {1024: 16, 4096: 64, 8192: 128, 256: 4}


class Bench(BenchRun):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tiny = args.tiny
        self.device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
        super().__init__(Path(args.out), args.deadline, self.device.type == "cuda", table_key="rows")
        self.shape: Shape = TINY if args.tiny else QWEN3_8B
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.model_dir = Path(tempfile.mkdtemp(prefix="bench-model-"))
        (self.model_dir / "config.json").write_text(json.dumps(self.shape.hf_config()))
        self.ceiling = H200_PEAK_BF16
        self.usable_backends: set[str] = set()
        wanted = args.sections.split(",")
        # seconds the engine section leaves for the sections after it (about 80 s for hf and
        # liger together on the H200, 10 s for optimizer)
        self.reserve_s = 20.0 + 50.0 * sum(s in wanted for s in ("hf", "liger")) + 10.0 * ("optimizer" in wanted)

    def doc_len(self, n: int) -> int:
        return TINY_LEN.get(n, max(2, n // 64)) if self.tiny else n

    def fits(self, workload: str) -> bool:
        """Whether ``workload``'s tokens are within ``--min-tokens`` and ``--max-tokens`` (all
        are without them)."""
        _, doc_len, docs, _ = next(w for w in ENGINE_WORKLOADS if w[0] == workload)
        tokens = doc_len * docs
        low, high = self.args.min_tokens, self.args.max_tokens
        return (low is None or tokens >= low) and (high is None or tokens <= high)

    def peak_reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float | None:
        return torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None

    # ---- sections ----

    def env(self) -> None:
        info: dict[str, Any] = {"torch": torch.__version__, "device": str(self.device), "python": sys.version}
        for mod in ("megatron.core", "transformers", "peft", "transformer_engine"):
            try:
                module = __import__(mod, fromlist=["__version__"])
                info[mod] = getattr(module, "__version__", "?")
            except Exception as exc:
                info[mod] = f"unavailable: {type(exc).__name__}: {exc}"
        for mod in ("torch.nn.attention.varlen", "torch.nn.attention.flex_attention"):
            try:
                __import__(mod)
                info[mod] = "ok"
            except Exception as exc:
                info[mod] = f"unavailable: {exc}"
        if self.cuda:
            props = torch.cuda.get_device_properties(0)
            info["gpu"] = props.name
            info["sms"] = props.multi_processor_count
            info["gpu_mem_gib"] = props.total_memory / 2**30
            n = 8192
            a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            times, _ = time_calls(lambda: a @ b, 3, 10, self.sync)
            info["matmul_8192_bf16_tflops"] = 2 * n**3 / summarize(times)["median_s"] / 1e12
            del a, b
        self.log(json.dumps(info, indent=1))
        self.results.put("env", "info", info)

    def attention(self) -> None:
        from services.trainer.attention import ATTENTION_BACKENDS

        s = self.shape

        class Cfg:
            num_attention_heads, num_query_groups = s.heads, s.groups
            kv_channels, tensor_model_parallel_size = s.head_dim, 1

        class Packed:
            def __init__(self, lens: list[int], device: torch.device) -> None:
                self.cu_seqlens_q = torch.tensor(np.cumsum([0, *lens]), dtype=torch.int32, device=device)
                self.max_seqlen_q = max(lens)

        def qkv(total: int, dtype: torch.dtype, grad: bool) -> list[torch.Tensor]:
            heads = (s.heads, s.groups, s.groups)
            return [
                torch.randn(total, h, s.head_dim, device=self.device, dtype=dtype).requires_grad_(grad)
                for h in heads
            ]

        backends = ["sdpa_per_document"] + (
            ["varlen_flash", "varlen_flash_cudnn", "flex_attention"] if self.cuda else ["flex_attention"]
        )
        # Correctness: uneven documents, fresh random inputs, error vs an fp32 reference.
        # Sums to 4096 so that compiled flex_attention sees one shape in this whole run.
        lens = [1000, 37, 2048, 1, 1010] if not self.tiny else [9, 1, 17, 5]
        packed = Packed(lens, self.device)
        ref_inputs = qkv(sum(lens), torch.float32, grad=self.cuda)
        grad_out = torch.randn(sum(lens), s.heads * s.head_dim, device=self.device)
        ref_mod = ATTENTION_BACKENDS["sdpa_per_document"](Cfg(), 1, None, "self")
        ref_out = ref_mod(*ref_inputs, None, packed_seq_params=packed)
        ref_grads = torch.autograd.grad(ref_out, ref_inputs, grad_out) if self.cuda else None
        # one document of the same length: the stream varlen_flash_cudnn hands to cuDNN
        one_doc = Packed([sum(lens)], self.device)
        one_ref_out = ref_mod(*ref_inputs, None, packed_seq_params=one_doc)
        one_ref_grads = torch.autograd.grad(one_ref_out, ref_inputs, grad_out) if self.cuda else None
        baseline = 0.0
        for name in backends:
            try:
                check: dict[str, Any] = {}
                cases = [("", packed, ref_out, ref_grads)]
                if name == "varlen_flash_cudnn":
                    cases.append(("one_document_", one_doc, one_ref_out, one_ref_grads))
                t0 = time.perf_counter()
                for prefix, stream, want, want_grads in cases:
                    mod = ATTENTION_BACKENDS[name](Cfg(), 1, None, "self")
                    inputs = [x.detach().to(self.dtype).requires_grad_(self.cuda) for x in ref_inputs]
                    out = mod(*inputs, None, packed_seq_params=stream)
                    check[f"{prefix}out_rel_err"] = _rel(out, want)
                    if self.cuda:
                        grads = torch.autograd.grad(out, inputs, grad_out.to(self.dtype))
                        for label, g, r in zip("qkv", grads, want_grads or [], strict=True):
                            check[f"{prefix}d{label}_rel_err"] = _rel(g, r)
                self.sync()
                check["first_call_s"] = time.perf_counter() - t0
            except Exception:
                self.log("!! check", name, traceback.format_exc())
                self.results.error(f"attention/{name}", traceback.format_exc())
                continue
            # bf16 inputs alone cost about 3e-3; allow that and twice the bf16 SDPA error.
            tolerance = max(2e-2, 2 * baseline) if self.dtype == torch.bfloat16 else 1e-5
            errors = [v for k, v in check.items() if k.endswith("rel_err")]
            if name == "sdpa_per_document":
                baseline = max(errors)
            if all(e <= tolerance for e in errors):  # NaN fails too
                self.usable_backends.add(name)
            check["passed"] = name in self.usable_backends
            self.log("check", name, check)
            self.results.put("attention_check", name, check)
        if not self.cuda:
            return
        # Speed of the op alone, forward + backward, on the engine's 4k/8k batch layouts.
        for layout in ([1024] * 4, [4096], [8192], [256] * 16):
            total = sum(layout)
            packed = Packed(layout, self.device)
            flops = train_flops(self.shape, layout, 0)["attention"] / s.layers
            for name in backends:
                if name not in self.usable_backends:
                    continue
                if name == "flex_attention" and total != 4096:
                    continue  # one compiled shape is enough; keeps compile time out of the budget
                if name == "varlen_flash_cudnn" and len(layout) > 1:
                    continue  # several documents: varlen_flash itself
                mod = ATTENTION_BACKENDS[name](Cfg(), 1, None, "self")
                inputs = qkv(total, self.dtype, grad=True)
                g = torch.randn(total, s.heads * s.head_dim, device=self.device, dtype=self.dtype)

                def step(
                    mod: Any = mod, inputs: list[torch.Tensor] = inputs, g: torch.Tensor = g, p: Any = packed
                ) -> Any:
                    out = mod(*inputs, None, packed_seq_params=p)
                    return torch.autograd.grad(out, inputs, g)

                times, _ = time_calls(step, 2, 10, self.sync)
                stat = summarize(times)
                row = {
                    "layout": f"{len(layout)}x{layout[0]}",
                    "backend": name,
                    "ms": stat["median_s"] * 1e3,
                    "tflops": flops / stat["median_s"] / 1e12,
                }
                self.row("attention_speed", row)

    def build_engine(self, backend: str, num_slots: int) -> Any:
        import services.trainer.model as model_mod
        from services.trainer.engine import EngineConfig, TrainerEngine

        def random_weights(model: Any, model_dir: Any, shape: Any) -> None:
            """Bench-only stand-in for the checkpoint: N(0, 0.02) matrices, unit norms."""
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "norm" in name:
                        param.fill_(1.0)
                    else:
                        param.normal_(0.0, 0.02)

        from services.trainer.parallel import ensure_model_parallel

        ensure_model_parallel(self.device.type)
        if self.cuda:  # harmless; keeps any megatron RNG fork on the GPU path well defined
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(1234)
        original = model_mod.load_hf_weights
        model_mod.load_hf_weights = random_weights  # type: ignore[assignment]
        try:
            t0 = time.perf_counter()
            engine = TrainerEngine(
                EngineConfig(
                    str(self.model_dir),
                    num_slots=num_slots,
                    max_lora_rank=LORA_RANK,
                    device=self.device.type,
                    dtype=self.dtype,
                    attention_backend=backend,
                    **(
                        {}
                        if self.args.step_graph_max_tokens is None
                        else {"step_graph_max_tokens": self.args.step_graph_max_tokens}
                    ),
                )
            )
            self.sync()
            self.log(f"engine built in {time.perf_counter() - t0:.1f}s ({backend}, {num_slots} slots)")
        finally:
            model_mod.load_hf_weights = original
        return engine

    def datums(self, doc_len: int, docs: int, tenants: int, seed: int = 0) -> list[Any]:
        from services.trainer.engine import DatumInput

        rng = np.random.default_rng(seed)
        out = []
        for i in range(docs):
            seq = rng.integers(0, self.shape.vocab, doc_len + 1)
            weights = np.ones(doc_len, dtype=np.float32)
            out.append(DatumInput(i % tenants, seq[:-1], {"target_tokens": seq[1:], "weights": weights}))
        return out

    def measure(self, fn: Callable[[], Any], lens: list[int]) -> dict[str, Any]:
        self.peak_reset()
        times, result = time_calls(fn, self.args.warmup, self.args.iters, self.sync)
        stat = summarize(times)
        flops = train_flops(self.shape, lens, LORA_RANK)
        tokens = sum(lens)
        return {
            "tokens": tokens,
            "median_s": stat["median_s"],
            "min_s": stat["min_s"],
            "max_s": stat["max_s"],
            "tokens_per_s": tokens / stat["median_s"],
            "tflops": flops["total"] / stat["median_s"] / 1e12,
            "mfu": mfu(flops["total"], stat["median_s"]),
            "attention_flop_share": flops["attention"] / flops["total"],
            "peak_gib": self.peak_gib(),
            "result": result,
        }

    def engine(self) -> None:
        from megatron.core.transformer.enums import AttnMaskType

        from services.trainer import lora
        from services.trainer.attention import ATTENTION_BACKENDS
        from services.trainer.engine import AdamParams, LoraConfig, resolve_backend

        # the engine's own default (engine.resolve_backend) unless the attention section found it
        # unusable here; without that section, the default unchecked
        backend = resolve_backend("auto", self.device.type)
        if self.cuda and self.usable_backends and backend not in self.usable_backends:
            usable = [b for b in ("varlen_flash", "flex_attention") if b in self.usable_backends]
            backend = usable[0] if usable else "sdpa_per_document"
        self.peak_reset()
        engine = self.build_engine(backend, num_slots=8)
        self.results.put("engine", "build_peak_gib", self.peak_gib())
        # The main rows take the engine's default loss path (engine.resolve_fused_ce: by size on
        # CUDA); rows labelled "<backend> fused-ce" / "<backend> unfused-ce" re-run every workload
        # with the chunked fused linear cross-entropy (services/trainer/fused_ce.py) / the output
        # layer + vocab.target_logprobs forced, on --cpu too.
        engine.fused_ce = True  # for the probe below
        for slot in range(8):
            engine.init_slot(slot, LoraConfig(rank=LORA_RANK, seed=slot))
        with torch.no_grad():  # non-zero B, so every adapter changes the logits (same speed)
            for adapter in engine.pool.adapters.values():
                adapter.lora_B.normal_(0.0, 1e-3)
        fused_ok = True
        try:  # one probe step: should the fused path fail here, the section measures the unfused one
            engine.forward_backward(self.datums(self.doc_len(1024), 2, 2), "cross_entropy")
            for slot in range(8):
                engine.discard_grads(slot)
        except Exception:
            fused_ok = False
            engine.fused_ce = False
            self.results.error("engine/fused_ce", traceback.format_exc())
            self.log("!! fused cross-entropy failed; measuring the unfused path", traceback.format_exc())
        self.results.put("engine", "fused_ce", fused_ok)
        engine.fused_ce = None if fused_ok else False

        def run(name: str, doc_len: int, docs: int, tenants: int, label: str) -> dict[str, Any] | None:
            n = self.doc_len(doc_len)
            datums = self.datums(n, docs, tenants)

            def step() -> float:
                outs = engine.forward_backward(datums, "cross_entropy")
                return float(sum(o.loss for o in outs))

            m = self.attempt(f"engine/{label}/{name}", lambda: self.measure(step, [n] * docs))
            if m is None:
                for slot in range(8):
                    engine.discard_grads(slot)
                return None
            m.update(
                workload=name, backend=label, tenants=tenants, loss_finite=bool(np.isfinite(m.pop("result")))
            )
            self.row("engine", m)
            return m

        by_name = {w[0]: w for w in ENGINE_WORKLOADS}

        def profile_tenants(prefix: str, max_tokens: int | None = None) -> None:
            """One step of the same tokens for one tenant and for eight, profiled as the engine runs
            them now (profile_<prefix>_16x256.txt beside profile_<prefix>_16x256_8_tenants.txt)."""
            for name in TENANT_PROFILE_WORKLOADS:
                _, doc_len, docs, tenants = by_name[name]
                if not self.fits(name) or self.time_left() < self.reserve_s:
                    continue
                if max_tokens is not None and self.doc_len(doc_len) * docs > max_tokens:
                    continue
                batch = self.datums(self.doc_len(doc_len), docs, tenants)
                label = f"{prefix}_" + name.replace(" ", "_")
                try:
                    self.profile(functools.partial(engine.forward_backward, batch, "cross_entropy"), label)
                except Exception:
                    self.results.error(f"profile/{label}", traceback.format_exc())
                    self.log("!! profile", label, traceback.format_exc().splitlines()[-1])

        for name, doc_len, docs, tenants in ENGINE_WORKLOADS:
            if not self.fits(name):
                continue
            if self.time_left() < self.reserve_s + 40:
                self.log("skipping", name, "(deadline)")
                continue
            run(name, doc_len, docs, tenants, backend)

        # The main rows are the engine's default: on CUDA, a step of at most
        # step_graph_max_tokens replays CUDA graphs recorded per shape (step_graphs.py; each
        # shape's first timed call is a warm-up, which records it). The same workloads again
        # run eagerly ("<backend> eager"), as does everything after them.
        graphs = engine.step_graphs
        if graphs is not None:
            counts = {"steps": graphs.steps, "recorded": graphs.recorded, "replays": graphs.replays}
            self.results.put("engine", "step_graphs", counts)
            self.log("step graphs", counts)
            limit = engine.step_graph_max_tokens
            profile_tenants("graphs", limit)  # as replayed: where a static step of several slots spends its time
            engine.step_graphs = None
            for name, doc_len, docs, tenants in ENGINE_WORKLOADS:
                if self.fits(name) and self.doc_len(doc_len) * docs <= limit and self.time_left() > self.reserve_s + 40:
                    run(name, doc_len, docs, tenants, label=f"{backend} eager")

        # The same workloads with the other placement of each adapted linear's base product
        # (lora.base_in_epilogue): where the default adds the LoRA term in the base GEMM's
        # epilogue, "<backend> separate-base" rows hand the frozen linear its rows and add the LoRA
        # term onto its output; where it does not, "<backend> base-in-epilogue" rows do the former.
        if self.cuda and self.args.variants:
            default_devices = lora.BASE_IN_EPILOGUE_DEVICES
            in_epilogue = "cuda" in default_devices
            lora.BASE_IN_EPILOGUE_DEVICES = default_devices ^ {"cuda"}
            try:
                for name in by_name:
                    if self.fits(name) and self.time_left() > self.reserve_s + 40:
                        run(*by_name[name], label=f"{backend} {'separate-base' if in_epilogue else 'base-in-epilogue'}")
            finally:
                lora.BASE_IN_EPILOGUE_DEVICES = default_devices

        default = engine.fused_ce
        for path in CE_PATHS if fused_ok and self.args.variants else ():
            engine.fused_ce = path == "fused-ce"
            for name in by_name:
                if not self.fits(name) or self.time_left() < self.reserve_s:
                    continue
                run(*by_name[name], label=f"{backend} {path}")
        engine.fused_ce = default

        def swap(to: str) -> None:
            cls = ATTENTION_BACKENDS[to]
            for layer in engine.model.decoder.layers:
                attn = layer.self_attention
                attn.core_attention = cls(attn.config, attn.layer_number, AttnMaskType.causal, "self")

        others = (
            [b for b in ("sdpa_per_document", "flex_attention", "varlen_flash_cudnn", "varlen_flash") if b != backend]
            if self.cuda and self.args.variants
            else []
        )
        varlen = {"varlen_flash", "varlen_flash_cudnn"}  # they differ on one-document streams alone
        for other in others:
            if other not in self.usable_backends:
                continue
            swap(other)
            one_document = other == "varlen_flash_cudnn" or {other, backend} == varlen
            for name in ONE_DOCUMENT_WORKLOADS if one_document else BACKEND_WORKLOADS:
                if not self.fits(name) or self.time_left() < self.reserve_s:
                    continue
                try:
                    # One probe step first: a backend that recompiles on every forward would
                    # eat the whole budget, so it is recorded and skipped instead.
                    _, doc_len, docs, tenants = by_name[name]
                    probe = self.datums(self.doc_len(doc_len), docs, tenants)
                    engine.forward_backward(probe, "cross_entropy")
                    self.sync()
                    t0 = time.perf_counter()
                    engine.forward_backward(probe, "cross_entropy")
                    self.sync()
                    if time.perf_counter() - t0 > 10.0:
                        raise RuntimeError(f"{other}: a warm step took {time.perf_counter() - t0:.1f}s")
                    run(*by_name[name], label=other)
                except Exception:
                    self.results.error(f"engine/{other}/{name}", traceback.format_exc())
                    self.log("!!", other, name, traceback.format_exc())
        swap(backend)

        # Where the host waits for the GPU during one step (each wait drains the launch queue).
        name, doc_len, docs, tenants = by_name[PROFILE_WORKLOAD]
        datums = self.datums(self.doc_len(doc_len), docs, tenants)
        self.sync_audit(lambda: engine.forward_backward(datums, "cross_entropy"), "base")

        # Profile of one step (after the warm runs above).
        self.profile(lambda: engine.forward_backward(datums, "cross_entropy"), "engine")
        # ... and of the same tokens for one tenant and for eight, eagerly: where the 8-tenant
        # step's extra time goes
        profile_tenants("engine")

        # Optimizer on the engine's own 8-slot pool (grads exist from the steps above).
        hp = AdamParams(learning_rate=1e-5)
        for count in (1, 8):
            slots = {s: hp for s in range(count)}
            times, _ = time_calls(functools.partial(engine.optim_step, slots), 1, 5, self.sync)
            row = {"pool_slots": 8, "stepped_slots": count, "ms": summarize(times)["median_s"] * 1e3}
            self.row("optimizer", row)

    def sync_audit(self, fn: Callable[[], Any], label: str) -> None:
        """Count host-device synchronisations of one call, by Python source line."""
        if not self.cuda:
            return
        import warnings

        fn()
        self.sync()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        where: dict[str, int] = {}
        for w in caught:
            if "synchroniz" in str(w.message):
                site = f"{w.filename}:{w.lineno}"
                where[site] = where.get(site, 0) + 1
        top = dict(sorted(where.items(), key=lambda kv: -kv[1])[:15])
        summary = {"syncs": sum(where.values()), "by_site": top}
        self.log("sync audit", label, json.dumps(summary, indent=1))
        self.results.put("sync_audit", label, summary)

    def host_cost(self, fn: Callable[[], Any], iters: int = 3) -> tuple[float, int, int]:
        """(median seconds until ``fn`` returns, with the device idle before each call; aten ops
        of one call; device kernels and copies of one call, 0 without CUDA)."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        host = []
        for _ in range(iters):
            self.sync()
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
        self.sync()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        with profile(activities=activities) as prof:
            fn()
            self.sync()
        ops = kernels = 0
        for event in prof.events():
            if getattr(event, "device_type", None) == DeviceType.CUDA:
                kernels += 1
            elif event.name.startswith("aten::"):
                ops += 1
        return sorted(host)[len(host) // 2], ops, kernels

    def profile(self, fn: Callable[[], Any], label: str) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        fn()
        self.sync()
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            fn()
            self.sync()
        wall = time.perf_counter() - t0
        averages = prof.key_averages()
        table = ""
        for key in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
            try:
                table = averages.table(sort_by=key, row_limit=45, max_name_column_width=90)
                break
            except Exception:
                continue
        from torch.autograd import DeviceType

        categories: dict[str, float] = {}
        kernel_us = 0.0
        for event in averages:
            # Kernels and copies only: an aten op's device time repeats its kernels' time.
            if getattr(event, "device_type", None) != DeviceType.CUDA:
                continue
            us = float(getattr(event, "self_device_time_total", 0.0) or 0.0)
            if us <= 0:
                continue
            kernel_us += us
            cat = _kernel_category(event.key)
            categories[cat] = categories.get(cat, 0.0) + us
        summary = {
            "profiled_wall_s": wall,
            "gpu_kernel_s": kernel_us / 1e6,
            "kernel_s_over_profiled_wall": kernel_us / 1e6 / wall if wall else None,
            "kernel_s_by_category": {
                k: v / 1e6 for k, v in sorted(categories.items(), key=lambda kv: -kv[1])
            },
            "ops_launched": sum(e.count for e in averages),
        }
        self.log("profile", label, json.dumps(summary, indent=1))
        self.results.put("profile", label, summary)
        (self.out / f"profile_{label}.txt").write_text(json.dumps(summary, indent=1) + "\n\n" + table)

    def optimizer64(self) -> None:
        from transformers import AutoConfig

        from services.trainer.convert import ModelShape
        from services.trainer.engine import AdamParams
        from services.trainer.optim import SlotAdamW
        from services.trainer.parallel import ensure_model_parallel

        ensure_model_parallel(self.device.type)  # the step's norm is all-reduced over TP (size 1)
        shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(str(self.model_dir)))
        slots = 64
        self.peak_reset()
        pool = stepped_pool(shape, slots, LORA_RANK, device=self.device.type)
        optimizer = SlotAdamW(rows=pool.rows)
        hp = AdamParams(learning_rate=1e-5)

        def step(count: int) -> None:  # one call for all slots, as TrainerEngine.optim_step makes
            optimizer.step_many([(s, pool.slot_tensors(s), hp) for s in range(count)])

        step(slots)  # allocates the moments
        self.sync()
        for count in (1, 8, slots):
            times, _ = time_calls(functools.partial(step, count), 1, 3 if count > 8 else 5, self.sync)
            host, ops, kernels = self.host_cost(functools.partial(step, count))
            row = {
                "pool_slots": slots,
                "stepped_slots": count,
                "ms": summarize(times)["median_s"] * 1e3,
                "host_ms": host * 1e3,  # until step_many returns (it syncs once, for the norms)
                "ops": ops,  # aten ops dispatched by one call
                "kernels": kernels,  # device kernels and copies launched by one call
            }
            self.row("optimizer", row)
        self.profile(functools.partial(step, 1), "optimizer")  # one slot's step, warm
        params = sum(p.numel() for p in pool.parameters())
        self.results.put(
            "optimizer",
            "pool64",
            {"params": params, "peak_gib": self.peak_gib(), "params_per_slot": params // slots},
        )

    def snapshot(self) -> None:
        """The trainer's internal snapshot (services/trainer/state/snapshots.py) of a 16-slot engine
        whose every slot holds state (adapter, moments, pending gradients): the capture (the
        only part on the unit path) and the background write, first of every slot, then twice
        after 4 of the 16 slots changed (only those are copied; the rest are linked). The host
        buffers are allocated in the background from each slot's init; how long they were still
        being allocated after the first training calls is ``buffers_ready_wait_s``."""
        import tempfile

        from libs.contracts.common import LoraConfig
        from services.trainer.engine import AdamParams
        from services.trainer.state import snapshots
        from services.trainer.state.paging import PageStore

        slots = 16 if not self.tiny else 4
        engine = self.build_engine("varlen_flash" if self.cuda else "sdpa_per_document", slots)
        for s in range(slots):
            engine.init_slot(s, LoraConfig(rank=LORA_RANK, seed=s))
        doc = self.doc_len(256)

        def train(which: list[int], optim: bool) -> None:
            datums = [dataclasses.replace(self.datums(doc, 1, 1, seed=s)[0], slot=s) for s in which]
            engine.forward_backward(datums, "cross_entropy")
            if optim:
                engine.optim_step({s: AdamParams(learning_rate=1e-5) for s in which})
                engine.forward_backward(datums, "cross_entropy")  # pending gradients too
            self.sync()

        started = time.perf_counter()
        train(list(range(slots)), optim=True)
        trained = time.perf_counter()
        engine.snapshot_buffers.ready()  # the slots' host buffers, allocated in the background since init
        self.results.put("snapshot", "train_s", trained - started)
        self.results.put("snapshot", "buffers_ready_wait_s", time.perf_counter() - trained)
        self.log("snapshot buffers ready", f"{time.perf_counter() - trained:.2f} s after the training calls")
        models = {s: f"model-{s}" for s in range(slots)}
        with tempfile.TemporaryDirectory(prefix="tinkerd-snap-") as tmp:
            data_dir = Path(tmp)
            store = PageStore(data_dir / "paged", 1 << 30)
            quarter = max(1, slots // 4)
            cases = (("all slots", slots), ("a quarter changed", quarter), ("a quarter changed, again", quarter))
            for work_seq, (label, changed) in enumerate(cases, start=1):
                if label != "all slots":
                    train(list(range(changed)), optim=True)
                t0 = time.perf_counter()
                captured = snapshots.capture(engine, models, store, data_dir, "bench", work_seq)
                self.sync()
                t1 = time.perf_counter()
                directory = snapshots.write(captured, data_dir, "bench")
                t2 = time.perf_counter()
                snapshots.finish(captured, directory, store, data_dir, "bench")
                row = {
                    "snapshot": label,
                    "slots": slots,
                    "copied_slots": len(captured.slots),
                    "copied_gb": captured.nbytes / 1e9,
                    "capture_s": t1 - t0,
                    "write_s": t2 - t1,
                }
                self.row("snapshot", row)

    def liger(self) -> None:
        if not self.cuda:
            self.log("liger: skipped (its kernels are Triton, CUDA only)")
            self.results.put("liger", "skipped", "needs CUDA")
            return
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3

        apply_liger_kernel_to_qwen3(
            rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True
        )
        import liger_kernel

        self.results.put("liger", "version", getattr(liger_kernel, "__version__", "?"))
        self.hf(liger=True)

    def hf(self, liger: bool = False) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoConfig, AutoModelForCausalLM

        table = "liger" if liger else "hf"
        label = "hf+peft+liger" if liger else "hf+peft sdpa"

        cfg = AutoConfig.from_pretrained(str(self.model_dir))
        self.peak_reset()
        t0 = time.perf_counter()
        with torch.device(self.device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=self.dtype, attn_implementation="sdpa")
        model.requires_grad_(False)
        lora = LoraConfig(
            r=LORA_RANK,
            lora_alpha=32,
            lora_dropout=0.0,
            bias="none",
            target_modules=[
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
                *([] if liger else ["lm_head"]),
            ],
        )
        model = get_peft_model(model, lora)
        model.train()
        self.sync()
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        adapter_dtypes = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
        self.log(f"{label} built in {time.perf_counter() - t0:.1f}s, trainable {trainable}, {adapter_dtypes}")
        self.results.put(
            table,
            "build",
            {"trainable": trainable, "adapter_dtypes": adapter_dtypes, "peak_gib": self.peak_gib()},
        )
        by_name = {w[0]: w for w in ENGINE_WORKLOADS}
        profile_batch = None
        for name in HF_WORKLOADS:
            if not self.fits(name):
                continue
            if self.time_left() < 60:
                self.log("skipping hf", name, "(deadline)")
                continue
            _, doc_len, docs, _ = by_name[name]
            n = self.doc_len(doc_len)
            rng = np.random.default_rng(0)
            ids = torch.from_numpy(rng.integers(0, self.shape.vocab, (docs, n))).to(self.device)

            def step(ids: torch.Tensor = ids) -> float:
                out = model(input_ids=ids, labels=ids)
                out.loss.backward()
                return float(out.loss.detach())

            m = self.attempt(f"{table}/{name}", functools.partial(self.measure, step, [n] * docs))
            if m is None:
                model.zero_grad(set_to_none=True)
                continue
            if name == PROFILE_WORKLOAD:
                profile_batch = step
            m.update(
                workload=name,
                backend=label,
                tenants=1,
                loss_finite=bool(np.isfinite(m.pop("result"))),
            )
            self.row(table, m)
        if profile_batch is not None and self.time_left() > 30:
            self.profile(profile_batch, table)
        self.release()

    def summary(self) -> None:
        rows = self.tables
        engine = rows.get("engine", [])
        hf = {r["workload"]: r for r in rows.get("hf", [])}
        lg = {r["workload"]: r for r in rows.get("liger", [])}
        main = (
            [
                r
                for r in engine
                if r["backend"] == engine[0]["backend"]  # the engine's default backend: its first rows
            ]
            if engine
            else []
        )
        table = []
        for r in main:
            h = hf.get(r["workload"]) if r["tenants"] == 1 else None
            g = lg.get(r["workload"]) if r["tenants"] == 1 else None
            table.append(
                {
                    "workload": r["workload"],
                    "tokens": r["tokens"],
                    "ms": r["median_s"] * 1e3,
                    "tok_s": r["tokens_per_s"],
                    "mfu": 100 * r["mfu"],
                    "peak": r["peak_gib"],
                    "hf_tok_s": h["tokens_per_s"] if h else None,
                    "hf_mfu": 100 * h["mfu"] if h else None,
                    "hf_peak": h["peak_gib"] if h else None,
                    "speedup": r["tokens_per_s"] / h["tokens_per_s"] if h else None,
                    "liger_tok_s": g["tokens_per_s"] if g else None,
                    "liger_peak": g["peak_gib"] if g else None,
                    "x_liger": r["tokens_per_s"] / g["tokens_per_s"] if g else None,
                }
            )
        parts = [
            "## Engine (" + (engine[0]["backend"] if engine else "?") + ") vs HF+PEFT and HF+PEFT+Liger\n",
            markdown_table(
                table,
                [
                    ("workload", "workload"),
                    ("tokens", "tokens"),
                    ("engine ms", "ms"),
                    ("engine tok/s", "tok_s"),
                    ("engine MFU %", "mfu"),
                    ("engine peak GiB", "peak"),
                    ("HF+PEFT tok/s", "hf_tok_s"),
                    ("HF+PEFT MFU %", "hf_mfu"),
                    ("HF peak GiB", "hf_peak"),
                    ("speedup", "speedup"),
                    ("HF+PEFT+Liger tok/s", "liger_tok_s"),
                    ("Liger peak GiB", "liger_peak"),
                    ("engine / Liger", "x_liger"),
                ],
            ),
        ]
        alt = [r for r in engine if r not in main]
        if alt:
            parts += [
                "\n## Other attention backends (and the unfused cross-entropy) in the engine\n",
                markdown_table(
                    [dict(r, ms=r["median_s"] * 1e3, mfu_pct=100 * r["mfu"]) for r in alt],
                    [
                        ("backend", "backend"),
                        ("workload", "workload"),
                        ("ms", "ms"),
                        ("tok/s", "tokens_per_s"),
                        ("MFU %", "mfu_pct"),
                        ("peak GiB", "peak_gib"),
                    ],
                ),
            ]
        paths = {
            label: {r["workload"]: r for r in engine if r["backend"] == label}
            for label in dict.fromkeys(r["backend"] for r in engine)
        }
        default = main[0]["backend"] if main else None
        loss_rows = []
        for workload, r in paths.get(default, {}).items():
            row = {"workload": workload, "default": r["median_s"] * 1e3, "default_peak": r["peak_gib"]}
            for path in CE_PATHS:
                other = paths.get(f"{default} {path}", {}).get(workload)
                row[path] = other["median_s"] * 1e3 if other else None
                row[f"{path} peak"] = other["peak_gib"] if other else None
            times = {p: row[p] for p in CE_PATHS if row[p] is not None}
            row["fastest"] = min(times, key=lambda k: times[k]) if times else None
            loss_rows.append(row)
        if any(r["unfused-ce"] is not None for r in loss_rows):
            self.results.put("engine", "loss_paths", loss_rows)
            parts += [
                f"\n## The loss path of each workload ({default})\n",
                markdown_table(
                    loss_rows,
                    [
                        ("workload", "workload"),
                        ("default ms", "default"),
                        ("fused ms", "fused-ce"),
                        ("unfused ms", "unfused-ce"),
                        ("fused peak GiB", "fused-ce peak"),
                        ("unfused peak GiB", "unfused-ce peak"),
                        ("fastest forced path", "fastest"),
                    ],
                ),
            ]
        for label, by in paths.items():
            for multi, single in (("16x256 8 tenants", "16x256"), ("8x1024 8 tenants", "8x1024")):
                if multi in by and single in by:
                    ratio = by[multi]["tokens_per_s"] / by[single]["tokens_per_s"]
                    self.results.put("targets", f"tenant_ratio {label} {multi}", ratio)
                    parts.append(f"\n8 tenants / 1 tenant ({label}), {single}: {ratio:.3f}")
        if rows.get("attention_speed"):
            parts += [
                "\n## Attention op alone (fwd+bwd, one layer)\n",
                markdown_table(
                    rows["attention_speed"],
                    [("layout", "layout"), ("backend", "backend"), ("ms", "ms"), ("TFLOP/s", "tflops")],
                ),
            ]
        if rows.get("optimizer"):
            parts += [
                "\n## optim_step\n",
                markdown_table(
                    rows["optimizer"],
                    [
                        ("pool slots", "pool_slots"),
                        ("slots stepped", "stepped_slots"),
                        ("ms", "ms"),
                        ("host ms", "host_ms"),
                        ("aten ops", "ops"),
                        ("kernels", "kernels"),
                    ],
                ),
            ]
        text = "\n".join(parts) + "\n"
        (self.out / "summary.md").write_text(text)
        print(text, flush=True)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x64, r64 = x.detach().double(), ref.detach().double()
    if not torch.isfinite(x64).all():
        return float("nan")
    return float(torch.linalg.vector_norm(x64 - r64) / torch.linalg.vector_norm(r64))


_CATEGORIES = [
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|wgmma|sm90_", re.I)),
    ("attention", re.compile(r"flash|fmha|attn|flex", re.I)),
    ("cross_entropy/softmax", re.compile(r"softmax|log_softmax|nll|cross_entropy|logsumexp", re.I)),
    ("norm", re.compile(r"norm", re.I)),
    ("copy/cast", re.compile(r"copy|cast|contiguous|cat|pad|index|gather|scatter", re.I)),
    ("reduce", re.compile(r"reduce", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|silu|mul|add|fill", re.I)),
]


def _kernel_category(name: str) -> str:
    for label, pattern in _CATEGORIES:
        if pattern.search(name):
            return label
    return "other"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--tiny", action="store_true", help="tiny model and lengths (CPU smoke test)")
    parser.add_argument("--cpu", action="store_true", help="stay on the CPU even if CUDA is present")
    parser.add_argument("--sections", default="env,attention,engine,optimizer,hf,liger")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--deadline", type=float, default=540.0, help="seconds; later work is skipped")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="skip workloads of more tokens (a card of less memory)"
    )
    parser.add_argument("--min-tokens", type=int, default=None, help="skip workloads of fewer tokens")
    parser.add_argument(
        "--step-graph-max-tokens",
        type=int,
        default=None,
        help="the engine's step_graph_max_tokens (default: the engine's own, TINKERD_TRAINER_STEP_GRAPH_MAX_TOKENS)",
    )
    parser.add_argument(
        "--no-variants",
        dest="variants",
        action="store_false",
        help="engine: the default rows and their eager twins only (no separate-base, forced loss-path or "
        "other-attention rows), leaving the deadline to more steps per row and the baselines",
    )
    args = parser.parse_args(argv)
    bench = Bench(args)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    wanted = args.sections.split(",")
    for name in ("env", "attention", "engine", "optimizer", "snapshot", "hf", "liger"):
        if name not in wanted:
            continue
        with bench.section(name):
            {
                "env": bench.env,
                "attention": bench.attention,
                "engine": bench.engine,
                "optimizer": bench.optimizer64,
                "snapshot": bench.snapshot,
                "hf": bench.hf,
                "liger": bench.liger,
            }[name]()
    with bench.section("summary"):
        bench.summary()
    bench.log("done; errors:", len(bench.results.data["errors"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
