"""Two trainer groups (one adapter slot each) behind one planner: models are placed across both,
a model moves between groups through an exported page-out without changing its numbers, and a
group killed -9 and held down is not placed on while its resident model is taken over by the
other group and continues exactly (more tenants, mid-unit: test_takeover.py). (Two base models
at once: test_base_models.py.)"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from infra.bus import Bus, kv_scan, last_seq, replay
from libs.contracts import codec
from libs.contracts import subjects as s
from libs.contracts.events import SlotAssigned
from libs.contracts.records import ModelQueueRecord
from tests.harness import Stack, groups_live_listener

GROUPS = ("a", "b")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {
        "TINKERD_TRAINER_GROUPS": ",".join(GROUPS),
        "TINKERD_NUM_SLOTS": "1",
        "TINKERD_TRAINER_HEARTBEAT_S": "0.5",
        "TINKERD_PLANNER_GROUP_TIMEOUT_S": "3",
    }
    # no sampler or publisher: nothing here samples or saves (and the trainers start faster)
    services = ("trainer", "planner", "gateway")
    live, on_line = groups_live_listener(GROUPS)

    running = Stack(
        tmp_path_factory.mktemp("groups"), services=services, env_overrides=env, listeners=[on_line]
    ).start()
    # A trainer is ready before the planner has read its first heartbeat: placement by load needs
    # the planner to know both groups, so the tests start once it has said so for each.
    for group, seen in live.items():
        assert seen.wait(60), f"the planner never saw trainer group {group} live"
    try:
        yield running
    finally:
        running.stop()


def _read(stack: Stack) -> tuple[dict[str, ModelQueueRecord], list[SlotAssigned]]:
    async def read() -> tuple[dict[str, ModelQueueRecord], list[SlotAssigned]]:
        bus = await Bus.connect(stack.nats_url, "test-groups")
        found: list[SlotAssigned] = []
        try:
            records = {
                r.model_id: r
                for r in (codec.from_json(v, ModelQueueRecord) for v in (await kv_scan(bus, s.KV_PLANNER)).values())
            }
            last = await last_seq(bus, s.STREAM_EVENTS)

            def keep(msg: object) -> None:
                event = codec.event_decoder.decode(msg.data)  # type: ignore[attr-defined]
                if isinstance(event, SlotAssigned):
                    found.append(event)

            await replay(bus, s.STREAM_EVENTS, "tinker.events.slot_assigned.>", last, keep)
        finally:
            await bus.close()
        return records, found

    return asyncio.run(read())


def group_of(stack: Stack, model_id: str) -> str:
    return _read(stack)[0][model_id].group


def assignments(stack: Stack, model_id: str) -> list[SlotAssigned]:
    return [e for e in _read(stack)[1] if e.model_id == model_id]


def unload(stack: Stack, api_key: str, model_id: str) -> None:
    """unload_model over HTTP (the SDK has no call for it), waiting for its result."""
    with httpx.Client(base_url=stack.base_url, headers={"X-API-Key": api_key}, timeout=60) as http:
        posted = http.post("/api/v1/unload_model", json={"type": "unload_model", "model_id": model_id})
        assert posted.status_code == 200, posted.text
        got: dict[str, object] = {"type": "try_again"}
        while got.get("type") == "try_again":  # each poll waits on the server for the result
            got = http.post("/api/v1/retrieve_future", json={"request_id": posted.json()["request_id"]}).json()
        assert got.get("model_id") == model_id, got


def batch(rng: np.random.Generator) -> list[types.Datum]:
    tokens = rng.integers(3, 200, size=12).tolist()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64)),
            "weights": types.TensorData.from_numpy(np.ones(11, dtype=np.float32)),
        },
    )
    return [datum, datum]


class Run:
    """A seeded training run, one step at a time: every logprob and loss, as bytes, in call order."""

    def __init__(self, client: tinker.ServiceClient, seed: int, base_model: str = "tiny-qwen3") -> None:
        self.training = client.create_lora_training_client(base_model=base_model, rank=4, seed=seed).result()
        self.rng = np.random.default_rng(seed)
        self.seen: list[bytes] = []

    @property
    def model_id(self) -> str:
        return str(self.training.model_id)

    def step(self) -> None:
        out = self.training.forward_backward(batch(self.rng), "cross_entropy").result()
        self.seen += [o["logprobs"].to_numpy().astype(np.float32).tobytes() for o in out.loss_fn_outputs]
        self.seen.append(np.float32(out.metrics["loss:sum"]).tobytes())
        self.training.optim_step(types.AdamParams(learning_rate=1e-2)).result()


def run_alone(stack: Stack, seed: int, steps: int) -> tuple[str, list[bytes]]:
    with tinker.ServiceClient(base_url=stack.base_url, api_key=f"tml-groups-alone-{seed}") as client:
        run = Run(client, seed)
        for _ in range(steps):
            run.step()
        return run.model_id, run.seen


def test_a_model_moved_to_another_group_trains_exactly_as_one_that_never_moved(stack: Stack) -> None:
    """mx trains a step on its group; a filler takes the other group's slot and a second filler's
    create pages mx out (exported: two groups serve its base); the first filler unloads, so mx's
    next step pages it in on the other group from the export (a slot_assigned event with moved).
    Its logprobs and losses are bit-identical to the same seeded run alone, which never moved."""
    with tinker.ServiceClient(base_url=stack.base_url, api_key="tml-groups-mover") as client:
        mx = Run(client, seed=7)
        mx.step()
        home = group_of(stack, mx.model_id)
        filler = client.create_lora_training_client(base_model="tiny-qwen3", rank=4).result()
        other = group_of(stack, str(filler.model_id))
        assert {home, other} == set(GROUPS)  # the free slot of the other group, not a page-out
        evictor = client.create_lora_training_client(base_model="tiny-qwen3", rank=4).result()
        assert group_of(stack, mx.model_id) == home and _read(stack)[0][mx.model_id].paged
        unload(stack, "tml-groups-mover", str(filler.model_id))
        mx.step()
        mx.step()
        assert group_of(stack, mx.model_id) == other
        moves = [e for e in assignments(stack, mx.model_id) if e.moved]
        assert [(e.group, e.reason) for e in moves] == [(other, "page_in")]
        moved = mx.seen
        unload(stack, "tml-groups-mover", str(evictor.model_id))
    alone_id, alone = run_alone(stack, seed=7, steps=3)
    assert not any(e.moved for e in assignments(stack, alone_id))
    assert moved == alone


def test_four_tenants_at_once_are_spread_over_both_groups_and_all_finish(stack: Stack) -> None:
    """Four tenants train two steps each at once on two one-slot groups: every run finishes, and
    the creates were placed on both groups (the placement balances by load)."""
    results: dict[int, tuple[str, list[bytes]]] = {}
    errors: list[BaseException] = []

    def tenant(i: int) -> None:
        try:
            results[i] = run_alone(stack, seed=100 + i, steps=2)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=tenant, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors, errors
    assert sorted(results) == [0, 1, 2, 3]
    created_on = {e.group for model_id, _ in results.values() for e in assignments(stack, model_id) if e.reason == "create"}
    assert created_on == set(GROUPS)


def test_a_group_killed_and_held_down_is_not_placed_on_and_its_resident_model_is_taken_over(
    stack: Stack,
) -> None:
    """kill -9 of the group holding model p, kept down: once the planner marks it lost, a new model
    is created and trains on the live group; p's next step is taken over by the live group (a
    slot_assigned `takeover` from the dead group; the idle newcomer is paged out to make room)
    and completes while the dead group is still down. The group comes back and p trains one more
    step, still on the live group. p's numbers equal the same seeded run alone bit for bit: with
    one slot per group its datums were never packed with another tenant's, so the rebuild re-ran
    the very same units, and nothing was lost or applied twice."""
    lost = threading.Event()
    with tinker.ServiceClient(base_url=stack.base_url, api_key="tml-groups-victim") as client:
        p = Run(client, seed=21)
        p.step()
        dead = group_of(stack, p.model_id)
        live = next(g for g in GROUPS if g != dead)
        stack.listeners.append(
            lambda service, line: lost.set() if service == "planner" and f"trainer group {dead} " in line and "LOST" in line else None
        )
        stack.stop_service(f"trainer@{dead}")
        assert lost.wait(60), "the planner never marked the killed group lost"
        newcomer = Run(client, seed=22)
        newcomer.step()
        assert group_of(stack, newcomer.model_id) == live
        p.step()
        assert group_of(stack, p.model_id) == live
        takeovers = [e for e in assignments(stack, p.model_id) if e.reason == "takeover"]
        assert [(e.group, e.from_group) for e in takeovers] == [(live, dead)]
        back = stack.start_service(f"trainer@{dead}")
        assert back.wait(240)
        p.step()
        assert group_of(stack, p.model_id) == live
        survived = p.seen
    _, alone = run_alone(stack, seed=21, steps=3)
    assert survived == alone
