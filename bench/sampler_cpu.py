"""Sampler on CPU: decode tokens/s with 1 and 8 adapters, and publish latency.

Part 1, the CPU engine alone (``services.sampler.engine.HFEngine``, tiny-qwen3, fp32): 16
sequences submitted together (16-token prompts, ``ignore_eos``, temperature 1), each generating
``N`` new tokens. Configurations, run interleaved repetition by repetition:

    base         no adapter
    1 adapter    every sequence on the same random PEFT LoRA (rank 32, attention + MLP)
    8 adapters   sequence i on adapter i mod 8 (8 different LoRAs in one batch)

tokens/s = 16 N / wall time of the whole batch; the ratio is against "1 adapter".

Part 2, a real stack through the SDK: after an optimizer step, the time from
``save_weights_for_sampler`` to the first successful ``sample`` of the new weights, split into
its calls; a second sample on the same client (adapter already loaded) is the steady state.
Nothing is loaded into the engine by the save: the first sample loads the adapter on demand.
Then the same state is saved without a name (``save_weights_and_get_sampling_client``, answered
from the trainer's memory before its files exist) and sampled once: that row is the whole call.

Part 3, the same stack: kill -9 of the sampler, then at once a ``sample`` of an existing
snapshot and a ``save_weights_for_sampler``. The save completes with the engine down; the sample
waits (``paused_capacity``) until the supervisor's new sampler is ready, then loads its adapter
into the fresh engine and runs. The full run only kills a sampler that has been up 30 s, so each
kill is a first crash (the supervisor's shortest backoff); ``--quick`` kills once, without waiting.

    .venv/bin/python bench/sampler_cpu.py [--quick]
"""

from __future__ import annotations

import asyncio
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    cpu_parser,
    dist,
    footer,
    header,
    random_peft_adapter,
    random_tokens,
    running_stack,
    sft_datum,
    table,
)

BATCH = 16
PROMPT = 16
ADAPTERS = 8
RANK = 32
VOCAB = 2048  # tiny-qwen3


def engine_rows(new_tokens: int, reps: int) -> list[dict[str, Any]]:
    from libs.models.registry import ensure_tiny
    from services.sampler.config import SamplerConfig
    from services.sampler.engine import HFEngine
    from services.sampler.interface import SequenceRequest

    with tempfile.TemporaryDirectory(prefix="tinkerd-bench-") as tmp:
        model_dir = ensure_tiny(Path(tmp))
        engine = HFEngine(SamplerConfig(model_path=str(model_dir), max_batch_size=BATCH))
        try:
            for i in range(ADAPTERS):
                path = random_peft_adapter(model_dir, Path(tmp) / f"ad{i}", seed=100 + i, rank=RANK)
                asyncio.run(engine.load_adapter(f"ad{i}", str(path), pinned=True))

            def batch(adapters: list[str | None]) -> list[SequenceRequest]:
                return [
                    SequenceRequest(
                        input_ids=random_tokens(i, PROMPT, VOCAB),
                        max_new_tokens=new_tokens,
                        ignore_eos=True,
                        seed=i,
                        lora_name=adapters[i % len(adapters)],
                    )
                    for i in range(BATCH)
                ]

            configs = {
                "base model (no adapter)": batch([None]),
                "1 adapter": batch(["ad0"]),
                "8 adapters": batch([f"ad{i}" for i in range(ADAPTERS)]),
            }

            async def run(requests: list[SequenceRequest]) -> float:
                start = time.perf_counter()
                results = await engine.generate(requests)
                assert all(len(r.output_ids) == new_tokens for r in results)
                return time.perf_counter() - start

            times: dict[str, list[float]] = {name: [] for name in configs}
            for requests in configs.values():  # warm-up
                asyncio.run(run(requests))
            for _ in range(reps):
                for name, requests in configs.items():
                    times[name].append(asyncio.run(run(requests)))
        finally:
            engine.close()
    base = dist(times["1 adapter"])
    tokens = BATCH * new_tokens
    return [
        {
            "config": name,
            "reps": len(values),
            "p50_ms": dist(values)["p50"] * 1e3,
            "p99_ms": dist(values)["p99"] * 1e3,
            "tok_s": tokens / dist(values)["p50"],
            "ratio": base["p50"] / dist(values)["p50"],
            "ratio_min": base["min"] / dist(values)["min"],
        }
        for name, values in times.items()
    ]


def publish_rows(reps: int) -> list[dict[str, Any]]:
    import tinker
    from tinker import types

    steps: dict[str, list[float]] = {
        "save_weights_for_sampler": [],
        "create_sampling_client": [],
        "first sample (loads the adapter)": [],
        "total: save -> first sample": [],
        "steady sample (adapter loaded)": [],
        "ephemeral: save_weights_and_get_sampling_client -> first sample": [],
    }
    prompt = types.ModelInput.from_ints(random_tokens(0, 8, VOCAB))
    params = types.SamplingParams(max_tokens=8, temperature=0.0)
    with running_stack() as stack:
        service = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-bench-publish")
        training = service.create_lora_training_client(base_model="tiny-qwen3", rank=8).result()
        datum = sft_datum(random_tokens(1, 33, VOCAB))
        for i in range(reps + 1):  # the first round is a warm-up
            training.forward_backward([datum], "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            t0 = time.perf_counter()
            path = training.save_weights_for_sampler(f"bench-{i}").result().path
            t1 = time.perf_counter()
            sampler = training.create_sampling_client(path).result()
            t2 = time.perf_counter()
            sampler.sample(prompt, num_samples=1, sampling_params=params).result()
            t3 = time.perf_counter()
            sampler.sample(prompt, num_samples=1, sampling_params=params).result()
            t4 = time.perf_counter()
            # the same state saved again, without a name: answered from the trainer's memory
            ephemeral = training.save_weights_and_get_sampling_client().result()
            ephemeral.sample(prompt, num_samples=1, sampling_params=params).result()
            t5 = time.perf_counter()
            if i == 0:
                continue
            values = (t1 - t0, t2 - t1, t3 - t2, t3 - t0, t4 - t3, t5 - t4)
            for name, value in zip(steps, values, strict=True):
                steps[name].append(value)
    steady = dist(steps["steady sample (adapter loaded)"])["p50"]
    return [
        {
            "step": name,
            "n": len(values),
            "p50": dist(values, 1e3)["p50"],
            "p99": dist(values, 1e3)["p99"],
            "ratio": dist(values)["p50"] / steady,
        }
        for name, values in steps.items()
    ]


def restart_rows(rounds: int, spaced: bool) -> list[dict[str, Any]]:
    """kill -9 the sampler, sample an existing snapshot and save at once; time both."""
    import tinker
    from tinker import types

    samples: dict[str, list[float]] = {
        "kill -> sampler ready": [],
        "kill -> ready: supervisor backoff (its log)": [],
        "save_weights_for_sampler, sampler down": [],
        "kill -> sample result (it waited)": [],
        "ready -> sample result (probe, load, generate)": [],
    }
    prompt = types.ModelInput.from_ints(random_tokens(0, 8, VOCAB))
    params = types.SamplingParams(max_tokens=8, temperature=0.0)
    with running_stack() as stack:
        service = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-bench-restart")
        training = service.create_lora_training_client(base_model="tiny-qwen3", rank=8).result()
        datum = sft_datum(random_tokens(1, 33, VOCAB))
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        path = training.save_weights_for_sampler("bench-restart").result().path
        sampler = training.create_sampling_client(path).result()
        before = sampler.sample(prompt, num_samples=1, sampling_params=params).result()
        for i in range(rounds):
            child = stack.supervisor.children["sampler"]
            if spaced:
                time.sleep(max(0.0, 31 - (time.monotonic() - child.started_at)))
            ready_at: list[float] = []
            start = time.perf_counter()
            ready = stack.kill("sampler")
            waiter = threading.Thread(
                target=lambda ev=ready, out=ready_at: ev.wait(240) and out.append(time.perf_counter())
            )
            waiter.start()
            waiting = sampler.sample(prompt, num_samples=1, sampling_params=params)
            saved_at = time.perf_counter()
            training.save_weights_for_sampler(f"bench-restart-{i}").result()
            saved = time.perf_counter() - saved_at
            after = waiting.result()
            result_at = time.perf_counter()
            waiter.join()
            assert after.sequences[0].tokens == before.sequences[0].tokens, "the restart changed a sample"
            logs = "\n".join(stack.logs["sampler"])
            samples["kill -> sampler ready"].append(ready_at[0] - start)
            samples["kill -> ready: supervisor backoff (its log)"].append(
                float(re.findall(r"restarting in ([0-9.]+)s", logs)[-1])
            )
            samples["save_weights_for_sampler, sampler down"].append(saved)
            samples["kill -> sample result (it waited)"].append(result_at - start)
            samples["ready -> sample result (probe, load, generate)"].append(result_at - ready_at[0])
    return [
        {"what": name, "n": len(values), "p50": dist(values)["p50"], "max": dist(values)["max"]}
        for name, values in samples.items()
    ]


def main() -> None:
    args = cpu_parser(__doc__ or "").parse_args()
    new_tokens, reps, publishes, kills = (16, 3, 3, 1) if args.quick else (64, 15, 20, 3)
    header(
        "CPU sampler",
        args.quick,
        batch=BATCH,
        prompt_tokens=PROMPT,
        new_tokens=new_tokens,
        adapter_rank=RANK,
        engine_reps=reps,
        publish_reps=publishes,
        sampler_kills=kills,
    )
    table(
        f"Decode throughput, {BATCH} sequences x {new_tokens} new tokens (ratio = 1-adapter time / this time, > 1 is faster)",
        engine_rows(new_tokens, reps),
        [
            ("configuration", "config"),
            ("reps", "reps"),
            ("batch p50 ms", "p50_ms"),
            ("batch p99 ms", "p99_ms"),
            ("tokens/s", "tok_s"),
            ("vs 1 adapter (p50)", "ratio"),
            ("vs 1 adapter (min)", "ratio_min"),
        ],
    )
    table(
        "Publish latency through the SDK (ms; ratio = p50 / steady sample p50)",
        publish_rows(publishes),
        [("step", "step"), ("n", "n"), ("p50", "p50"), ("p99", "p99"), ("x steady sample", "ratio")],
    )
    table(
        "Sampler kill -9 on a running stack (seconds; save and sample sent right after the kill)",
        restart_rows(kills, spaced=not args.quick),
        [("what", "what"), ("n", "n"), ("p50", "p50"), ("max", "max")],
    )

    footer()


if __name__ == "__main__":
    main()
