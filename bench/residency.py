"""Residency: what paging costs, what oversubscription costs, and what a decision costs.

Three sections, one run:

1. **page-out / page-in latency** of one model's complete training state (rank-32 adapter on
   attention + MLP + unembedding, AdamW moments, gradients), through the trainer's
   ``PageStore`` on ``TrainerEngine``: to host memory, and to disk (host budget 0), for the
   tiny model and a random ~100M Qwen3 (``bench/common.py``).
2. **oversubscription through the SDK**: one real stack with 8 adapter slots. The same total
   work (``TOTAL_STEPS`` forward_backward + optim_step steps of 2 x 128-token datums) is done by
   8 tenants (8 models on 8 slots: no paging) and by 32 tenants (32 models on 8 slots: the
   planner pages them in and out), every tenant a thread with its own SDK client. Reported:
   wall time, tokens/s, and the ratio 32-on-8 / 8-on-8 (target >= 0.8), with the page moves.
3. **the planner's cost per decision** with 16 active models alone, and with the same 16 among
   1,000 models that exist and are idle (created, trained once, paged out): ``Planner.decide``
   timed in the pure core (no I/O).

    .venv/bin/python -m bench.residency [--quick]     raw output: bench/results/residency/
"""

from __future__ import annotations

import json
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
    QWEN3_100M,
    cpu_parser,
    dist,
    footer,
    header,
    random_qwen3,
    random_tokens,
    running_stack,
    table,
)

RANK = 32
DATUM_TOKENS = 128


# --- 1. page latency -------------------------------------------------------------------------
def page_latency(name: str, model_dir: Path, reps: int, tmp: Path) -> list[dict[str, Any]]:
    import numpy as np

    from services.trainer.engine import DatumInput, EngineConfig, LoraConfig, TrainerEngine
    from services.trainer.state.paging import PageStore

    engine = TrainerEngine(EngineConfig(base_model_dir=str(model_dir), num_slots=2, max_lora_rank=64))
    engine.init_slot(0, LoraConfig(rank=RANK, seed=1))
    tokens = np.asarray(random_tokens(1, DATUM_TOKENS + 1, engine.shape.vocab_size), dtype=np.int64)
    datum = DatumInput(0, tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(DATUM_TOKENS, np.float32)})
    engine.forward_backward([datum], "cross_entropy")  # moments and gradients exist, as in training
    rows = []
    for where, budget in (("host", 1 << 40), ("disk", 0)):
        store = PageStore(tmp / f"paged-{name}-{where}", budget)
        outs, ins, nbytes = [], [], 0
        for _ in range(reps):
            moved = store.page_out(engine, 0, "m")
            outs.append(moved.ms)
            nbytes = moved.nbytes
            ins.append(store.page_in(engine, 0, "m").ms)
        o, i = dist(outs), dist(ins)
        rows.append(
            {
                "model": name,
                "where": where,
                "mib": nbytes / 2**20,
                "reps": reps,
                "out_p50": o["p50"],
                "out_p99": o["p99"],
                "in_p50": i["p50"],
                "in_p99": i["p99"],
            }
        )
    return rows


# --- 2. oversubscription through the SDK ---------------------------------------------------
def train_tenants(base_url: str, tenants: int, steps: int, prefix: str) -> tuple[float, list[str]]:
    """`tenants` threads, each creating a model and doing `steps` fb+optim steps; wall seconds."""
    import numpy as np
    import tinker
    from tinker import types

    errors: list[str] = []
    barrier = threading.Barrier(tenants + 1)

    def tenant(i: int) -> None:
        try:
            client = tinker.ServiceClient(base_url=base_url, api_key=f"tml-{prefix}-{i}")
            training = client.create_lora_training_client(base_model="tiny-qwen3", rank=RANK, seed=i).result()
            barrier.wait()
            for step in range(steps):
                data = []
                for d in range(2):
                    toks = random_tokens(1000 * i + 10 * step + d, DATUM_TOKENS + 1, 2000)
                    data.append(
                        types.Datum(
                            model_input=types.ModelInput.from_ints(toks[:-1]),
                            loss_fn_inputs={
                                "target_tokens": types.TensorData.from_numpy(np.array(toks[1:], dtype=np.int64)),
                                "weights": types.TensorData.from_numpy(np.ones(DATUM_TOKENS, dtype=np.float32)),
                            },
                        )
                    )
                fb = training.forward_backward(data, "cross_entropy")
                opt = training.optim_step(types.AdamParams(learning_rate=1e-4))
                fb.result()
                opt.result()
            client.close("success").result(timeout=60)
        except BaseException as exc:  # reported, not raised: the other tenants go on
            errors.append(f"tenant {i}: {type(exc).__name__}: {exc}")
            if not barrier.broken:
                barrier.abort()

    threads = [threading.Thread(target=tenant, args=(i,), daemon=True) for i in range(tenants)]
    for thread in threads:
        thread.start()
    try:
        barrier.wait()  # every model exists: time the training only
    except threading.BrokenBarrierError:
        pass
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start, errors


def oversubscription(total_steps: int) -> tuple[list[dict[str, Any]], list[str]]:
    from bench.common import event_tag, events

    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    with running_stack({"TINKERD_NUM_SLOTS": "8"}) as stack:
        train_tenants(stack.base_url, 2, 1, "warm")  # the first call compiles nothing, but warms caches
        for tenants in (8, 32):
            steps = total_steps // tenants
            before = [event_tag(e) for e in events(stack.nats_url)]
            wall, errs = train_tenants(stack.base_url, tenants, steps, f"t{tenants}")
            after = [event_tag(e) for e in events(stack.nats_url)][len(before) :]
            errors += errs
            tokens = tenants * steps * 2 * DATUM_TOKENS
            rows.append(
                {
                    "config": f"{tenants} models on 8 slots",
                    "steps": tenants * steps,
                    "tokens": tokens,
                    "wall_s": wall,
                    "tok_s": tokens / wall,
                    "page_outs": after.count("model_paged_out"),
                    "page_ins": after.count("model_paged_in"),
                }
            )
    rows[1]["ratio"] = rows[1]["tok_s"] / rows[0]["tok_s"]
    rows[0]["ratio"] = 1.0
    return rows, errors


# --- 3. the planner's cost per decision ----------------------------------------------------
def decision_cost(idle: int, active: int, reps: int) -> dict[str, Any]:
    from services.planner.facts import CommandArrived, OutcomeArrived, UnitEmitted
    from services.planner.planner import Planner
    from services.planner.tests.sim import create, fb, trainer_outcome

    planner = Planner(num_slots=16, token_budget=16_384)
    arrival = 0

    def send(command: Any) -> None:
        nonlocal arrival
        arrival += 1
        planner.apply(CommandArrived(command, arrival))

    def run_all() -> None:
        while (unit := planner.decide()) is not None:
            planner.apply(UnitEmitted(unit))
            planner.apply(OutcomeArrived(trainer_outcome(unit)))

    for m in range(idle):  # models that exist, trained once, and were paged out by the next ones
        send(create(f"idle{m}"))
        send(fb(f"idle{m}", 1, [4]))
        run_all()
    for m in range(active):
        send(create(f"act{m}"))
    run_all()
    planner.collect()
    times = []
    for rep in range(reps):
        for m in range(active):
            send(fb(f"act{m}", 1 + rep, [4]))
        start = time.perf_counter()
        unit = planner.decide()
        times.append((time.perf_counter() - start) * 1e6)
        assert unit is not None
        planner.apply(UnitEmitted(unit))
        planner.apply(OutcomeArrived(trainer_outcome(unit)))
        run_all()
        planner.collect()
    d = dist(times)
    return {"models": idle + active, "active": active, "reps": reps, "p50_us": d["p50"], "p99_us": d["p99"]}


def main() -> None:
    args = cpu_parser(__doc__ or "").parse_args()
    from libs.models.registry import ensure_tiny

    quick = args.quick
    reps = 5 if quick else 20
    total_steps = 64 if quick else 256
    header(
        "Residency: paging, oversubscription, decision cost",
        quick,
        rank=RANK,
        page_reps=reps,
        total_steps=total_steps,
        datum=f"2 x {DATUM_TOKENS} tokens",
    )
    out = ROOT / "bench" / "results" / "residency"
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tinkerd-bench-") as tmp:
        rows = page_latency("tiny-qwen3", ensure_tiny(Path(tmp)), reps, Path(tmp))
        if not quick:
            rows += page_latency("qwen3-100m (random)", random_qwen3(Path(tmp) / "q100m", QWEN3_100M), reps, Path(tmp))
    results["page_latency"] = rows
    table(
        "page-out / page-in of one model's training state (ms)",
        rows,
        [("model", "model"), ("to", "where"), ("MiB", "mib"), ("reps", "reps"), ("out p50", "out_p50"),
         ("out p99", "out_p99"), ("in p50", "in_p50"), ("in p99", "in_p99")],
    )
    costs = [decision_cost(0, 16, reps * 5), decision_cost(984 if not quick else 184, 16, reps * 5)]
    costs[1]["ratio"] = costs[1]["p50_us"] / costs[0]["p50_us"]
    costs[0]["ratio"] = 1.0
    results["decision_cost"] = costs
    table(
        "Planner.decide with 16 active models (us)",
        costs,
        [("models", "models"), ("active", "active"), ("reps", "reps"), ("p50 us", "p50_us"), ("p99 us", "p99_us"), ("vs 16 alone", "ratio")],
    )
    over, errors = oversubscription(total_steps)
    results["oversubscription"] = over
    results["errors"] = errors
    table(
        "the same total work by 8 and by 32 tenants on 8 slots (through the SDK)",
        over,
        [("configuration", "config"), ("steps", "steps"), ("tokens", "tokens"), ("wall s", "wall_s"),
         ("tokens/s", "tok_s"), ("page-outs", "page_outs"), ("page-ins", "page_ins"), ("vs 8 on 8", "ratio")],
    )
    if errors:
        print("errors:", *errors, sep="\n  ")
    (out / ("results-quick.json" if quick else "results.json")).write_text(json.dumps(results, indent=1) + "\n")
    footer()


if __name__ == "__main__":
    main()
