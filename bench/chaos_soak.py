"""Chaos soak: tenants train and sample while a random process is SIGKILLed every
15-30 s, nats-server included; at the end every tenant's results match the fault-free reference.

    .venv/bin/python -m bench.chaos_soak [--quick] [--minutes 10] [--seed 0] [--out DIR]

1. The reference: the seeded workload of the fault tests (`tests/sdk.py`: per tenant,
   create, 4 x (forward_backward + optim_step), a save for sampling and a sample after step 1,
   save_state, close) once, with no fault, on a stack of its own.
2. The soak, on another stack: rounds of the same workload back to back until the duration has
   passed. Meanwhile a killer waits U(15, 30) s, SIGKILLs a random process (gateway, planner,
   trainer, publisher, sampler or nats-server; `--quick` takes them in a shuffled order, so a
   short run still hits several), waits for the supervisor's new process to be ready, and again.

Reported (and the exit status is 1 unless all are zero): lost calls (an SDK call that failed),
doubled effects (a result appended twice, a unit planned twice or run twice, read back from the
streams; and rounds whose results differ from the reference, which a doubled or lost effect on
the weights would cause), stalled calls (no result after `STALL_S`). Per kill: the target, kill
to its restarted process's ready line, and kill to the first SDK call completed after that.
`--quick` (CI: `tests/faults/test_chaos.py`): about a minute of kills every 8-15 s.
The raw output goes to `--out` (default `bench/results/chaos_soak/`): `summary.md`, `report.json`.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import cpu_parser, dist, footer, header, markdown_table  # noqa: E402

TENANTS = 4
TARGETS = ("gateway", "planner", "trainer", "publisher", "sampler", "nats")
READY_S = 240.0


@dataclass
class Kill:
    target: str
    at_s: float  # since the soak started
    ready_s: float | None = None  # kill -> the restarted process is ready
    next_call_s: float | None = None  # kill -> the first SDK call completed after it was ready


@dataclass
class Round:
    index: int
    started_s: float
    seconds: float
    calls: int
    lost: int
    stalled: int
    differs: list[str]
    close_hung: int = 0  # the SDK's close() did not return (client side)
    close_unfinished: int = 0  # ...and the server had not finished the session


@dataclass
class Report:
    minutes: float
    tenants: int
    rounds: list[Round] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    results_replaced: int = 0
    units_planned_twice: int = 0
    units_with_two_outcomes: int = 0

    @property
    def lost(self) -> int:
        return sum(r.lost for r in self.rounds)

    @property
    def stalled(self) -> int:
        return sum(r.stalled for r in self.rounds)

    @property
    def doubled(self) -> int:
        return self.results_replaced + self.units_planned_twice + self.units_with_two_outcomes

    @property
    def close_unfinished(self) -> int:
        return sum(r.close_unfinished for r in self.rounds)

    @property
    def rounds_differing(self) -> int:
        return sum(1 for r in self.rounds if r.differs)

    @property
    def ok(self) -> bool:
        unrecovered = [k for k in self.kills if k.ready_s is None]
        return not (
            self.lost
            or self.stalled
            or self.doubled
            or self.rounds_differing
            or self.close_unfinished
            or unrecovered
        )


def reference_run(base: Path, tenants: int) -> dict[int, Any]:
    from tests.faults.checks import exactly_once
    from tests.faults.conftest import FAULT_ENV
    from tests.harness import Stack
    from tests.sdk import run_workload

    stack = Stack(base / "reference", env_overrides=FAULT_ENV).start()
    try:
        runs = run_workload(stack.base_url, stack.data_dir, tenants=tenants, key="fault")
        failed = [(r.tenant, repr(r.error)) for r in runs if r.error is not None]
        if failed or not exactly_once(stack.nats_url).clean:
            raise RuntimeError(f"the fault-free reference run failed: {failed}\n{stack.dump_logs()}")
    finally:
        stack.stop()
    return {run.tenant: run for run in runs}


def soak(
    base: Path,
    minutes: float,
    reference: dict[int, Any],
    tenants: int = TENANTS,
    seed: int = 0,
    quick: bool = False,
) -> Report:
    """Rounds of the workload on a fresh stack under random kills for `minutes`; see the module docstring."""
    from tests.faults.checks import exactly_once
    from tests.faults.conftest import FAULT_ENV
    from tests.harness import Stack
    from tests.sdk import differences, run_workload

    rng = random.Random(seed)
    report = Report(minutes=minutes, tenants=tenants)
    stack = Stack(base / "soak", env_overrides=FAULT_ENV).start()
    completions: list[float] = []  # monotonic time of every completed SDK call
    start = time.monotonic()
    deadline = start + minutes * 60
    stop = threading.Event()
    low, high = (8.0, 15.0) if quick else (15.0, 30.0)

    def killer() -> None:
        order = list(TARGETS)
        rng.shuffle(order)
        while not stop.wait(rng.uniform(low, high)):
            if time.monotonic() > deadline:
                return
            target = order.pop(0) if quick and order else rng.choice(TARGETS)
            kill = Kill(target, time.monotonic() - start)
            report.kills.append(kill)
            killed_at = time.monotonic()
            ready = stack.kill(target)
            if not ready.wait(READY_S):
                return  # reported as unrecovered
            kill.ready_s = time.monotonic() - killed_at

    thread = threading.Thread(target=killer, name="killer", daemon=True)
    try:
        thread.start()
        index = 0
        while index == 0 or time.monotonic() < deadline:
            began = time.monotonic()
            runs = run_workload(stack.base_url, stack.data_dir, tenants=tenants, key="fault")
            completions.extend(t for run in runs for t in run.completed_at)
            report.rounds.append(
                Round(
                    index=index,
                    started_s=began - start,
                    seconds=time.monotonic() - began,
                    calls=sum(len(r.calls) for r in runs),
                    lost=sum(1 for r in runs if r.error is not None and not r.stalled),
                    stalled=sum(1 for r in runs if r.stalled),
                    differs=differences([r for r in runs if r.error is None], reference)
                    + [
                        f"tenant {r.tenant}: {r.stalled or 'call'} failed: {r.error!r}"[:300]
                        for r in runs
                        if r.error
                    ],
                    close_hung=sum(1 for r in runs if r.close_hung),
                    close_unfinished=sum(1 for r in runs if r.close_hung and not r.session_finished),
                )
            )
            index += 1
        stop.set()
        thread.join(READY_S)
        check = exactly_once(stack.nats_url)
        report.results_replaced = check.results_replaced
        report.units_planned_twice = check.units_planned_twice
        report.units_with_two_outcomes = check.units_with_two_outcomes
    finally:
        stop.set()
        stack.stop()
    completions.sort()
    for kill in report.kills:
        if kill.ready_s is None:
            continue
        ready_at = start + kill.at_s + kill.ready_s
        after = [t for t in completions if t >= ready_at]
        kill.next_call_s = after[0] - (start + kill.at_s) if after else None
    return report


def summary(report: Report) -> str:
    lines = [
        f"{report.minutes:g} minutes, {report.tenants} tenants, {len(report.rounds)} rounds, "
        f"{sum(r.calls for r in report.rounds)} SDK calls, {len(report.kills)} kills",
        "",
        markdown_table(
            [
                {"what": "lost calls (failed)", "n": report.lost},
                {"what": "doubled: results appended twice", "n": report.results_replaced},
                {"what": "doubled: units planned twice", "n": report.units_planned_twice},
                {"what": "doubled: units run twice (two outcomes)", "n": report.units_with_two_outcomes},
                {"what": "rounds whose results differ from the reference", "n": report.rounds_differing},
                {"what": "stalled calls", "n": report.stalled},
                {"what": "sessions the server did not finish", "n": report.close_unfinished},
                {
                    "what": "SDK close() that did not return in 60 s (client side: the server had finished the session)",
                    "n": sum(r.close_hung - r.close_unfinished for r in report.rounds),
                },
                {"what": "kills not recovered from", "n": sum(1 for k in report.kills if k.ready_s is None)},
            ],
            [("", "what"), ("count", "n")],
        ),
        "",
    ]
    rows = []
    for target in TARGETS:
        kills = [k for k in report.kills if k.target == target]
        if not kills:
            continue
        ready = dist([k.ready_s for k in kills if k.ready_s is not None])
        nxt = dist([k.next_call_s for k in kills if k.next_call_s is not None])
        rows.append(
            {
                "target": target,
                "kills": len(kills),
                "ready_p50": ready["p50"],
                "ready_max": ready["max"],
                "next_p50": nxt["p50"],
                "next_max": nxt["max"],
            }
        )
    lines += [
        "Recovery per kill (seconds): kill -> the restarted process is ready; kill -> the first SDK "
        "call completed after that",
        "",
        markdown_table(
            rows,
            [
                ("killed", "target"),
                ("kills", "kills"),
                ("ready p50", "ready_p50"),
                ("ready max", "ready_max"),
                ("next call p50", "next_p50"),
                ("next call max", "next_max"),
            ],
        ),
        "",
        "Every kill, in order:",
        "",
        markdown_table(
            [asdict(k) for k in report.kills],
            [("at s", "at_s"), ("killed", "target"), ("ready s", "ready_s"), ("next call s", "next_call_s")],
        ),
    ]
    differing = [d for r in report.rounds for d in r.differs]
    if differing:
        lines += ["", "Differences:", "", *[f"- {d}" for d in differing[:40]]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = cpu_parser(__doc__ or "")
    parser.add_argument("--minutes", type=float, default=None, help="soak length (default 10; --quick: 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "chaos_soak")
    args = parser.parse_args(argv)
    minutes = args.minutes if args.minutes is not None else (1.0 if args.quick else 10.0)
    header(
        "Chaos soak", args.quick, tenants=TENANTS, minutes=minutes, seed=args.seed, targets=",".join(TARGETS)
    )
    with tempfile.TemporaryDirectory(prefix="tinkerd-soak-") as tmp:
        reference = reference_run(Path(tmp), TENANTS)
        report = soak(Path(tmp), minutes, reference, TENANTS, args.seed, args.quick)
    text = summary(report)
    print(text, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.md").write_text(text + "\n")
    data = {
        **asdict(report),
        "lost": report.lost,
        "stalled": report.stalled,
        "doubled": report.doubled,
        "ok": report.ok,
    }
    (args.out / "report.json").write_text(json.dumps(data, indent=1))
    footer()
    print("PASS" if report.ok else "FAIL", flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
