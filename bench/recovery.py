"""Recovery: replay speed, recovery time against units since the snapshot, kill -9.

One real stack (tiny-qwen3). A workload of 4 tenants (threads), each running ``S`` steps of
``forward_backward`` (2 datums of 32 tokens) + ``optim_step``, fills the work stream. Then:

1. Replay speed: every unit of the work stream re-executed by a fresh in-process trainer
   (``Executor.execute(unit, True)``, as the trainer's own recovery does), timed per
   unit; the same units' live execute times (outcome ``finished_ns - started_ns``) for context
   (they ran while the workload's clients and every service shared the CPU).
2. Recovery time with K units after the newest internal snapshot (K = 0, 10, 50): a snapshot is
   written after unit N - K (``services.trainer.state.snapshots.take``) into a fresh data directory and
   a fresh ``TrainerService`` on the live NATS runs ``recover()``: restore the snapshot, fold the
   outcome stream, re-execute the K units. Building the engine is timed apart.
3. kill -9 of the running trainer: time until the supervisor's new trainer is ready (split into
   the supervisor's restart backoff, read from its log, and the restart itself), and until the SDK
   has the result of a ``forward_backward`` submitted right after the kill. The full run only
   kills a trainer that has been up 30 s, so each kill is a first crash (the shortest backoff);
   ``--quick`` kills once, without waiting.

    .venv/bin/python bench/recovery.py [--quick]
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    cpu_parser,
    dist,
    footer,
    header,
    random_tokens,
    running_stack,
    sft_datum,
    stream_messages,
    table,
)

TENANTS = 4
VOCAB = 2048  # tiny-qwen3


def workload(base_url: str, steps: int) -> list[Any]:
    """Run the tenants concurrently; returns one training client per tenant (for later calls)."""
    import tinker
    from tinker import types

    clients: list[Any] = [None] * TENANTS
    errors: list[BaseException] = []

    def tenant(t: int) -> None:
        try:
            service = tinker.ServiceClient(base_url=base_url, api_key=f"tml-bench-recovery-{t}")
            training = service.create_lora_training_client(base_model="tiny-qwen3", rank=8).result()
            clients[t] = training
            for step in range(steps):
                data = [sft_datum(random_tokens(100 * t + 2 * step + i, 33, VOCAB)) for i in range(2)]
                training.forward_backward(data, "cross_entropy").result()
                training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=tenant, args=(t,)) for t in range(TENANTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return clients


def fresh_service(model_dir: Path, data_dir: Path, bus: Any = None) -> tuple[Any, float]:
    """A TrainerService over a new engine (and how long the engine took to build)."""
    from services.trainer.config import TrainerConfig
    from services.trainer.engine import EngineConfig, TrainerEngine
    from services.trainer.service import TrainerService

    start = time.perf_counter()
    engine = TrainerEngine(EngineConfig(base_model_dir=str(model_dir), num_slots=8))
    build_s = time.perf_counter() - start
    return TrainerService(
        cast(Any, bus), TrainerConfig(data_dir=str(data_dir)), engine, "tiny-qwen3"
    ), build_s


def replay_rows(stack: Any, units: list[tuple[int, Any]], model_dir: Path, tmp: Path) -> list[dict[str, Any]]:
    from libs.contracts import codec
    from libs.contracts import subjects as s
    from libs.contracts.work import WorkUnit

    service, _ = fresh_service(model_dir, tmp / "replay")
    times: dict[str, list[float]] = defaultdict(list)
    tokens: dict[str, int] = defaultdict(int)
    for _, unit in units:
        kind = (
            "work units (forward_backward)"
            if isinstance(unit, WorkUnit)
            else "barrier units (step, init, ...)"
        )
        start = time.perf_counter()
        service.executor.execute(unit, True)
        times[kind].append(time.perf_counter() - start)
        tokens[kind] += unit.num_tokens if isinstance(unit, WorkUnit) else 0
    times["all units"] = [x for kind in list(times) for x in times[kind]]
    tokens["all units"] = sum(tokens.values())
    rows = [
        {
            "what": f"replay: {kind}",
            "units": len(values),
            "tokens": tokens[kind],
            "s": sum(values),
            "p50_ms": dist(values, 1e3)["p50"],
            "rate": len(values) / sum(values),
        }
        for kind, values in times.items()
    ]
    outcomes = stream_messages(
        stack.nats_url, s.STREAM_OUTCOMES, s.OUTCOMES_ALL, lambda m: codec.outcome_decoder.decode(m.data)
    )
    live = [(o.finished_ns - o.started_ns) / 1e9 for o in outcomes]
    rows.append(
        {
            "what": "live, same units, under the workload's own load: execute times",
            "units": len(live),
            "tokens": tokens["all units"],
            "s": sum(live),
            "p50_ms": dist(live, 1e3)["p50"],
            "rate": len(live) / sum(live),
        }
    )
    return rows


def recover_rows(
    stack: Any, units: list[tuple[int, Any]], model_dir: Path, tmp: Path, ks: list[int]
) -> list[dict[str, Any]]:
    from infra.bus import Bus
    from services.trainer.state import snapshots

    ks = sorted({min(k, len(units) - 1) for k in ks}, reverse=True)  # largest K = earliest snapshot
    writer, _ = fresh_service(model_dir, tmp / "writer")
    done = 0
    for k in ks:  # one pass through the units, a snapshot at each N - K
        for _, unit in units[done : len(units) - k]:
            writer.executor.execute(unit, True)
        done = len(units) - k
        snapshots.take(
            writer.engine, dict(writer.executor.slot_models), writer.executor.pages, tmp / f"k{k}", "default", units[done - 1][0]
        )

    async def recover(k: int) -> dict[str, Any]:
        bus = await Bus.connect(stack.nats_url, "bench-recover")
        try:
            service, build_s = fresh_service(model_dir, tmp / f"k{k}", bus)
            start = time.perf_counter()
            replayed = await service.recover()
            return {
                "k": k,
                "replayed": replayed,
                "recover_s": time.perf_counter() - start,
                "build_s": build_s,
            }
        finally:
            await bus.close()

    rows = [asyncio.run(recover(k)) for k in sorted(ks)]
    for row in rows:
        row["per_unit_ms"] = (row["recover_s"] - rows[0]["recover_s"]) / row["k"] * 1e3 if row["k"] else None
    return rows


def kill_rows(stack: Any, training: Any, model_dir: Path, rounds: int, spaced: bool) -> list[dict[str, Any]]:
    """kill -9 the trainer, submit at once, wait for the result; ``spaced``: only kill a trainer
    that has been up 30 s, so the supervisor treats every kill as a first crash (shortest backoff)."""
    from tinker import types

    datum = sft_datum(random_tokens(7, 33, VOCAB))
    samples: dict[str, list[float]] = defaultdict(list)
    replayed: list[int] = []
    for _ in range(rounds):
        child = stack.supervisor.children["trainer"]
        if spaced:
            time.sleep(max(0.0, 31 - (time.monotonic() - child.started_at)))
        ready_at: list[float] = []
        start = time.perf_counter()
        ready = stack.kill("trainer")
        waiter = threading.Thread(
            target=lambda ev=ready, out=ready_at: ev.wait(240) and out.append(time.perf_counter())
        )
        waiter.start()
        training.forward_backward([datum], "cross_entropy").result()
        result_at = time.perf_counter()
        waiter.join()
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        logs = "\n".join(stack.logs["trainer"])
        backoff = float(re.findall(r"restarting in ([0-9.]+)s", logs)[-1])
        replayed.append(int(re.findall(r"replayed (\d+) units", logs)[-1]))
        samples["kill -> trainer ready"].append(ready_at[0] - start)
        samples["kill -> ready: supervisor backoff (its log)"].append(backoff)
        samples["kill -> ready: restart (minus the backoff)"].append(ready_at[0] - start - backoff)
        samples["ready -> SDK result"].append(result_at - ready_at[0])
        samples["kill -> SDK result"].append(result_at - start)
    probe = (  # what a restarted trainer does before recover(): start python, import, build the engine
        "import time; import services.trainer.service; t1 = time.perf_counter()\n"
        "from services.trainer.engine import EngineConfig, TrainerEngine\n"
        f"TrainerEngine(EngineConfig(base_model_dir={str(model_dir)!r})); print(time.perf_counter() - t1)"
    )
    for _ in range(rounds):
        start = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", probe], check=True, cwd=ROOT, capture_output=True, text=True
        )
        build_s = float(out.stdout.split()[-1])
        samples["new process, apart: python start -> trainer imported"].append(
            time.perf_counter() - start - build_s
        )
        samples["new process, apart: first engine build"].append(build_s)
    return [
        {
            "what": name,
            "n": len(values),
            "p50": dist(values)["p50"],
            "max": dist(values)["max"],
            "replayed": replayed if name.startswith("kill -> SDK") else "",
        }
        for name, values in samples.items()
    ]


def main() -> None:
    args = cpu_parser(__doc__ or "").parse_args()
    steps, ks, rounds = (3, [0, 2, 5], 1) if args.quick else (20, [0, 10, 50], 3)
    header("Recovery", args.quick, tenants=TENANTS, steps_per_tenant=steps, k=ks, kill_rounds=rounds)
    from libs.contracts import codec
    from libs.contracts import subjects as s
    from libs.models.registry import ensure_tiny

    with running_stack() as stack, tempfile.TemporaryDirectory(prefix="tinkerd-bench-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = ensure_tiny(tmp)
        clients = workload(stack.base_url, steps)
        units = stream_messages(
            stack.nats_url,
            s.STREAM_WORK,
            s.WORK_ALL,
            lambda m: (m.metadata.sequence.stream, codec.unit_decoder.decode(m.data)),
        )
        replay = replay_rows(stack, units, model_dir, tmp)
        recover = recover_rows(stack, units, model_dir, tmp, ks)
        kill = kill_rows(stack, clients[0], model_dir, rounds, spaced=not args.quick)
    table(
        "Replay speed: the whole work stream re-executed by a fresh trainer",
        replay,
        [
            ("what", "what"),
            ("units", "units"),
            ("tokens", "tokens"),
            ("seconds", "s"),
            ("p50 ms per unit", "p50_ms"),
            ("units/s", "rate"),
        ],
    )
    table(
        f"Recovery with K units after the newest snapshot ({len(units)} units in the stream)",
        recover,
        [
            ("K", "k"),
            ("units replayed", "replayed"),
            ("recover() s", "recover_s"),
            ("ms per extra unit", "per_unit_ms"),
            ("engine build s (apart)", "build_s"),
        ],
    )
    table(
        "Trainer kill -9 on a running stack (seconds)",
        kill,
        [
            ("interval", "what"),
            ("n", "n"),
            ("p50", "p50"),
            ("max", "max"),
            ("units replayed on restart", "replayed"),
        ],
    )

    footer()


if __name__ == "__main__":
    main()
