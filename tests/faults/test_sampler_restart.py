"""Fault tests: the sampling engine dies or stays down while tenants train, save and sample.

Each tenant runs an RL-style loop through the official SDK: a few optimizer steps, then a save for
the sampler (ephemeral and named, alternating) and a greedy sample from the new weights, again and
again. The sampler is killed (SIGKILL) in the middle of it. Pass criteria:

- every SDK call completes: no save fails because the engine is down, no sample fails because
  its engine restarted (it waits for it);
- every sample equals the same sample of a run without the fault. The reference is an
  independent run of the same loop on the same stack, under its own tenants, before any fault.

The stack plans every datum as its own work unit (token budget 1), so the trained weights do not
depend on how the tenants' requests happen to interleave, and greedy samples can be compared
token for token across runs.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import tinker
from tinker import types

from infra.bus import Bus
from libs.contracts import codec, ids
from libs.contracts import subjects as s
from libs.contracts.records import QueueRecord
from tests.harness import Stack
from tests.sdk import tenant_datum

TENANTS = 3
STEPS = 4
SAVE_EVERY = 2  # steps between saves for the sampler
PROMPT = [5, 6, 7]
GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0)
HOLD_TIMEOUT_S = 300.0
RESTART_TIMEOUT_S = 240.0


@dataclass
class LoopRun:
    tenant: int
    samples: list[list[int]] = field(default_factory=list)
    saves: int = 0
    error: BaseException | None = None


def rl_loop(base_url: str, label: str, run: LoopRun) -> None:
    """Train, save for the sampler every SAVE_EVERY steps, sample the new weights after each save."""
    try:
        client = tinker.ServiceClient(base_url=base_url, api_key=f"tml-{label}-{run.tenant}")
        trainer = client.create_lora_training_client(
            base_model="tiny-qwen3", rank=4, seed=100 + run.tenant
        ).result()
        for step in range(STEPS):
            batch = [tenant_datum(run.tenant, step, 0), tenant_datum(run.tenant, step, 1)]
            trainer.forward_backward(batch, "cross_entropy").result()
            trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            if (step + 1) % SAVE_EVERY:
                continue
            if run.saves % 2 == 0:  # ephemeral: the sampler waits for the save itself
                sampler = trainer.save_weights_and_get_sampling_client().result()
            else:  # named: a tinker:// path, then a sampler for it
                path = trainer.save_weights_for_sampler(f"{label}-{step}").result().path
                sampler = trainer.create_sampling_client(path).result()
            run.saves += 1
            out = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=GREEDY)
            run.samples.append(list(out.result().sequences[0].tokens))
    except BaseException as exc:
        run.error = exc


def run_loops(base_url: str, label: str) -> list[LoopRun]:
    runs = [LoopRun(t) for t in range(TENANTS)]
    threads = [threading.Thread(target=rl_loop, args=(base_url, label, r)) for r in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return runs


def assert_no_errors(runs: list[LoopRun], stack: Stack) -> None:
    errors = [(r.tenant, repr(r.error)) for r in runs if r.error is not None]
    assert not errors, f"{errors}\n{stack.dump_logs()}"


def check_against(runs: list[LoopRun], reference: dict[int, list[list[int]]], stack: Stack) -> None:
    assert_no_errors(runs, stack)
    for run in runs:
        assert run.saves == STEPS // SAVE_EVERY
        assert run.samples == reference[run.tenant], f"tenant {run.tenant}: samples differ from the fault-free run"


class Watcher:
    """Follows the bus from a background thread: operation events and waiting samples.

    `when(predicate, action)` calls `action` once, on its own thread, the first time `predicate`
    holds; `wait_for(predicate)` blocks until it holds. Both are woken by the messages themselves.
    """

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self.cond = threading.Condition()
        self.completed: list[str] = []  # kinds of RequestCompleted, in arrival order
        self.published: list[str] = []  # model ids of CheckpointPublished, in arrival order
        self.paused: dict[str, QueueRecord] = {}  # sample request id -> record, while it waits
        self.paused_ever: dict[str, QueueRecord] = {}
        self._triggers: list[tuple[Callable[[Watcher], bool], Callable[[], None]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watcher:
        subscribed = threading.Event()

        async def main() -> None:
            bus = await Bus.connect(self.nats_url, "sampler-restart-watch")

            async def on_event(msg) -> None:  # type: ignore[no-untyped-def]
                kind = msg.subject.split(".")[2]
                body = json.loads(msg.data)
                with self.cond:
                    if kind == "completed":
                        self.completed.append(str(body.get("kind")))
                    elif kind == "checkpoint_published":
                        self.published.append(str(body.get("model_id")))
                    self._changed()

            await bus.nc.subscribe(s.EVENTS_ALL, cb=on_event)
            kv = await bus.kv(s.KV_QUEUE)
            watcher = await kv.watchall()
            await bus.nc.flush()
            subscribed.set()

            async def follow_queue() -> None:
                async for entry in watcher:
                    if entry is None or ":sample:" not in ids.untoken(entry.key):
                        continue
                    request_id = ids.untoken(entry.key)
                    with self.cond:
                        if entry.value:
                            record = codec.from_json(entry.value, QueueRecord)
                            self.paused[request_id] = self.paused_ever[request_id] = record
                        else:
                            self.paused.pop(request_id, None)
                        self._changed()

            follower = asyncio.create_task(follow_queue())
            await asyncio.get_running_loop().run_in_executor(None, self._stop.wait)
            follower.cancel()
            await watcher.stop()
            await bus.close()

        self._thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
        self._thread.start()
        assert subscribed.wait(30), "could not subscribe to the bus"
        return self

    def _changed(self) -> None:
        """Under `cond`: fire due triggers, wake waiters."""
        for trigger in list(self._triggers):
            predicate, action = trigger
            if predicate(self):
                self._triggers.remove(trigger)
                threading.Thread(target=action, daemon=True).start()
        self.cond.notify_all()

    def when(self, predicate: Callable[[Watcher], bool], action: Callable[[], None]) -> None:
        with self.cond:
            self._triggers.append((predicate, action))

    def wait_for(self, predicate: Callable[[Watcher], bool], timeout_s: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: predicate(self), timeout_s)

    def waiting_sessions(self) -> set[str]:
        """Sessions (one per tenant) with a sample waiting for the engine right now."""
        return {rid.split(":sample:")[0] for rid, r in self.paused.items() if r.queue_state == "paused_capacity"}

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)


def poll_as_the_owner(base_url: str, label: str, request_id: str) -> dict[str, object]:
    """One `retrieve_future` for `request_id`, with the key of whichever tenant owns it."""
    for tenant in range(TENANTS):
        headers = {"X-API-Key": f"tml-{label}-{tenant}"}
        got = httpx.post(
            f"{base_url}/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers, timeout=60
        )
        if got.status_code != 404:
            return dict(got.json())
    return {"status": "not found for any tenant"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {
        "TINKERD_PLANNER_TOKEN_BUDGET": "1",
        "TINKERD_GATEWAY_RETRIEVE_WAIT_S": "3",  # a pending future answers try_again after 3 s
    }
    running = Stack(tmp_path_factory.mktemp("sampler-restart"), env_overrides=env)
    running.start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def reference(stack: Stack) -> dict[int, list[list[int]]]:
    """The fault-free run: the same loops, own tenants, nothing killed."""
    runs = run_loops(stack.base_url, "reference")
    errors = [(r.tenant, repr(r.error)) for r in runs if r.error is not None]
    assert not errors, f"the fault-free run failed: {errors}\n{stack.dump_logs()}"
    return {r.tenant: r.samples for r in runs}


def test_sampler_killed_mid_loop_every_call_completes_with_the_same_samples(
    stack: Stack, reference: dict[int, list[list[int]]]
) -> None:
    """kill -9 of the sampler when this run's first snapshot is published; `tinkerd up`'s supervisor
    restarts it. Samples that meet the dead engine wait for it (at least one does), every save and
    every sample completes, and the samples equal the fault-free run's."""
    watch = Watcher(stack.nats_url).start()
    restarted = threading.Event()

    def kill() -> None:
        ready = stack.kill("sampler")
        if ready.wait(RESTART_TIMEOUT_S):
            restarted.set()

    try:
        watch.when(lambda w: len(w.published) >= 1, kill)
        runs = run_loops(stack.base_url, "killed")
    finally:
        watch.stop()
    assert restarted.is_set(), "the sampler was not killed and restarted during the run"
    assert watch.paused_ever, "no sample ever waited for the engine: the kill missed the samples"
    check_against(runs, reference, stack)


def test_sampler_down_across_saves_saves_complete_and_samples_wait(
    stack: Stack, reference: dict[int, list[list[int]]]
) -> None:
    """The sampler is killed when this run's first optim_step completes and kept down until every
    tenant has saved for the sampler since then and has a sample waiting; then it starts again.
    Every save made while it was down completed while it was down; each waiting sample's future
    answered `try_again` with `paused_capacity` and a reason naming the engine; every sample
    completes, and the samples equal the fault-free run's."""
    watch = Watcher(stack.nats_url).start()
    stopped = threading.Event()
    down_state: dict[str, object] = {}

    def stop_then_start() -> None:
        stack.stop_service("sampler")
        with watch.cond:
            down_state["published_before"] = len(watch.published)
        stopped.set()

        def all_saved_and_waiting(w: Watcher) -> bool:
            saved = set(w.published[int(down_state["published_before"]) :])  # type: ignore[call-overload]
            return len(saved) >= TENANTS and len(w.waiting_sessions()) >= TENANTS

        down_state["held"] = watch.wait_for(all_saved_and_waiting, HOLD_TIMEOUT_S)
        with watch.cond:
            down_state["saved_while_down"] = set(watch.published[int(down_state["published_before"]) :])  # type: ignore[call-overload]
            down_state["waiting"] = dict(watch.paused)
        polls = [
            threading.Thread(
                target=lambda rid=rid: down_state.setdefault(f"poll:{rid}", poll_as_the_owner(stack.base_url, "stopped", rid))
            )
            for rid in down_state["waiting"]  # type: ignore[attr-defined]
        ]
        for poll in polls:
            poll.start()
        for poll in polls:
            poll.join()
        down_state["restarted"] = stack.start_service("sampler").wait(RESTART_TIMEOUT_S)

    try:
        watch.when(lambda w: "optim_step" in w.completed, stop_then_start)
        runs = run_loops(stack.base_url, "stopped")
        # A waiting sample's record is deleted before its result is appended: none may be left.
        cleared = watch.wait_for(lambda w: not w.paused, 30.0)
    finally:
        watch.stop()
    assert_no_errors(runs, stack)
    assert stopped.is_set(), "the sampler was never stopped"
    assert down_state.get("held"), (
        f"while the sampler was down, not every tenant saved and then waited on a sample: "
        f"published {watch.published}, waiting {sorted(watch.paused)}\n{stack.dump_logs()}"
    )
    assert down_state.get("restarted"), "the sampler did not come back"
    saved = down_state["saved_while_down"]
    assert isinstance(saved, set) and len(saved) >= TENANTS, "every tenant's save completed with the engine down"
    waiting = down_state["waiting"]
    assert isinstance(waiting, dict)
    for request_id, record in waiting.items():
        assert record.queue_state == "paused_capacity"
        assert "sampling engine is unavailable" in record.reason, record.reason
        answer = down_state[f"poll:{request_id}"]  # what the SDK's poll got while the engine was down
        assert isinstance(answer, dict)
        assert answer.get("type") == "try_again" and answer.get("queue_state") == "paused_capacity", answer
        assert "sampling engine is unavailable" in str(answer.get("queue_state_reason")), answer
    assert cleared, f"samples still marked as waiting after they completed: {sorted(watch.paused)}"
    check_against(runs, reference, stack)


pytestmark = pytest.mark.slow
