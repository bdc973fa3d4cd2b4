"""Fault tests: kill -9 each part of the stack under a multi-tenant SDK workload.

Pass criteria, for every scenario:
- every SDK call completes, with no error the user has to handle (the SDK's own retries suffice);
- every future resolves exactly once (no result is ever appended twice to the results stream);
- each tenant's final checkpoint (adapter, AdamW moments, step counter) is bit-identical (CPU fp32)
  to the recorded plan executed once by a fresh, uninterrupted trainer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.faults.workload import (
    STEPS,
    TENANTS,
    EventTrigger,
    checkpoint_digests,
    clean_replay_digests,
    results_published_once,
    run_workload,
)
from tests.harness import Stack


def check_run(stack: Stack, trigger: EventTrigger | None = None) -> None:
    runs = run_workload(stack.base_url)
    if trigger is not None:
        trigger.stop()
        assert trigger.fired.is_set(), f"the fault never fired (events seen: {dict(trigger.counts)})"
    errors = [(r.tenant, repr(r.error)) for r in runs if r.error is not None]
    assert not errors, f"{errors}\n{stack.dump_logs()}"
    assert all(r.samples == 1 for r in runs)

    appended, kept = asyncio.run(results_published_once(stack.nats_url))
    assert appended == kept, "a future's result was appended more than once"

    expected = clean_replay_digests(stack.data_dir, stack.nats_url)
    assert len(expected) == TENANTS
    for run in runs:
        got = checkpoint_digests(stack.data_dir, run.final_path)
        assert got["step"] == str(STEPS)
        assert got == expected[run.model_id], f"tenant {run.tenant}: final state differs from the uninterrupted plan"


def scenario(tmp_path: Path, kill: Callable[[Stack], Callable[[], None]] | None, kind: str = "", n: int = 0, env: dict[str, str] | None = None) -> None:
    stack = Stack(tmp_path, env_overrides=env or {}).start()
    try:
        trigger = EventTrigger(stack.nats_url, kind, n, kill(stack)).start() if kill else None
        check_run(stack, trigger)
    finally:
        stack.stop()


def kill_and_wait(service: str) -> Callable[[Stack], Callable[[], None]]:
    def make(stack: Stack) -> Callable[[], None]:
        def action() -> None:
            ready = stack.kill(service)
            assert ready.wait(240), f"{service} did not come back"

        return action

    return make


def test_uninterrupted_run_matches_its_own_plan(tmp_path: Path) -> None:
    """The control: with no fault, the checks hold (so a failure below is the fault's doing)."""
    scenario(tmp_path, None)


def test_trainer_killed_mid_window(tmp_path: Path) -> None:
    # the 4th finished unit is inside the second window: forward_backward done, optim_step pending
    scenario(tmp_path, kill_and_wait("trainer"), kind="unit_done", n=4, env={"TINKERD_TRAINER_SNAPSHOT_EVERY_STEPS": "2"})


def test_planner_killed(tmp_path: Path) -> None:
    scenario(tmp_path, kill_and_wait("planner"), kind="planned", n=5)


def test_gateway_killed(tmp_path: Path) -> None:
    scenario(tmp_path, kill_and_wait("gateway"), kind="accepted", n=6)


def test_gateway_killed_mid_sample(tmp_path: Path) -> None:
    """A gateway dies (SIGKILL) holding a sample job: another run of the job answers the same future."""
    marker = tmp_path / "fault-fired"
    env = {"TINKERD_FAULT_POINT": "gateway.sample_started", "TINKERD_FAULT_MARKER": str(marker)}
    scenario(tmp_path / "stack", None, env=env)
    assert marker.exists(), "the gateway never reached its fault point"


def test_publisher_killed_mid_write(tmp_path: Path) -> None:
    """The publisher dies (SIGKILL) after writing a version directory, before switching the name."""
    marker = tmp_path / "fault-fired"
    env = {"TINKERD_FAULT_POINT": "publisher.version_written", "TINKERD_FAULT_MARKER": str(marker)}
    scenario(tmp_path / "stack", None, env=env)
    assert marker.exists(), "the publisher never reached its fault point"


def test_nats_server_restarted(tmp_path: Path) -> None:
    def make(stack: Stack) -> Callable[[], None]:
        return stack.restart_nats

    scenario(tmp_path, make, kind="unit_done", n=5)


def test_redelivered_messages_have_no_second_effect(tmp_path: Path) -> None:
    """Mid-workload, the newest request, unit, outcome and publication are appended again (new
    message ids, so JetStream's dedupe does not hide them): nothing is applied twice."""

    def make(stack: Stack) -> Callable[[], None]:
        def action() -> None:
            asyncio.run(redeliver_latest(stack.nats_url))

        return action

    scenario(tmp_path, make, kind="unit_done", n=6)


async def redeliver_latest(nats_url: str) -> None:
    from infra.bus import Bus
    from libs.contracts import subjects as s

    bus = await Bus.connect(nats_url, "redeliver")
    try:
        for stream in (s.STREAM_REQUESTS, s.STREAM_WORK, s.STREAM_OUTCOMES, s.STREAM_PUBLISH):
            info = await bus.js.stream_info(stream)
            if info.state.messages == 0:
                continue
            latest = await bus.js.get_msg(stream, info.state.last_seq)
            assert latest.subject is not None and latest.data is not None
            await bus.js.publish(latest.subject, latest.data, headers={"Nats-Msg-Id": f"again-{stream}-{latest.seq}"})
    finally:
        await bus.close()


pytestmark = pytest.mark.slow
