"""More models than adapter slots (two slots here): idle models are paged out, every model is
served, and paging changes nobody's numbers."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import tinker
from tinker import types

from infra.bus import Bus, last_seq, replay
from libs.contracts import codec
from libs.contracts import subjects as s
from tests.harness import Stack

SLOTS = 2

TENANT_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
    training = client.create_lora_training_client(base_model="tiny-qwen3", rank=4).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([3, 4, 5, 6]),
        loss_fn_inputs={"target_tokens": [4, 5, 6, 7], "weights": [1.0, 1.0, 1.0, 1.0]},
    )
    out = training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    print(training.model_id, len(out.loss_fn_outputs), flush=True)
    os._exit(0)  # leave as a crashed or interrupted script does: no unload, no session finish
    """
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = Stack(tmp_path_factory.mktemp("residency"), env_overrides={"TINKERD_NUM_SLOTS": str(SLOTS)}).start()
    try:
        yield running
    finally:
        running.stop()


def events(stack: Stack, kind: str) -> list[object]:
    """Every operation event of this kind so far (all models)."""

    async def read() -> list[object]:
        bus = await Bus.connect(stack.nats_url, "test-residency")
        found: list[object] = []
        try:
            last = await last_seq(bus, s.STREAM_EVENTS)
            subject = f"tinker.events.{kind}.>"
            # bounded: with no event of this kind at all, the replay would wait for one forever
            await asyncio.wait_for(
                replay(bus, s.STREAM_EVENTS, subject, last, lambda m: found.append(codec.event_decoder.decode(m.data))),
                timeout=30,
            )
        except TimeoutError:
            pass
        finally:
            await bus.close()
        return found

    return asyncio.run(read())


def test_three_times_as_many_tenants_as_slots_leave_without_unloading_and_each_is_served(stack: Stack) -> None:
    """Six tenants one after another, each a process that creates a model, trains one step and
    exits without unloading or finishing its session: every one is served (the idle models of
    the ones before it are paged out to make room)."""
    served = []
    for i in range(3 * SLOTS):
        done = subprocess.run(
            [sys.executable, "-c", TENANT_SCRIPT, stack.base_url, f"tml-residency-leaver-{i}"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        model_id, outputs = done.stdout.split()
        assert outputs == "1"
        served.append(model_id)
    assert len(set(served)) == 3 * SLOTS
    paged_out = {e.model_id for e in events(stack, "model_paged_out")}  # type: ignore[attr-defined]
    assert set(served[: 2 * SLOTS]) <= paged_out  # all but the last two had to make room
    assigned = events(stack, "slot_assigned")
    assert {e.model_id for e in assigned} >= set(served)  # type: ignore[attr-defined]


STEPS = 3


def train(client: tinker.ServiceClient, seed: int) -> list[bytes]:
    """A seeded run: per step forward_backward then optim_step; then a forward of the result.
    Returns every logprob array and loss, as bytes, in call order."""
    training = client.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=seed).result()
    rng = np.random.default_rng(seed)
    seen: list[bytes] = []
    for _ in range(STEPS):
        tokens = rng.integers(3, 200, size=12).tolist()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64)),
                "weights": types.TensorData.from_numpy(np.ones(11, dtype=np.float32)),
            },
        )
        out = training.forward_backward([datum, datum], "cross_entropy").result()
        seen += [o["logprobs"].to_numpy().astype(np.float32).tobytes() for o in out.loss_fn_outputs]
        seen.append(np.float32(out.metrics["loss:sum"]).tobytes())
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    probe = types.Datum(
        model_input=types.ModelInput.from_ints([3, 4, 5, 6, 7]),
        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.array([4, 5, 6, 7, 8], dtype=np.int64))},
    )
    final = training.forward([probe], "cross_entropy").result()
    seen.append(final.loss_fn_outputs[0]["logprobs"].to_numpy().astype(np.float32).tobytes())
    return seen


def test_more_live_tenants_than_slots_all_finish_and_match_training_alone(stack: Stack) -> None:
    """Three tenants train at once on two slots, so models are paged out mid-training (pending
    gradients and all) and back in: all finish, and each one's every logprob and loss, and the
    final model's, are bit-identical (CPU fp32) to the same seeded training run alone."""
    results: dict[int, list[bytes]] = {}
    errors: list[BaseException] = []

    def tenant(i: int) -> None:
        try:
            with tinker.ServiceClient(base_url=stack.base_url, api_key=f"tml-residency-live-{i}") as client:
                results[i] = train(client, seed=40 + i)
        except BaseException as exc:
            errors.append(exc)

    before = len(events(stack, "model_paged_in"))
    threads = [threading.Thread(target=tenant, args=(i,)) for i in range(SLOTS * 3 // 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors, errors
    assert sorted(results) == list(range(len(threads)))
    assert len(events(stack, "model_paged_in")) > before  # paging did happen
    with tinker.ServiceClient(base_url=stack.base_url, api_key="tml-residency-alone") as client:
        alone = train(client, seed=40)
    assert alone == results[0]
