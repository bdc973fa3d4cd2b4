"""The whole stack on one GPU: SDK -> gateway -> planner -> CUDA trainer -> publisher
-> CUDA sampler, measured end to end, with the engines' own numbers beside it.

One process runs these sections in order, each isolated (an error is recorded, the next runs):

    model    an 8B-shaped Qwen3 (hidden 4096, 36 layers, GQA 32/8, vocab 151936) with random bf16
             weights, written in Hugging Face format (sharded safetensors) with the project's
             byte-level BPE tokenizer (libs/models/tiny.py; ids above its 2,048 decode to "")
    engine   TrainerEngine.forward_backward in this process on the workloads the SDK sends
             (1, 4 and 8 tenants), and optim_step: the engine's own speed
    sampler  the static-cache sampler engine in this process: tokens/s at batch 1, 8 and 64 with
             1 and 8 rank-32 adapters; Hugging Face generate + PEFT on the same GPU; logprobs of
             the sampler (bf16) and of an HF bf16 forward, each against an fp32 forward
    stack    nats-server + every service (tests.harness.Stack: the supervisor `tinkerd up` uses),
             trainer and sampler on CUDA, driven by the official tinker SDK: forward_backward
             tokens/s for the same workloads, per-call overhead, save_weights_for_sampler -> first
             sample, the ephemeral save (handed over from memory) -> first sample and its parity
             with a named save, save_state, SDK sampling throughput, sampler-vs-trainer logprobs
    rl       tinker-cookbook's rl.train (arithmetic environment) for several tenants at once

Outputs under ``--out``: results.json (every number), summary.md (tables), log via tee.

    python -m bench.gpu_stack --out DIR                 # the H200 run (docs/gpu.md)
    python -m bench.gpu_stack --out DIR --tiny          # CPU smoke test of every section
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import sys
import tempfile
import threading
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
    QWEN3_8B,
    BenchRun,
    Shape,
    lora_modules,
    markdown_table,
    shaped_model_dir,
    time_calls,
)
from tinkerd.launcher import launch_mode  # noqa: E402

RANK = 32
MODEL_NAME = "qwen3-8b-random"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
TINY_SHAPE = Shape(hidden=64, layers=2, heads=4, groups=2, head_dim=16, ffn=128, vocab=2048)

# (name, tenants, documents per tenant, document length): the batches both the SDK and the
# engine run. Each tenant is one training client (one adapter slot).
FB_WORKLOADS = [
    ("1 tenant 1x1024", 1, 1, 1024),
    ("1 tenant 4x1024", 1, 4, 1024),
    ("1 tenant 1x8192", 1, 1, 8192),
    ("4 tenants 1x1024", 4, 1, 1024),
    ("8 tenants 1x1024", 8, 1, 1024),
    ("8 tenants 2x512", 8, 2, 512),
]
SAMPLE_BATCHES = [1, 8, 64]
PROMPT_LEN, NEW_TOKENS = 128, 128
HF_NEW_TOKENS = 32  # HF generate is host-bound at a constant time per step: 32 steps measure it


class Bench(BenchRun):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tiny = args.tiny
        super().__init__(Path(args.out), args.deadline, torch.cuda.is_available() and not args.tiny)
        self.results.put("env", "launch", launch_mode(dict(os.environ)))  # how the stack's services start
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.shape = TINY_SHAPE if self.tiny else QWEN3_8B
        self.work = Path(args.work or tempfile.mkdtemp(prefix="gpu-stack-"))
        self.data_dir = self.work / "data"
        self.model_dir = self.data_dir / "models" / MODEL_NAME
        self.engine_fb: dict[str, float] = {}
        self.workloads = [
            name
            for name, tenants, docs, length in FB_WORKLOADS
            if args.max_tokens is None or tenants * docs * length <= args.max_tokens
        ]

    def n(self, length: int) -> int:
        """Document length: as given on the GPU, 1/32 of it (at least 8) in --tiny."""
        return max(8, length // 32) if self.tiny else length

    def tokens(self, seed: int, count: int) -> list[int]:
        rng = np.random.default_rng(seed)
        return [int(t) for t in rng.integers(16, self.shape.vocab, count)]

    # ---- model ----

    def model(self) -> None:
        from safetensors.torch import save_file
        from transformers import AutoConfig, AutoModelForCausalLM

        if (self.model_dir / "config.json").is_file():
            self.log("model exists:", self.model_dir)
            return
        t0 = time.perf_counter()
        tmp = self.model_dir.with_name(".building")
        shutil.rmtree(tmp, ignore_errors=True)
        dtype_name = "bfloat16" if self.cuda else "float32"
        shaped_model_dir(tmp, self.shape, dtype_name, MODEL_NAME, self.work / "tiny-tokenizer")
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp))
        gen = torch.Generator(device=self.device).manual_seed(0)
        shard: dict[str, torch.Tensor] = {}
        index: dict[str, str] = {}
        size, part, limit = 0, 0, 4 << 30

        def flush() -> None:
            nonlocal shard, size, part
            if not shard:
                return
            part += 1
            name = f"model-{part:05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            index.update(dict.fromkeys(shard, name))
            shard, size = {}, 0

        for name, meta in skeleton.state_dict().items():
            if name.endswith("norm.weight"):
                value = torch.ones(meta.shape, dtype=self.dtype, device=self.device)
            else:
                value = torch.randn(meta.shape, generator=gen, device=self.device, dtype=torch.float32)
                value = (value * 0.02).to(self.dtype)
            shard[name] = value.cpu()
            size += value.numel() * value.element_size()
            if size >= limit:
                flush()
        flush()
        total = sum(p.stat().st_size for p in tmp.glob("*.safetensors"))
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1)
        )
        os.replace(tmp, self.model_dir)
        self.results.put("model", "build_s", time.perf_counter() - t0)
        self.results.put("model", "bytes", total)
        self.log(f"model written in {time.perf_counter() - t0:.1f}s, {total / 2**30:.1f} GiB")

    # ---- the trainer engine alone ----

    def fb_datums(self, name: str) -> list[tuple[int, list[int]]]:
        """(tenant, tokens incl. the last target) of workload ``name``; the same for SDK and engine."""
        _, tenants, docs, length = next(w for w in FB_WORKLOADS if w[0] == name)
        out = []
        for tenant in range(tenants):
            for doc in range(docs):
                out.append((tenant, self.tokens(1000 * tenant + doc, self.n(length) + 1)))
        return out

    def engine(self) -> None:
        import services.trainer.model as model_mod
        from services.trainer.engine import DatumInput, EngineConfig, LoraConfig, TrainerEngine
        from services.trainer.optim import AdamParams
        from services.trainer.parallel import ensure_model_parallel

        def random_weights(model: Any, model_dir: Any, shape: Any) -> None:
            with torch.no_grad():
                for pname, param in model.named_parameters():
                    param.fill_(1.0) if "norm" in pname else param.normal_(0.0, 0.02)

        ensure_model_parallel(self.device.type)
        original = model_mod.load_hf_weights
        model_mod.load_hf_weights = random_weights  # type: ignore[assignment]
        try:
            t0 = time.perf_counter()
            engine = TrainerEngine(
                EngineConfig(str(self.model_dir), num_slots=16, max_lora_rank=RANK, device=self.device.type)
            )
        finally:
            model_mod.load_hf_weights = original
        self.log(f"engine built in {time.perf_counter() - t0:.1f}s")
        for slot in range(8):
            engine.init_slot(slot, LoraConfig(rank=RANK, seed=slot))
        iters = 2 if self.tiny else 5

        def measure(engine: TrainerEngine, datums: list[Any]) -> float:
            step = functools.partial(engine.forward_backward, datums, "cross_entropy")
            times, _ = time_calls(step, 1, iters, self.sync)
            return float(np.median(times))

        for name in self.workloads:  # each on its own: one the card cannot hold leaves the others
            datums = [
                DatumInput(
                    tenant,
                    np.asarray(seq[:-1]),
                    {"target_tokens": np.asarray(seq[1:]), "weights": np.ones(len(seq) - 1, np.float32)},
                )
                for tenant, seq in self.fb_datums(name)
            ]
            tokens = sum(len(d.tokens) for d in datums)
            median = self.attempt(f"engine_fb/{name}", functools.partial(measure, engine, datums))
            if median is None:
                for slot in range(8):
                    engine.discard_grads(slot)
                continue
            self.engine_fb[name] = median
            self.row(
                "engine_fb",
                {"workload": name, "tokens": tokens, "ms": median * 1e3, "tok_s": tokens / median},
            )
        hp = AdamParams(learning_rate=1e-5)
        for count in (1, 4, 8):
            slots = {s: hp for s in range(count)}
            engine.optim_step(slots)
            times = []
            for _ in range(iters):
                self.sync()
                t = time.perf_counter()
                engine.optim_step(slots)
                self.sync()
                times.append(time.perf_counter() - t)
            self.row("engine_optim", {"slots": count, "ms": float(np.median(times)) * 1e3})
        del engine

    # ---- the sampler engine alone ----

    def adapter_dirs(self, count: int) -> list[Path]:
        """``count`` random rank-32 PEFT adapters on every target (lm_head too), bf16 files."""
        from safetensors.torch import save_file

        root = self.work / "adapters"
        out = []
        for i in range(count):
            path = root / f"a{i}"
            out.append(path)
            if (path / "adapter_model.safetensors").is_file():
                continue
            path.mkdir(parents=True, exist_ok=True)
            gen = torch.Generator(device=self.device).manual_seed(100 + i)
            tensors: dict[str, torch.Tensor] = {}
            for module, (fan_in, fan_out) in lora_modules(self.shape).items():
                a = torch.randn(RANK, fan_in, generator=gen, device=self.device) / fan_in**0.5
                b = torch.randn(fan_out, RANK, generator=gen, device=self.device) * 0.01
                tensors[f"base_model.model.{module}.lora_A.weight"] = a.to(self.dtype).cpu()
                tensors[f"base_model.model.{module}.lora_B.weight"] = b.to(self.dtype).cpu()
            save_file(tensors, str(path / "adapter_model.safetensors"))
            (path / "adapter_config.json").write_text(
                json.dumps(
                    {
                        "peft_type": "LORA",
                        "task_type": "CAUSAL_LM",
                        "r": RANK,
                        "lora_alpha": RANK,
                        "lora_dropout": 0.0,
                        "bias": "none",
                        "target_modules": TARGETS,
                        "base_model_name_or_path": str(self.model_dir),
                    }
                )
            )
        return out

    def sampler(self) -> None:
        adapters = self.adapter_dirs(8)
        parity, prompt_len = self.sampler_engine(adapters)
        self.release()
        self.hf_sampling(adapters, parity, prompt_len)

    def sampler_engine(self, adapters: list[Path]) -> tuple[list[Any], int]:
        from services.sampler.config import SamplerConfig
        from services.sampler.interface import SequenceRequest
        from services.sampler.static_engine import StaticCacheEngine

        t0 = time.perf_counter()
        engine = StaticCacheEngine(
            SamplerConfig(
                model_path=str(self.model_dir),
                device=self.device.type,
                engine="static",
                max_batch_size=64,
                max_loaded_loras=8,
                max_lora_rank=RANK,
                context_length=1024 if not self.tiny else 512,
            )
        )
        self.log(f"sampler engine built in {time.perf_counter() - t0:.1f}s")
        loop = asyncio.new_event_loop()
        try:
            for i, path in enumerate(adapters):
                loop.run_until_complete(engine.load_adapter(f"a{i}", str(path)))
            prompt_len, new = (PROMPT_LEN, NEW_TOKENS) if not self.tiny else (16, 8)

            def requests(batch: int, n_adapters: int, seed: int, new_tokens: int) -> list[SequenceRequest]:
                return [
                    SequenceRequest(
                        input_ids=self.tokens(seed + j, prompt_len),
                        max_new_tokens=new_tokens,
                        temperature=0.0,
                        ignore_eos=True,
                        lora_name=f"a{j % n_adapters}",
                    )
                    for j in range(batch)
                ]

            def timed(reqs: list[SequenceRequest]) -> tuple[float, list[Any]]:
                t = time.perf_counter()
                res = loop.run_until_complete(engine.generate(reqs))
                return time.perf_counter() - t, res

            for batch in SAMPLE_BATCHES:
                for n_adapters in (1, 8):
                    if n_adapters > batch:
                        continue
                    timed(requests(batch, n_adapters, 5, new))  # warm-up: captures the graphs
                    before = engine.counters().decode_steps
                    wall, res = timed(requests(batch, n_adapters, 7, new))
                    steps = engine.counters().decode_steps - before
                    produced = sum(len(r.output_ids) for r in res)
                    self.row(
                        "sampler_engine",
                        {
                            "batch": batch,
                            "adapters": n_adapters,
                            "wall_s": wall,
                            "tok_s": produced / wall,
                            "ms_per_step": wall / max(steps, 1) * 1e3,
                            "steps": steps,
                        },
                    )
            self.results.put("sampler", "graphs_captured", engine.graphs_captured)
            # Logprob agreement: the sampler's greedy outputs, later scored by HF in bf16 and fp32.
            probes = []
            for j in range(4):
                req = SequenceRequest(
                    input_ids=self.tokens(900 + j, prompt_len),
                    max_new_tokens=64 if not self.tiny else 8,
                    temperature=0.0,
                    ignore_eos=True,
                    lora_name=f"a{j % 2}",
                )
                probes.append(req)
            outs = loop.run_until_complete(engine.generate(probes))
            parity = [
                (req.lora_name, req.input_ids, out.output_ids, out.output_logprobs)
                for req, out in zip(probes, outs, strict=True)
            ]
        finally:
            engine.close()
            loop.close()
        return parity, prompt_len

    def hf_sampling(self, adapters: list[Path], parity: list[Any], prompt_len: int) -> None:
        """HF generate + PEFT speed on the same GPU, then the logprob floor against fp32."""
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        kwargs: dict[str, Any] = {"device_map": "cuda"} if self.cuda else {}
        base = AutoModelForCausalLM.from_pretrained(
            str(self.model_dir), dtype=self.dtype, attn_implementation="sdpa", local_files_only=True, **kwargs
        )
        model = PeftModel.from_pretrained(base, str(adapters[0]), adapter_name="a0")
        model.load_adapter(str(adapters[1]), adapter_name="a1")
        model.eval()
        new = HF_NEW_TOKENS if not self.tiny else 4
        for batch in SAMPLE_BATCHES:
            if self.time_left() < 150:
                self.log("skipping hf generate", batch, "(deadline)")
                continue
            ids = torch.tensor([self.tokens(7 + j, prompt_len) for j in range(batch)], device=self.device)
            gen_kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            with torch.inference_mode():
                model.generate(input_ids=ids, **gen_kwargs)  # warm-up
                self.sync()
                t = time.perf_counter()
                model.generate(input_ids=ids, **gen_kwargs)
                self.sync()
                wall = time.perf_counter() - t
            self.row(
                "hf_generate",
                {
                    "batch": batch,
                    "new_tokens": new,
                    "wall_s": wall,
                    "tok_s": batch * new / wall,
                    "ms_per_step": wall / new * 1e3,
                },
            )
        # Logprobs of the sampler's tokens: HF bf16 forward and HF fp32 forward (same weights).
        scored: dict[str, list[np.ndarray]] = {"bf16": [], "fp32": []}
        for label in ("bf16", "fp32"):
            if label == "fp32":
                model = model.float()
                torch.backends.cuda.matmul.allow_tf32 = False
            with torch.inference_mode():
                for name, prompt, output, _ in parity:
                    model.set_adapter(name)
                    seq = torch.tensor([prompt + output], device=self.device)
                    logits = model(input_ids=seq).logits[0].float()
                    lp = torch.log_softmax(logits, dim=-1)
                    pos = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1, device=self.device)
                    scored[label].append(lp[pos, torch.tensor(output, device=self.device)].cpu().numpy())
        sampler = [np.asarray(p[3], dtype=np.float64) for p in parity]

        def diff(a: list[np.ndarray], b: list[np.ndarray]) -> dict[str, float]:
            d = np.concatenate([np.abs(x - y) for x, y in zip(a, b, strict=True)])
            return {
                "mean_abs": float(d.mean()),
                "p99_abs": float(np.percentile(d, 99)),
                "max_abs": float(d.max()),
                "n": int(d.size),
            }

        self.results.put("logprobs", "sampler_vs_fp32", diff(sampler, scored["fp32"]))
        self.results.put("logprobs", "hf_bf16_vs_fp32", diff(scored["bf16"], scored["fp32"]))
        self.results.put("logprobs", "sampler_vs_hf_bf16", diff(sampler, scored["bf16"]))
        self.results.put("logprobs", "mean_logprob_fp32", float(np.concatenate(scored["fp32"]).mean()))
        self.log("logprobs", self.results.data["sections"]["logprobs"])
        del model, base

    # ---- the stack through the SDK ----

    def stack_env(self) -> dict[str, str]:
        env = {
            "TINKERD_BASE_MODEL": str(self.model_dir),
            "TINKERD_SAMPLER_MODEL_PATH": str(self.model_dir),
            "TINKERD_NUM_SLOTS": str(self.args.slots),
            "TINKERD_MAX_LORA_RANK": str(RANK),
            "TINKERD_SAMPLER_MAX_BATCH_SIZE": "64",
            "TINKERD_SAMPLER_MAX_LOADED_LORAS": "8",
            "TINKERD_GATEWAY_MAX_LOADED_ADAPTERS": "8",
            "TINKERD_SAMPLER_CONTEXT_LENGTH": "2048" if not self.tiny else "512",
            "TINKERD_GATEWAY_SAMPLING_CAPACITY": "100000",
            "TINKERD_TRACE_EXPORTER": "none",
            "TINKERD_LIVENESS_TIMEOUT_S": "600",
        }
        if self.cuda:
            env |= {"TINKERD_TRAINER_DEVICE": "cuda", "TINKERD_SAMPLER_DEVICE": "cuda"}
        else:
            env |= {"TINKERD_TRAINER_DEVICE": "cpu", "TINKERD_SAMPLER_ENGINE": "static"}
        return env

    def stack(self) -> None:
        import tinker
        from tinker import types

        from bench.common import sft_datum
        from tests.harness import Stack

        os.environ.setdefault("TINKER_TELEMETRY", "0")
        t0 = time.perf_counter()
        shutil.rmtree(self.work / "stack", ignore_errors=True)  # a fresh deployment every run
        stack = Stack(self.work / "stack", env_overrides=self.stack_env())
        stack.data_dir.mkdir(parents=True, exist_ok=True)
        models = stack.data_dir / "models"
        models.mkdir(exist_ok=True)
        try:
            stack.start()
            self.results.put("stack", "start_s", time.perf_counter() - t0)
            self.log(f"stack ready in {time.perf_counter() - t0:.1f}s")
            base = str(self.model_dir)
            services = [
                tinker.ServiceClient(base_url=stack.base_url, api_key=f"tml-gpu-tenant-{i}") for i in range(8)
            ]
            clients = [s.create_lora_training_client(base_model=base, rank=RANK).result() for s in services]
            adam = types.AdamParams(learning_rate=1e-5)

            # forward_backward tokens/s through the SDK, same batches as the engine section; each
            # workload on its own (one the trainer cannot hold beside the sampler leaves the rest).
            for name in self.workloads:
                per_tenant: dict[int, list[Any]] = {}
                for tenant, seq in self.fb_datums(name):
                    per_tenant.setdefault(tenant, []).append(sft_datum(seq))
                tokens = sum(len(seq) - 1 for _, seq in self.fb_datums(name))

                def once(per_tenant: dict[int, list[Any]] = per_tenant) -> float:
                    t = time.perf_counter()
                    futures = [clients[k].forward_backward(d, "cross_entropy") for k, d in per_tenant.items()]
                    for f in futures:
                        f.result()
                    return time.perf_counter() - t

                def timed(once: Callable[[], float] = once) -> tuple[list[float], float]:
                    once()
                    units_before = self.unit_count(stack)
                    times = [once() for _ in range(2 if self.tiny else 4)]
                    return times, (self.unit_count(stack) - units_before) / len(times)

                measured = self.attempt(f"sdk_fb/{name}", timed)
                if measured is None:
                    continue
                times, units = measured
                median = float(np.median(times))
                engine = self.engine_fb.get(name)
                self.row(
                    "sdk_fb",
                    {
                        "workload": name,
                        "tokens": tokens,
                        "sdk_ms": median * 1e3,
                        "sdk_tok_s": tokens / median,
                        "engine_ms": engine * 1e3 if engine else None,
                        "engine_tok_s": tokens / engine if engine else None,
                        "ratio": engine / median if engine else None,
                        "trainer_units_per_call": units,
                    },
                )
            # Per-call overhead at this shape: SDK round trip minus the trainer's execute (its failure
            # is recorded and does not stop the measurements after it).
            try:
                self.overhead(stack, clients[0], adam)
            except Exception:
                self.results.error("overhead", traceback.format_exc())

            # save_weights_for_sampler -> first sample; save_state.
            prompt = types.ModelInput.from_ints(self.tokens(77, 16))
            one = types.SamplingParams(max_tokens=1, temperature=0.0)
            for k in range(3):
                t = time.perf_counter()
                path = clients[0].save_weights_for_sampler(f"s{k}").result().path
                saved = time.perf_counter() - t
                sc = services[0].create_sampling_client(model_path=path)
                sc.sample(prompt=prompt, num_samples=1, sampling_params=one).result()
                total = time.perf_counter() - t
                self.row(
                    "save_to_sample",
                    {"try": k, "save_s": saved, "first_sample_s": total - saved, "total_s": total},
                )
            # save_weights_and_get_sampling_client() (ephemeral: handed over from the trainer's
            # memory) -> first sample; then the handover's parity with a named save of the same state.
            for k in range(5):
                t = time.perf_counter()
                ephemeral = clients[0].save_weights_and_get_sampling_client().result()
                saved = time.perf_counter() - t
                ephemeral.sample(prompt=prompt, num_samples=1, sampling_params=one).result()
                total = time.perf_counter() - t
                self.row(
                    "ephemeral_to_sample",
                    {"try": k, "save_s": saved, "first_sample_s": total - saved, "total_s": total},
                )
            self.handover_parity(services[0], clients[0], ephemeral, types)
            for k in range(3):
                t = time.perf_counter()
                clients[0].save_state(f"state{k}").result()
                self.row("save_state", {"try": k, "s": time.perf_counter() - t})

            # SDK sampling throughput: 1 adapter x batch, and 8 adapters at once.
            samplers = [
                c.save_weights_and_get_sampling_client(f"bench{i}").result() for i, c in enumerate(clients)
            ]
            prompt_len, new = (PROMPT_LEN, NEW_TOKENS) if not self.tiny else (16, 8)
            params = types.SamplingParams(max_tokens=new, temperature=0.0)
            for batch in SAMPLE_BATCHES:
                for n_adapters in (1, 8):
                    if n_adapters > batch:
                        continue

                    def sample_once(batch: int = batch, n_adapters: int = n_adapters) -> tuple[float, int]:
                        per = batch // n_adapters
                        t = time.perf_counter()
                        futures = [
                            samplers[i].sample(
                                prompt=types.ModelInput.from_ints(self.tokens(300 + i, prompt_len)),
                                num_samples=per,
                                sampling_params=params,
                            )
                            for i in range(n_adapters)
                        ]
                        produced = sum(len(s.tokens) for f in futures for s in f.result().sequences)
                        return time.perf_counter() - t, produced

                    sample_once()
                    wall, produced = sample_once()
                    self.row(
                        "sdk_sample",
                        {
                            "batch": batch,
                            "adapters": n_adapters,
                            "wall_s": wall,
                            "tok_s": produced / wall,
                            "tokens": produced,
                        },
                    )
            # Sampler vs trainer logprobs through the SDK (temperature 1 samples, trainer forward).
            self.sdk_logprobs(clients[1], samplers[1], types, sft_datum)
            if "rl" in self.args.sections.split(",") and self.time_left() > 120:
                with self.section("rl"):
                    self.rl(stack)
            self.diagnostics(stack)
        finally:
            (self.out / "stack_logs.txt").write_text(stack.dump_logs())
            stack.stop()

    def unit_count(self, stack: Any) -> int:
        """Trainer units finished so far (the ``unit_done`` operation events)."""
        from bench.common import event_tag, events

        return sum(event_tag(e) == "unit_done" for e in events(stack.nats_url))

    def diagnostics(self, stack: Any) -> None:
        """Where long waits came from: the longest units, the gaps between units, the snapshots."""
        from bench.common import event_tag, events

        evs = events(stack.nats_url)
        done = sorted((e for e in evs if event_tag(e) == "unit_done"), key=lambda e: e.at_ns)
        started = sorted((e for e in evs if event_tag(e) == "started"), key=lambda e: e.at_ns)
        longest = sorted(done, key=lambda e: -e.duration_ms)[:8]
        self.results.put(
            "diagnostics", "longest_units_ms", [(e.unit_id, e.duration_ms, e.at_ns / 1e9) for e in longest]
        )
        starts = [e.at_ns / 1e9 for e in started]
        ends = [e.at_ns / 1e9 for e in done]
        idle = sorted(((b - a, a) for a, b in zip(ends, starts[1:], strict=False) if b > a), reverse=True)[:8]
        self.results.put("diagnostics", "longest_idle_between_units_s", idle)
        snaps = []
        for d in sorted(stack.data_dir.rglob("slots.json")):
            folder = d.parent
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            snaps.append((str(folder.relative_to(stack.data_dir)), size, folder.stat().st_mtime))
        self.results.put("diagnostics", "snapshots", snaps)
        self.log("diagnostics", self.results.data["sections"]["diagnostics"])

    def overhead(self, stack: Any, client: Any, adam: Any) -> None:
        from bench.common import sft_datum
        from bench.gateway_overhead import Call, HttpLog, overhead_rows

        datum = sft_datum(self.tokens(5, self.n(1024) + 1))
        calls: list[Call] = []
        with HttpLog() as http:
            for i in range(6 if not self.tiny else 3):
                for kind, call in (
                    ("forward_backward", lambda: client.forward_backward([datum], "cross_entropy")),
                    ("optim_step", lambda: client.optim_step(adam)),
                ):
                    start = time.time_ns()
                    call().result()
                    calls.append(Call(kind, start, time.time_ns(), warmup=i == 0))
        summary, stages = overhead_rows("gpu", stack.nats_url, client.model_id, calls, http)
        self.results.put("overhead", "summary", summary)
        self.results.put("overhead", "stages", stages)
        for row in summary:
            self.row("overhead", row)

    def sdk_logprobs(
        self, client: Any, sampler: Any, types: Any, sft_datum: Callable[[list[int]], Any]
    ) -> None:
        prompt_ids = self.tokens(4242, 64 if not self.tiny else 8)
        params = types.SamplingParams(max_tokens=64 if not self.tiny else 8, temperature=1.0, seed=3)
        res = sampler.sample(
            prompt=types.ModelInput.from_ints(prompt_ids), num_samples=4, sampling_params=params
        ).result()
        diffs = []
        for seq in res.sequences:
            full = prompt_ids + list(seq.tokens)
            out = client.forward([sft_datum(full)], "cross_entropy").result()
            trainer = np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist(), dtype=np.float64)
            tail = trainer[len(prompt_ids) - 1 :]
            diffs.append(np.abs(tail - np.asarray(seq.logprobs, dtype=np.float64)))
        d = np.concatenate(diffs)
        stats = {
            "mean_abs": float(d.mean()),
            "p99_abs": float(np.percentile(d, 99)),
            "max_abs": float(d.max()),
            "n": int(d.size),
        }
        self.results.put("logprobs", "sampler_vs_trainer_sdk", stats)
        self.log("sampler vs trainer (SDK)", stats)

    def handover_parity(self, service: Any, client: Any, ephemeral: Any, types: Any) -> None:
        """The last ephemeral sampler (loaded from the trainer's memory) against a named save of
        the same state (loaded from its files): greedy tokens and logprobs, exactly."""
        prompt = types.ModelInput.from_ints(self.tokens(78, 32))
        params = types.SamplingParams(max_tokens=16 if not self.tiny else 8, temperature=0.0)
        named = service.create_sampling_client(model_path=client.save_weights_for_sampler("parity").result().path)
        a = ephemeral.sample(prompt=prompt, num_samples=1, sampling_params=params).result().sequences[0]
        b = named.sample(prompt=prompt, num_samples=1, sampling_params=params).result().sequences[0]
        diffs = [abs(x - y) for x, y in zip(a.logprobs or [], b.logprobs or [], strict=False)]
        parity = {
            "tokens_equal": list(a.tokens) == list(b.tokens),
            "logprobs_equal": list(a.logprobs or []) == list(b.logprobs or []),
            "max_abs_logprob_diff": max(diffs) if diffs else 0.0,
            "tokens": len(a.tokens),
        }
        self.results.put("stack", "handover_parity", parity)
        self.log("handover parity", parity)

    def rl(self, stack: Any) -> None:
        """tinker-cookbook's RL loop (arithmetic environment), several tenants concurrently."""
        import tinker_cookbook.utils.cost_estimation as cost_estimation
        from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
        from tinker_cookbook.rl import train

        cost_estimation._pricing_fetched = True  # no outbound network
        tenants = 2 if self.tiny else 4
        model = str(self.model_dir)
        logs = [self.work / f"rl-{i}" for i in range(tenants)]

        def config(i: int) -> Any:
            return train.Config(
                learning_rate=1e-5,
                dataset_builder=ArithmeticDatasetBuilder(
                    batch_size=4,
                    group_size=4,
                    n_batches=3,
                    model_name_for_tokenizer=model,
                    renderer_name="role_colon",
                ),
                model_name=model,
                recipe_name=f"gpu_rl_{i}",
                renderer_name="role_colon",
                max_tokens=16,
                log_path=str(logs[i]),
                eval_every=0,
                save_every=0,
                loss_fn="importance_sampling",
                lora_rank=RANK,
                base_url=stack.base_url,
                max_steps=3,
            )

        errors: list[str] = []

        def run(i: int) -> None:
            os.environ["TINKER_API_KEY"] = "tml-gpu-rl"
            try:
                asyncio.run(train.main(config(i)))
            except Exception:
                errors.append(traceback.format_exc())

        t = time.perf_counter()
        self.results.put("rl", "started_at", time.time())
        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(tenants)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=max(1.0, self.time_left() - 30))
        if any(th.is_alive() for th in threads):
            errors.append("rl: deadline reached with loops still running")
        wall = time.perf_counter() - t
        for err in errors:
            self.results.error("rl", err)
        for i, log in enumerate(logs):
            metrics = log / "metrics.jsonl"
            rows = (
                [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
                if metrics.exists()
                else []
            )
            for r in rows:
                timing = {k: v for k, v in r.items() if k.startswith("time/")}
                self.row("rl_steps", {"tenant": i, "step": r.get("step", r.get("progress")), **timing})
        self.results.put("rl", "wall_s", wall)
        self.results.put("rl", "tenants", tenants)

    # ---- summary ----

    def summary(self) -> None:
        t = self.tables
        parts = []
        specs = {
            "engine_fb": [("workload", "workload"), ("tokens", "tokens"), ("ms", "ms"), ("tok/s", "tok_s")],
            "engine_optim": [("slots", "slots"), ("ms", "ms")],
            "sdk_fb": [
                ("workload", "workload"),
                ("tokens", "tokens"),
                ("SDK ms", "sdk_ms"),
                ("SDK tok/s", "sdk_tok_s"),
                ("engine ms", "engine_ms"),
                ("engine tok/s", "engine_tok_s"),
                ("SDK / engine", "ratio"),
                ("trainer units per call", "trainer_units_per_call"),
            ],
            "sampler_engine": [
                ("batch", "batch"),
                ("adapters", "adapters"),
                ("tok/s", "tok_s"),
                ("ms/step", "ms_per_step"),
            ],
            "hf_generate": [("batch", "batch"), ("tok/s", "tok_s"), ("ms/step", "ms_per_step")],
            "sdk_sample": [
                ("batch", "batch"),
                ("adapters", "adapters"),
                ("tok/s", "tok_s"),
                ("wall s", "wall_s"),
            ],
            "save_to_sample": [
                ("try", "try"),
                ("save s", "save_s"),
                ("first sample s", "first_sample_s"),
                ("total s", "total_s"),
            ],
            "ephemeral_to_sample": [
                ("try", "try"),
                ("save s", "save_s"),
                ("first sample s", "first_sample_s"),
                ("total s", "total_s"),
            ],
            "save_state": [("try", "try"), ("s", "s")],
            "rl_steps": [
                ("tenant", "tenant"),
                ("step", "step"),
                ("total s", "time/total"),
                ("sampling s", "time/sampling"),
                ("train step s", "time/train_step"),
                ("save + sampling client s", "time/save_checkpoint_and_get_sampling_client"),
            ],
        }
        for name, cols in specs.items():
            if t.get(name):
                parts.append(f"## {name}\n\n{markdown_table(t[name], cols)}\n")
        hf = {r["batch"]: r for r in t.get("hf_generate", [])}
        ratios = [
            {"batch": r["batch"], "adapters": r["adapters"], "x_hf": r["tok_s"] / hf[r["batch"]]["tok_s"]}
            for r in t.get("sampler_engine", [])
            if r["batch"] in hf
        ]
        if ratios:
            parts.append(
                f"## sampler engine / HF generate+PEFT\n\n{markdown_table(ratios, [('batch', 'batch'), ('adapters', 'adapters'), ('x HF', 'x_hf')])}\n"
            )
        if t.get("overhead"):
            parts.append("## overhead\n\n```\n" + json.dumps(t["overhead"], indent=1) + "\n```\n")
        lp = self.results.data["sections"].get("logprobs")
        if lp:
            parts.append("## logprobs\n\n```\n" + json.dumps(lp, indent=1) + "\n```\n")
        text = "\n".join(parts)
        (self.out / "summary.md").write_text(text)
        print(text, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--work", default=None, help="model, adapters and stack data (default: a temp dir)")
    parser.add_argument("--tiny", action="store_true", help="tiny model on the CPU (smoke test)")
    parser.add_argument("--sections", default="model,engine,sampler,stack,rl")
    parser.add_argument("--deadline", type=float, default=540.0, help="seconds; later work is skipped")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="skip forward_backward workloads of more tokens (a card of less memory)"
    )
    parser.add_argument(
        "--slots", type=int, default=16, help="the stack trainer's adapter slots (each holds 3 x 369 MB on the GPU)"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    bench = Bench(args)
    wanted = args.sections.split(",")
    for name in ("model", "engine", "sampler", "stack"):
        if name in wanted:
            with bench.section(name):
                getattr(bench, name)()
    with bench.section("summary"):
        bench.summary()
    bench.log("done; errors:", len(bench.results.data["errors"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
