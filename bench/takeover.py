"""Takeover of a lost trainer group: failover timings.

One real stack (tiny-qwen3) with two trainer groups (`TINKERD_TRAINER_GROUPS=a,b`, 2 adapter
slots each), heartbeats every 0.5 s and `TINKERD_PLANNER_GROUP_TIMEOUT_S` lowered to `TIMEOUT_S`
(the default is 15 s). Two tenants (SDK clients) train on one group, a third on the other. Each
trial: kill -9 the group holding the two tenants and keep it down; at once the first tenant
submits its next forward_backward. Measured from the kill (the clock of this process; every
time is when a log line or a result reached it):

- detection: until the planner logs the group LOST (the group timeout, plus up to the planner's
  1 s liveness poll);
- planned: from then until the planner logs the takeover unit (the first tenant has work; the
  second, idle, moves when its own next call arrives, in a takeover unit of its own);
- adopted: from then until the live group's trainer logs the adoption (the unit delivered, the
  lost group's streams read, the model rebuilt from its snapshot and later units and written to
  `trainer/adopted/`; the trainer's own lines, with the read and rebuild times, are kept in the
  raw output);
- first result: until the forward_backward's result reaches the client (the takeover, then the
  step itself on the live group).

Then the killed group is started again (its recovery skips what was taken over) and the next
trial kills the group that holds the tenants now: the models move back and forth.

    .venv/bin/python bench/takeover.py [--quick]
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

from bench.common import cpu_parser, dist, footer, header, random_tokens, sft_datum, table  # noqa: E402

OUT = ROOT / "bench" / "results" / "takeover"
TIMEOUT_S = 3.0
VOCAB = 2048
GROUPS = ("a", "b")


class Clock:
    """When (time.monotonic) the lines the trials wait for reached this process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lost: dict[str, float] = {}
        self.live: dict[str, threading.Event] = {g: threading.Event() for g in GROUPS}
        self.adopted: list[tuple[float, str]] = []  # (when, line)
        self.planned: list[float] = []  # the planner's "taking over ..." lines
        self.read: list[tuple[float, str]] = []  # the live trainer's "taking over from lost group ..."

    def on_line(self, service: str, line: str) -> None:
        now = time.monotonic()
        with self.lock:
            if service == "planner" and "taking over " in line and "from lost trainer group" in line:
                self.planned.append(now)
            elif service == "planner":
                for group in GROUPS:
                    if f"trainer group {group} (" in line:
                        if "LOST" in line:
                            self.lost[group] = now
                        elif line.rstrip().endswith(", live"):
                            self.live[group].set()
            elif service.startswith("trainer@") and "adopted " in line and "from lost group" in line:
                self.adopted.append((now, line.strip()))
            elif service.startswith("trainer@") and "taking over from lost group" in line:
                self.read.append((now, line.strip()))


def records(stack: Any) -> dict[str, str]:
    """model id -> the group the planner has it on."""
    import asyncio

    from infra.bus import Bus, kv_scan
    from libs.contracts import codec
    from libs.contracts import subjects as s
    from libs.contracts.records import ModelQueueRecord

    async def read() -> dict[str, str]:
        bus = await Bus.connect(stack.nats_url, "bench-takeover")
        try:
            values = (await kv_scan(bus, s.KV_PLANNER)).values()
            return {r.model_id: r.group for r in (codec.from_json(v, ModelQueueRecord) for v in values)}
        finally:
            await bus.close()

    return asyncio.run(read())


def main() -> None:
    args = cpu_parser(__doc__ or "").parse_args()
    trials, datums, tokens = (1, 2, 32) if args.quick else (5, 4, 64)
    header(
        "Takeover of a lost trainer group", args.quick,
        groups=2, slots=2, heartbeat_s=0.5, group_timeout_s=TIMEOUT_S, trials=trials, datums=datums, tokens=tokens,
    )
    import tinker
    from tinker import types

    from tests.harness import Stack

    clock = Clock()
    env = {
        "TINKERD_TRAINER_GROUPS": ",".join(GROUPS),
        "TINKERD_NUM_SLOTS": "2",
        "TINKERD_TRAINER_HEARTBEAT_S": "0.5",
        "TINKERD_PLANNER_GROUP_TIMEOUT_S": str(TIMEOUT_S),
        "TINKERD_TRAINER_SNAPSHOT_EVERY_STEPS": "4",
    }
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tinkerd-bench-") as tmp:
        stack = Stack(Path(tmp), services=("trainer", "planner", "gateway"), env_overrides=env, listeners=[clock.on_line])
        stack.start()
        try:
            for group in GROUPS:
                assert clock.live[group].wait(60), f"group {group} never reported"
            service = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-bench-takeover")
            clients = [service.create_lora_training_client(base_model="tiny-qwen3", rank=8, seed=s) for s in (1, 2, 3)]
            placed = records(stack)
            shared = next(g for g in GROUPS if sum(placed[str(c.model_id)] == g for c in clients) == 2)
            t1, t2 = (c for c in clients if placed[str(c.model_id)] == shared)  # the two on one group
            counter = [0]

            def step(training: Any) -> None:
                counter[0] += 1
                data = [sft_datum(random_tokens(100 * counter[0] + i, tokens, VOCAB)) for i in range(datums)]
                training.forward_backward(data, "cross_entropy").result()
                training.optim_step(types.AdamParams(learning_rate=1e-3)).result()

            for training in clients:
                step(training)
                step(training)
            training1 = t1.result()
            for trial in range(trials):
                where = records(stack)
                dead = where[str(t1.model_id)]
                assert where[str(t2.model_id)] == dead, where
                with clock.lock:
                    clock.adopted.clear()
                    clock.planned.clear()
                    clock.read.clear()
                    clock.lost.pop(dead, None)
                    clock.live[dead].clear()
                stack.stop_service(f"trainer@{dead}")
                killed = time.monotonic()
                data = [sft_datum(random_tokens(7919 + trial, tokens, VOCAB)) for _ in range(datums)]
                training1.forward_backward(data, "cross_entropy").result()
                answered = time.monotonic()
                training1.optim_step(types.AdamParams(learning_rate=1e-3)).result()
                step(t2)  # idle until now: taken over by its own takeover unit
                with clock.lock:
                    lost = clock.lost[dead]
                    adopted, planned, read = list(clock.adopted), list(clock.planned), list(clock.read)
                moved = records(stack)
                row = {
                    "trial": trial,
                    "killed": dead,
                    "now_on": moved[str(t1.model_id)],
                    "detection_s": lost - killed,
                    "planned_s": planned[0] - lost,
                    "adopted_s": adopted[0][0] - planned[0],
                    "first_result_s": answered - killed,
                    "trainer_lines": [line.split("tinkerd.trainer: ")[-1] for _, line in sorted(read + adopted)],
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
                back = stack.start_service(f"trainer@{dead}")
                assert back.wait(240) and clock.live[dead].wait(60), f"group {dead} did not come back"
        finally:
            stack.stop()
    summary = [
        {"what": what, **dist([r[key] for r in rows])}
        for what, key in (
            ("kill -9 -> the planner marks the group lost", "detection_s"),
            ("lost -> the takeover unit is planned", "planned_s"),
            ("planned -> the live group has rebuilt the model (streams read, state rebuilt)", "adopted_s"),
            ("kill -9 -> the first forward_backward result of the moved model", "first_result_s"),
        )
    ]
    table(
        f"Takeover timings, seconds (group timeout {TIMEOUT_S:g} s, heartbeat 0.5 s)",
        summary,
        [("measured", "what"), ("n", "n"), ("min", "min"), ("p50", "p50"), ("max", "max")],
    )
    OUT.mkdir(parents=True, exist_ok=True)
    if not args.quick:
        (OUT / "results.json").write_text(json.dumps({"trials": rows, "summary": summary}, indent=1))
    footer()


if __name__ == "__main__":
    main()
