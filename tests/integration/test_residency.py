"""More models than adapter slots (two slots here): idle models are paged out, every model is
served, and paging changes nobody's numbers. The planner is configured with six slots: it must
plan with the two the trainer reports (a slot the trainer lacks would fail every unit)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import httpx
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
    env = {
        "TINKERD_NUM_SLOTS": str(SLOTS),
        "TINKERD_PLANNER_NUM_SLOTS": "6",  # wrong on purpose: the planner takes the trainer's count
        "TINKERD_GATEWAY_MAX_LIVE_MODELS_PER_TENANT": "2",
        "TINKERD_GATEWAY_MAX_STORED_BYTES_PER_TENANT": "1",  # one checkpoint fills it
    }
    running = Stack(tmp_path_factory.mktemp("residency"), env_overrides=env).start()
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


def train(client: tinker.ServiceClient, seed: int, loss_fn: types.LossFnType = "cross_entropy") -> list[bytes]:
    """A seeded run: per step forward_backward (`loss_fn`: cross_entropy, or importance_sampling
    with zero sampling logprobs and unit advantages) then optim_step; then a forward of the
    result with the same loss. Returns every logprob array and loss, as bytes, in call order."""
    training = client.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=seed).result()
    rng = np.random.default_rng(seed)
    seen: list[bytes] = []
    for _ in range(STEPS):
        tokens = rng.integers(3, 200, size=12).tolist()
        inputs = {"target_tokens": types.TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64))}
        if loss_fn == "cross_entropy":
            inputs["weights"] = types.TensorData.from_numpy(np.ones(11, dtype=np.float32))
        else:
            inputs["logprobs"] = types.TensorData.from_numpy(np.zeros(11, dtype=np.float32))
            inputs["advantages"] = types.TensorData.from_numpy(np.ones(11, dtype=np.float32))
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)
        out = training.forward_backward([datum, datum], loss_fn).result()
        seen += [o["logprobs"].to_numpy().astype(np.float32).tobytes() for o in out.loss_fn_outputs]
        seen.append(np.float32(out.metrics["loss:sum"]).tobytes())
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    probe_inputs = {"target_tokens": types.TensorData.from_numpy(np.array([4, 5, 6, 7, 8], dtype=np.int64))}
    if loss_fn != "cross_entropy":
        probe_inputs["logprobs"] = types.TensorData.from_numpy(np.zeros(5, dtype=np.float32))
        probe_inputs["advantages"] = types.TensorData.from_numpy(np.ones(5, dtype=np.float32))
    probe = types.Datum(model_input=types.ModelInput.from_ints([3, 4, 5, 6, 7]), loss_fn_inputs=probe_inputs)
    final = training.forward([probe], loss_fn).result()
    seen.append(final.loss_fn_outputs[0]["logprobs"].to_numpy().astype(np.float32).tobytes())
    return seen


def test_more_live_tenants_than_slots_all_finish_and_one_matches_training_alone(stack: Stack) -> None:
    """Three tenants train at once on two slots, so models are paged out between their calls and
    back in (at least one page-in happens): all finish, and the first tenant's every logprob and
    loss, and its final model's, are bit-identical (CPU fp32) to the same seeded training run
    alone on the same stack afterwards. The other two train (and probe) with importance_sampling,
    another loss class, so no unit packs their datums with the first tenant's: datums packed together
    agree with training alone only within fp32 rounding (other GEMM shapes;
    test_training_semantics), while paging itself must change no bit."""
    results: dict[int, list[bytes]] = {}
    errors: list[BaseException] = []

    def tenant(i: int) -> None:
        try:
            with tinker.ServiceClient(base_url=stack.base_url, api_key=f"tml-residency-live-{i}") as client:
                results[i] = train(client, seed=40 + i, loss_fn="cross_entropy" if i == 0 else "importance_sampling")
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


def test_per_tenant_limits_refuse_before_claiming_and_free_up_with_unload_and_delete(stack: Stack) -> None:
    """Live models and stored bytes are limited per tenant (2 models, 1 byte here): the request
    over a limit is a 403 naming it and claims nothing, so after an unload (or a delete) the very
    same request succeeds; other tenants are not affected."""
    http = httpx.Client(base_url=stack.base_url, headers={"X-API-Key": "tml-residency-quota"}, timeout=60)

    def post(path: str, body: dict[str, object]) -> httpx.Response:
        return http.post(path, json=body)

    def result(request_id: str) -> dict[str, object]:
        got: dict[str, object] = {"type": "try_again"}
        while got.get("type") == "try_again":  # each poll waits on the server for the result
            got = post("/api/v1/retrieve_future", {"request_id": request_id}).json()
        return got

    session = post("/api/v1/create_session", {"type": "create_session", "sdk_version": "test"}).json()["session_id"]

    def create(n: int) -> httpx.Response:
        body = {"type": "create_model", "session_id": session, "model_seq_id": n, "base_model": "tiny-qwen3", "lora_config": {"rank": 2}}
        return post("/api/v1/create_model", body)

    models = []
    for n in range(2):
        created = create(n)
        assert created.status_code == 200, created.text
        models.append(result(created.json()["request_id"])["model_id"])
    refused = create(2)
    assert refused.status_code == 403 and "max_live_models_per_tenant" in refused.json()["error"], refused.text
    assert refused.json()["category"] == "user"
    other = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-residency-quota-other")
    assert other.create_lora_training_client(base_model="tiny-qwen3", rank=2).result().model_id  # not affected
    unload = post("/api/v1/unload_model", {"type": "unload_model", "model_id": models[0]})
    assert unload.status_code == 200 and result(unload.json()["request_id"])["model_id"] == models[0]
    again = create(2)  # the same request: nothing was claimed by the refusal
    assert again.status_code == 200 and result(again.json()["request_id"])["model_id"]

    saved = post("/api/v1/save_weights", {"type": "save_weights", "model_id": models[1], "path": "first", "seq_id": 1})
    assert saved.status_code == 200, saved.text
    path = str(result(saved.json()["request_id"])["path"])
    second = {"type": "save_weights", "model_id": models[1], "path": "second", "seq_id": 2}
    over = post("/api/v1/save_weights", second)
    assert over.status_code == 403 and "max_stored_bytes_per_tenant" in over.json()["error"], over.text
    ephemeral = post(
        "/api/v1/save_weights_for_sampler",
        {"type": "save_weights_for_sampler", "model_id": models[1], "seq_id": 2, "sampling_session_seq_id": 0},
    )
    assert ephemeral.status_code == 200, ephemeral.text  # not catalogued: not counted, not refused
    assert result(ephemeral.json()["request_id"])["sampling_session_id"]
    run, _, name = path.removeprefix("tinker://").partition("/weights/")
    deleted = http.delete(f"/api/v1/training_runs/{run}/checkpoints/weights/{name}")
    assert deleted.status_code == 200, deleted.text
    second["seq_id"] = 3
    assert post("/api/v1/save_weights", second).status_code == 200  # room again
