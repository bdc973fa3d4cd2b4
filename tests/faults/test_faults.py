"""Fault tests: kill -9, hang and starve each part of the stack under a multi-tenant SDK workload.

Pass criteria, for every scenario (`check`):
- every SDK call completes, once, with no error the user has to handle (the SDK's own retries
  suffice), and none stalls;
- every tenant's results, call for call, and its final checkpoint (adapter, AdamW moments, step)
  are bit-identical (CPU fp32) to the independent reference: the same seeded workload run once,
  without any fault, on a stack of its own (`conftest.reference`);
- nothing was applied twice: no result appended twice, no unit planned twice, no unit run (and
  reported) twice — with a duplicate window of 1.5 s, so JetStream's dedupe hides nothing: every
  restart and redelivery below comes after it;
- every fault the scenario names actually fired.

Faults are fault points (`libs/faults.py`: the process kills itself with SIGKILL, or wedges, at
an exact place in its work) or external signals timed by operation events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from libs.faults import fired
from tests.faults.checks import EventTrigger, exactly_once
from tests.faults.conftest import FAULT_ENV
from tests.harness import Stack
from tests.sdk import TenantRun, differences, run_workload
from tinkerd.supervisor import NATS

READY_S = 240.0

Action = Callable[[Stack], None]


def check(stack: Stack, runs: list[TenantRun], reference: dict[int, TenantRun], injected: set[tuple[str, int]]) -> None:
    stalled = [(r.tenant, r.stalled) for r in runs if r.stalled]
    assert not stalled, f"stalled calls: {stalled}\n{stack.dump_logs()}"
    errors = [(r.tenant, repr(r.error)) for r in runs if r.error is not None]
    assert not errors, f"{errors}\n{stack.dump_logs()}"
    diff = differences(runs, reference)
    assert not diff, "results differ from the fault-free reference:\n" + "\n".join(diff)
    report = exactly_once(stack.nats_url, injected)
    assert report.clean, f"something was applied twice: {report} (injected: {sorted(injected)})"


def scenario(
    tmp_path: Path,
    reference: dict[int, TenantRun],
    points: tuple[str, ...] = (),
    trigger: tuple[str, int, Action] | None = None,
    env: dict[str, str] | None = None,
    injected: set[tuple[str, int]] | None = None,
) -> Stack:
    """Run the workload on a fresh stack with these fault points and this event-timed action."""
    fault_dir = tmp_path / "faults"
    env = {
        **FAULT_ENV,
        "TINKERD_FAULT_POINTS": ",".join(points),
        "TINKERD_FAULT_DIR": str(fault_dir),
        **(env or {}),
    }
    stack = Stack(tmp_path / "stack", env_overrides=env).start()
    try:
        event = None
        if trigger is not None:
            kind, n, action = trigger
            event = EventTrigger(stack.nats_url, kind, n, lambda: action(stack)).start()
        runs = run_workload(stack.base_url, stack.data_dir)
        if event is not None:
            assert event.done.wait(READY_S), f"the fault never completed (events: {dict(event.counts)})"
            event.stop()
            if event.error is not None:
                raise AssertionError(f"the fault's action failed: {event.error!r}") from event.error
        for point in points:
            assert fired(point, fault_dir), f"fault point {point} was never reached\n{stack.dump_logs()}"
        check(stack, runs, reference, injected if injected is not None else set())
    finally:
        stack.stop()
    return stack


def kill(service: str) -> Action:
    def action(stack: Stack) -> None:
        assert stack.kill(service).wait(READY_S), f"{service} did not come back"

    return action


def test_a_second_fault_free_run_matches_the_reference(tmp_path: Path, reference: dict[int, TenantRun]) -> None:
    """The control: with no fault, a run on another stack matches the reference bit for bit and
    applies nothing twice (so a failure below is the fault's doing)."""
    scenario(tmp_path, reference)


def test_trainer_killed_mid_window(tmp_path: Path, reference: dict[int, TenantRun]) -> None:
    """kill -9 from outside after the 4th unit: forward_backward done, its optim_step pending."""
    scenario(tmp_path, reference, trigger=("unit_done", 4, kill("trainer")))


def test_trainer_killed_in_every_phase(tmp_path: Path, reference: dict[int, TenantRun]) -> None:
    """The trainer dies mid-unit (computing), mid-write of a checkpoint file (its staging copy,
    written behind the unit path, or an internal snapshot), right after handing a save to the
    publisher, and after appending an outcome but before acknowledging the unit."""
    points = (
        "trainer.executing@3",
        "trainer.checkpoint_write@2",
        "trainer.save_handed_off@1",
        "trainer.outcome_published@6",
    )
    scenario(tmp_path, reference, points)


def test_trainer_and_planner_killed_while_models_are_paged_out(
    tmp_path: Path, reference: dict[int, TenantRun]
) -> None:
    """One adapter slot for three tenants: every model is paged out and in again and again. After
    the 3rd page-out the trainer is killed -9, then the planner: the trainer's replay rebuilds its
    page store (from its snapshot and the page-outs after it), the planner's which model is where,
    and every tenant's results still match the reference, which never paged anything."""

    def action(stack: Stack) -> None:
        kill("trainer")(stack)
        kill("planner")(stack)

    scenario(tmp_path, reference, trigger=("model_paged_out", 3, action), env={"TINKERD_NUM_SLOTS": "1"})


def test_planner_killed_in_every_phase(tmp_path: Path, reference: dict[int, TenantRun]) -> None:
    """The planner dies after appending units but before acknowledging their requests, between
    two results it publishes, and after publishing results but before acknowledging the outcomes."""
    points = ("planner.requests_planned@4", "planner.result_publishing@5", "planner.outcomes_folded@7")
    scenario(tmp_path, reference, points)


def test_gateway_killed_in_every_phase(tmp_path: Path, reference: dict[int, TenantRun]) -> None:
    """The gateway dies between claiming a training seq_id and appending its command, between
    claiming a sample and enqueueing its job (the SDK's retry reaches the restarted gateway, which
    appends what the claim was for), and while holding a sample job (redelivered to a replica)."""
    points = ("gateway.command_claimed@5", "gateway.sample_claimed@1", "gateway.sample_started@1")
    scenario(tmp_path, reference, points)


def test_publisher_killed_in_every_phase(tmp_path: Path, reference: dict[int, TenantRun]) -> None:
    """The publisher dies while placing a version's files (hard links of the staged ones), after
    writing a version before switching the name, and after answering a save before acknowledging
    the publication."""
    points = ("publisher.checkpoint_write@2", "publisher.version_written@1", "publisher.answered@2")
    scenario(tmp_path, reference, points)


def test_sampler_killed_mid_sample(tmp_path: Path, reference: dict[int, TenantRun]) -> None:
    """The sampling engine dies after generating, before answering: the sample job is run again
    once the engine is back, and the SDK gets its sample (no error)."""
    scenario(tmp_path, reference, ("sampler.generated@1",))


def test_nats_server_killed_under_load(tmp_path: Path, reference: dict[int, TenantRun]) -> None:
    """kill -9 of nats-server mid-workload: the supervisor restarts it on the same port and store,
    every service reconnects or restarts, and the workload completes as if nothing happened."""
    scenario(tmp_path, reference, trigger=("unit_done", 5, kill(NATS)))


def test_a_hung_trainer_is_detected_and_restarted(tmp_path: Path, reference: dict[int, TenantRun]) -> None:
    """The trainer hangs twice instead of dying: its compute thread wedges mid-unit (its watchdog
    sees the unit outlive unit_timeout_s and exits), then the whole process freezes (SIGSTOP: the
    supervisor sees its liveness file go stale and kills it). Each time it is restarted and the
    unit is delivered again."""
    env = {"TINKERD_TRAINER_UNIT_TIMEOUT_S": "15", "TINKERD_LIVENESS_TIMEOUT_S": "20"}

    def freeze(stack: Stack) -> None:
        assert stack.freeze("trainer").wait(READY_S), "a frozen trainer was not replaced"

    stack = scenario(tmp_path, reference, ("trainer.executing@4:hang",), ("unit_done", 12, freeze), env)
    log = "\n".join(stack.logs["trainer"])
    assert "is still running after 15 s (unit_timeout_s)" in log and "exited with code 70" in log
    assert "no sign of life" in log


def test_redelivered_messages_have_no_second_effect(tmp_path: Path, reference: dict[int, TenantRun]) -> None:
    """Mid-workload, once the duplicate window has passed, the newest request, unit, outcome and
    publication are appended again with their own message ids (JetStream accepts them: no dedupe),
    then the trainer is restarted so that its replay meets the copied unit: nothing is applied twice."""
    injected: set[tuple[str, int]] = set()

    def action(stack: Stack) -> None:
        asyncio.run(redeliver_latest(stack.nats_url, injected))
        kill("trainer")(stack)

    # after the first save was published, so that every stream has a newest message to copy
    scenario(tmp_path, reference, trigger=("checkpoint_published", 1, action), injected=injected)
    assert len(injected) == 4


async def redeliver_latest(nats_url: str, copies: set[tuple[str, int]]) -> None:
    """Append again the newest message of each log stream, with its original Nats-Msg-Id, after
    the duplicate window (the server says whether it took it as a duplicate: retried until not)."""
    from infra.bus import Bus
    from libs.contracts import subjects as s

    bus = await Bus.connect(nats_url, "redeliver")
    try:
        for stream in (s.STREAM_REQUESTS, s.STREAM_WORK, s.STREAM_OUTCOMES, s.STREAM_PUBLISH):
            info = await bus.js.stream_info(stream)
            latest = await bus.js.get_msg(stream, info.state.last_seq)
            assert latest.subject is not None and latest.data is not None and latest.headers
            msg_id = latest.headers["Nats-Msg-Id"]
            while True:
                ack = await bus.js.publish(latest.subject, latest.data, headers={"Nats-Msg-Id": msg_id})
                if not ack.duplicate:
                    copies.add((stream, ack.seq))
                    break
                await asyncio.sleep(0.25)  # inside the duplicate window: the server dropped it
    finally:
        await bus.close()


pytestmark = pytest.mark.slow
