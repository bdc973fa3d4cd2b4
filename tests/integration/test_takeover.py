"""A trainer group that dies has its resident models taken over by another group (docs/operations.md,
"A lost group"): two tenants on group a, a's trainer wedged mid-unit and then killed -9 and held
down; their next calls complete on group b, their numbers agree with a fault-free reference within
the fp32 bound, nothing runs twice, and a's return doubles nothing."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from infra.bus import Bus, kv_scan, last_seq, replay
from libs.contracts import codec
from libs.contracts import subjects as s
from libs.contracts.events import SlotAssigned
from libs.contracts.records import ModelQueueRecord
from libs.contracts.work import AdoptSlot, BarrierUnit, Unit, WorkUnit
from libs.faults import fired
from services.trainer.state import snapshots
from tests.faults.checks import exactly_once
from tests.harness import Stack, groups_live_listener
from tests.integration.test_training_semantics import BASE, Reference, batch, logprobs
from tests.numerics import assert_within

LR = 1e-4  # as in test_training_semantics: the base model's magnitudes bound the trained model's
HANG = "trainer.executing@7:hang"
"""Group a runs, one at a time: two creates, then tenant 1's and tenant 2's first
forward_backward and optim_step (4 units); its 7th unit is tenant 1's second forward_backward."""
SEEDS = (11, 22)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    data = tmp_path_factory.mktemp("takeover")
    env = {
        "TINKERD_TRAINER_GROUPS": "a,b",
        "TINKERD_NUM_SLOTS": "2",
        "TINKERD_TRAINER_HEARTBEAT_S": "0.5",
        "TINKERD_PLANNER_GROUP_TIMEOUT_S": "3",
        "TINKERD_TRAINER_SNAPSHOT_EVERY_STEPS": "2",  # a's snapshot after the first step of both
        "TINKERD_GATEWAY_RETRIEVE_WAIT_S": "3",
    }
    faults = {"TINKERD_FAULT_POINTS": HANG, "TINKERD_FAULT_DIR": str(data / "faults")}
    live, on_line = groups_live_listener(("a", "b"))

    running = Stack(
        data,
        services=("trainer", "planner", "gateway"),
        env_overrides=env,
        child_env={"trainer@a": faults},
        listeners=[on_line],
    ).start()
    for group, seen in live.items():
        assert seen.wait(60), f"the planner never saw trainer group {group} live"
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def reference_model(stack: Stack) -> Reference:
    return Reference(Path(stack.data_dir) / "models" / BASE)


class Streams:
    """What the streams say: units by group, outcomes, slot assignments, model records."""

    def __init__(self, stack: Stack) -> None:
        self.units: list[Unit] = []
        self.outcomes: set[str] = set()
        self.assigned: list[SlotAssigned] = []
        self.records: dict[str, ModelQueueRecord] = {}
        asyncio.run(self._read(stack))

    async def _read(self, stack: Stack) -> None:
        bus = await Bus.connect(stack.nats_url, "test-takeover")
        try:
            self.records = {
                r.model_id: r
                for r in (codec.from_json(v, ModelQueueRecord) for v in (await kv_scan(bus, s.KV_PLANNER)).values())
            }

            def unit(msg: object) -> None:
                self.units.append(codec.unit_decoder.decode(msg.data))  # type: ignore[attr-defined]

            def outcome(msg: object) -> None:
                self.outcomes.add(codec.outcome_decoder.decode(msg.data).unit_id)  # type: ignore[attr-defined]

            def event(msg: object) -> None:
                got = codec.event_decoder.decode(msg.data)  # type: ignore[attr-defined]
                if isinstance(got, SlotAssigned):
                    self.assigned.append(got)

            await replay(bus, s.STREAM_WORK, s.WORK_ALL, await last_seq(bus, s.STREAM_WORK), unit)
            await replay(bus, s.STREAM_OUTCOMES, s.OUTCOMES_ALL, await last_seq(bus, s.STREAM_OUTCOMES), outcome)
            await replay(
                bus, s.STREAM_EVENTS, "tinker.events.slot_assigned.>", await last_seq(bus, s.STREAM_EVENTS), event
            )
        finally:
            await bus.close()

    def groups_that_ran(self, request_id: str) -> list[str]:
        """The group of every unit with an outcome that served `request_id`."""
        out = []
        for unit in self.units:
            requests = (
                {i.request_id for i in unit.items} if isinstance(unit, WorkUnit) else {op.request_id for op in unit.ops}
            )
            if request_id in requests and unit.unit_id in self.outcomes:
                out.append(unit.group)
        return out

    def adoptions(self) -> list[AdoptSlot]:
        return [op for u in self.units if isinstance(u, BarrierUnit) for op in u.ops if isinstance(op, AdoptSlot)]


class Tenant:
    """A seeded run: its batches, its step losses, and the request ids of its calls."""

    def __init__(self, stack: Stack, seed: int, vocab: int, key: str) -> None:
        self.client = tinker.ServiceClient(base_url=stack.base_url, api_key=key)
        self.training = self.client.create_lora_training_client(base_model=BASE, rank=8, seed=seed).result()
        rng = np.random.default_rng(seed)
        self.batches = [batch(rng, vocab, (7, 5)) for _ in range(4)]
        self.probe = batch(rng, vocab, (6,))
        self.losses: list[float] = []

    @property
    def model_id(self) -> str:
        return str(self.training.model_id)

    def step(self, k: int) -> None:
        fb = self.training.forward_backward(self.batches[k], "cross_entropy")
        optim = self.training.optim_step(types.AdamParams(learning_rate=LR))
        self.losses.append(fb.result().metrics["loss:sum"])
        optim.result()

    def probed(self) -> list[np.ndarray]:
        return logprobs(self.training.forward(self.probe, "cross_entropy").result())


def test_a_dead_groups_tenants_are_taken_over_and_train_on_within_fp32_of_a_fault_free_run(
    stack: Stack, reference_model: Reference
) -> None:
    """Tenants t1, t2 live on group a (t0 on b). a's 7th unit (t1's second forward_backward)
    wedges; t2's second forward_backward queues behind it; then a is killed -9 and held down.
    Once the planner marks a lost, one takeover unit on b adopts both (AdoptSlot from a, naming
    the wedged unit as abandoned; t0 is paged out to make room; b rebuilds both from a's snapshot
    of before the wedged unit and the units after it), and every later call of t1 and
    t2 is run by b. Their step losses and final probe logprobs agree with the same seeded calls
    on fresh models that never moved within twice the fp32 bound; no result, unit or outcome is
    doubled and the wedged unit never gets an outcome. Then a comes back: it skips the abandoned
    unit (still no outcome), and one more step of t1 and t2 runs on b, doubling nothing."""
    from libs.models.registry import resolve_base_model

    vocab = resolve_base_model(BASE, stack.data_dir).vocab_size
    lost = threading.Event()
    stack.listeners.append(
        lambda service, line: lost.set() if service == "planner" and "trainer group a " in line and "LOST" in line else None
    )
    adopted: list[str] = []  # b's "adopted <model> from lost group a ..." lines
    stack.listeners.append(
        lambda service, line: adopted.append(line)
        if service == "trainer@b" and "from lost group a" in line and "adopted " in line
        else None
    )
    t1 = Tenant(stack, SEEDS[0], vocab, "tml-takeover-1")
    t0 = Tenant(stack, 5, vocab, "tml-takeover-0")
    t2 = Tenant(stack, SEEDS[1], vocab, "tml-takeover-2")
    placed = Streams(stack).records
    assert (placed[t1.model_id].group, placed[t0.model_id].group, placed[t2.model_id].group) == ("a", "b", "a")
    t1.step(0)
    t2.step(0)
    t0.step(0)

    stack.supervisor.hold("trainer@a")  # type: ignore[union-attr]  # killed below: it stays down
    second = [threading.Thread(target=t.step, args=(1,), daemon=True) for t in (t1, t2)]
    second[0].start()
    fault_dir = Path(stack.data_dir) / "faults"
    while not fired(HANG, fault_dir):  # a wedged: t1's forward_backward is in flight there
        threading.Event().wait(0.05)
    second[1].start()
    deadline = time.monotonic() + 60
    while not snapshots.complete(Path(stack.data_dir), "a"):  # its snapshot after two steps, on disk
        assert time.monotonic() < deadline, "group a never completed its snapshot"
        threading.Event().wait(0.05)
    stack.stop_service("trainer@a")
    assert lost.wait(60), "the planner never marked group a lost"
    for thread in second:
        thread.join(timeout=300)
        assert not thread.is_alive()
    for t in (t1, t2):
        t.step(2)
    moved = {t.model_id: t.probed() for t in (t1, t2)}

    streams = Streams(stack)
    adoptions = streams.adoptions()
    assert sorted(op.model_id for op in adoptions) == sorted([t1.model_id, t2.model_id])
    assert {op.from_group for op in adoptions} == {"a"}
    (abandoned,) = {tuple(op.abandoned) for op in adoptions}
    assert len(abandoned) == 1 and abandoned[0] not in streams.outcomes
    # rebuilt from a's snapshot (taken before the abandoned unit) and the units after it
    assert len(adopted) == 2 and all("(snapshot 0" in line for line in adopted), adopted
    takeovers = [e for e in streams.assigned if e.reason == "takeover"]
    assert sorted((e.model_id, e.group, e.from_group) for e in takeovers) == sorted(
        [(t1.model_id, "b", "a"), (t2.model_id, "b", "a")]
    )
    for t in (t1, t2):
        assert streams.records[t.model_id].group == "b"
        for seq in (3, 4, 5, 6):  # steps 2 and 3: forward_backward, optim_step
            assert streams.groups_that_ran(f"{t.model_id}:{seq}") == ["b"]
    report = exactly_once(stack.nats_url)
    assert report.clean, report

    skipped = threading.Event()
    stack.listeners.append(
        lambda service, line: skipped.set()
        if service == "trainer@a" and f"unit {abandoned[0]} was abandoned when this group was lost" in line
        else None
    )
    back = stack.start_service("trainer@a")
    assert back.wait(240)
    assert skipped.wait(120), "group a never skipped the abandoned unit redelivered to it"
    for t in (t1, t2):
        t.step(3)
    after = Streams(stack)
    assert abandoned[0] not in after.outcomes
    for t in (t1, t2):
        assert after.groups_that_ran(f"{t.model_id}:7") == ["b"]
    report = exactly_once(stack.nats_url)
    assert report.clean, report

    for t, seed in zip((t1, t2), SEEDS, strict=True):
        ref = Tenant(stack, seed, vocab, f"tml-takeover-ref-{seed}")
        for k in range(3):
            ref.step(k)
        probe = ref.probed()
        ref.step(3)
        bounds = [2 * reference_model.ce_loss_bound(b) for b in ref.batches]
        assert_within(t.losses, ref.losses, np.asarray(bounds), f"{t.model_id} step losses")
        for got, want, bound in zip(moved[t.model_id], probe, reference_model.batch_bounds(t.probe), strict=True):
            assert_within(got, want, bound, f"{t.model_id} probe logprobs")
    assert t1.losses[0] != t1.losses[-1]  # the steps moved the weights
