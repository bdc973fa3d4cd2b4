"""What `tinkerd events` and `tinkerd status` show: read-only views of the bus."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import msgspec
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from infra import stack_state
from infra.bus import Bus
from infra.status import collect_status
from libs.contracts import codec
from libs.contracts import subjects as s
from libs.contracts.events import describe


def format_event(msg: Msg) -> str:
    try:
        event = codec.event_decoder.decode(msg.data)
    except msgspec.DecodeError:
        return f"{msg.subject} {msg.data[:200]!r}"
    stamp = time.strftime("%H:%M:%S", time.localtime(event.at_ns / 1e9)) if event.at_ns else "--:--:--"
    return f"{stamp} {describe(event)}"


async def watch_events(nats_url: str, replay: bool = False, subject: str = s.EVENTS_ALL) -> None:
    """Print every operation event as one readable line until interrupted."""
    bus = await Bus.connect(nats_url, "events")

    async def show(msg: Msg) -> None:
        print(format_event(msg), flush=True)

    if replay:
        await bus.js.subscribe(
            subject, stream=s.STREAM_EVENTS, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL, cb=show
        )
    else:
        await bus.nc.subscribe(subject, cb=show)  # the same messages `nats sub 'tinker.events.>'` shows
    try:
        await asyncio.Event().wait()
    finally:
        await bus.close()


def print_services(state_file: Path) -> None:
    """The supervised services' states (`tinkerd up`'s stack state file), one line each."""
    stack = stack_state.read_state(state_file)
    if stack is None:
        print(f"services: no stack running for this data directory ({state_file} is missing or stale)")
        return
    print(f"services (tinkerd up, pid {stack.supervisor_pid}):")
    now = time.time_ns()
    for name, service in stack.services.items():
        print(f"  {stack_state.describe(name, service)} (for {(now - service.since_ns) / 1e9:.0f}s)")
    sys.stdout.flush()


async def print_status(nats_url: str, state_file: Path | None = None) -> None:
    if state_file is not None:
        print_services(state_file)  # first: it needs no NATS, which may be what is down
    st = await collect_status(nats_url)
    print("trainers:")
    for t in st.trainers:
        print(
            f"  {t.trainer_id:<24} group={t.group} ready={t.ready} slots={t.slots_used}/{t.num_slots} "
            f"base={t.base_model} work_seq={t.last_work_seq} snapshot_through={t.snapshot_work_seq}"
        )
    open_sessions = sum(1 for x in st.sessions if not x.finished)
    print(f"sessions: {len(st.sessions)} ({open_sessions} open)")
    resident = sum(1 for p in st.planner.values() if p.slot is not None and not p.closed)
    paged = sum(1 for p in st.planner.values() if p.paged and not p.closed)
    print(f"models: {resident} resident, {paged} paged out")
    for m in st.models:
        state = " (unloaded)" if m.unloaded else ""
        commands = st.commands_per_model.get(m.model_id, 0)
        plan = st.planner.get(m.model_id)
        residency = "" if plan is None else ("paged" if plan.paged else "resident" if plan.slot is not None else "")
        where = f"slot={plan.slot} queued={plan.queued}" if plan else "slot=? queued=?"
        where += f" {residency}" if residency else ""
        if plan and plan.waiting_for_seq is not None:
            where += f" waiting_for_seq={plan.waiting_for_seq} (+{plan.buffered} ahead)"
        newest = st.newest_checkpoint.get(m.model_id, "-")
        print(
            f"  {m.model_id:<32} tenant={m.tenant:<20} rank={m.lora.rank} {where} "
            f"commands={commands} newest_checkpoint={newest}{state}"
        )
    if st.waiting:
        print("waiting:")
        now = time.time_ns()
        for r in st.waiting:
            print(f"  {r.request_id:<40} {r.queue_state} for {(now - r.since_ns) / 1e9:.0f}s: {r.reason}")
    print("streams:")
    for name, info in st.streams.items():
        print(f"  {name:<18} messages={info['messages']:<8} bytes={info['bytes']}")
    print("consumers (lag = pending):")
    for name, info in st.consumers.items():
        print(
            f"  {name:<40} pending={info['pending']:<6} ack_pending={info['ack_pending']:<4} redelivered={info['redelivered']}"
        )
