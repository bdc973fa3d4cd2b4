"""A session whose heartbeats stop (its process died) is expired: its models are unloaded, its
futures still answer, its checkpoints stay, and a late heartbeat is told 410."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from infra.bus import Bus
from libs.contracts import codec, ids
from libs.contracts import subjects as s
from tests.harness import Stack
from tests.integration.test_residency import events

EXPIRY_S = 25  # above the SDK's 10 s heartbeat period, so live clients are never expired
KEY = "tml-expiry-leaver"

LEAVER = textwrap.dedent(
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
    fb = training.forward_backward([datum], "cross_entropy")
    fb.result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    path = training.save_state("before-expiry").result().path
    print(client.holder.get_session_id(), training.model_id, path, flush=True)
    os._exit(0)  # dies: its heartbeats stop
    """
)


def wait_for_event(stack: Stack, kind: str, match: Callable[[Any], bool], timeout_s: float = 180) -> object:
    """The first operation event of `kind` (from the stream's start) that `match`es."""

    async def wait() -> object:
        bus = await Bus.connect(stack.nats_url, "test-expiry")
        found: asyncio.Future[object] = asyncio.get_running_loop().create_future()

        async def on_event(msg: Any) -> None:
            event = codec.event_decoder.decode(msg.data)
            if match(event) and not found.done():
                found.set_result(event)

        sub = await bus.js.subscribe(f"tinker.events.{kind}.>", stream=s.STREAM_EVENTS, ordered_consumer=True, cb=on_event)
        try:
            return await asyncio.wait_for(found, timeout_s)
        finally:
            await sub.unsubscribe()
            await bus.close()

    return asyncio.run(wait())


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {"TINKERD_GATEWAY_SESSION_EXPIRY_S": str(EXPIRY_S), "TINKERD_GATEWAY_SESSION_REAP_INTERVAL_S": "1"}
    running = Stack(tmp_path_factory.mktemp("expiry"), env_overrides=env).start()
    try:
        yield running
    finally:
        running.stop()


def test_a_session_whose_heartbeats_stop_is_expired_and_what_it_made_survives(stack: Stack) -> None:
    alive = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-expiry-alive")
    alive_model = alive.create_lora_training_client(base_model="tiny-qwen3", rank=4).result()
    done = subprocess.run([sys.executable, "-c", LEAVER, stack.base_url, KEY], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    session_id, model_id, path = done.stdout.split()
    fb_request = f"{model_id}:1"  # request ids are the SDK's own coordinates: the model's seq_id 1

    # the gateway's reaper notices the silence: wait for its event
    expired_event = wait_for_event(stack, "session", lambda e: e.session_id == session_id and e.what == "expired")
    assert expired_event.tenant  # type: ignore[attr-defined]
    with httpx.Client(base_url=stack.base_url, headers={"X-API-Key": KEY}, timeout=60) as http:
        beat = http.post("/api/v1/session_heartbeat", json={"session_id": session_id, "type": "session_heartbeat"})
        assert beat.status_code == 410 and "expired" in beat.json()["error"]
        future = http.post("/api/v1/retrieve_future", json={"request_id": fb_request})
        assert future.status_code == 200 and "loss_fn_outputs" in future.text  # its futures still answer

    # its model was unloaded (the unload ran after what was queued); its checkpoint stays
    unloaded = wait_for_event(stack, "completed", lambda e: e.request_id == ids.unload_request_id(model_id))
    assert unloaded.model_id == model_id  # type: ignore[attr-defined]
    owner = tinker.ServiceClient(base_url=stack.base_url, api_key=KEY)
    assert path in {c.tinker_path for c in owner.create_rest_client().list_user_checkpoints().result().checkpoints}
    resumed = owner.create_training_client_from_state(path)
    assert resumed.model_id != model_id
    # the live session was never expired: its model still trains
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([3, 4, 5]),
        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.array([4, 5, 6], dtype=np.int64))},
    )
    assert alive_model.forward_backward([datum], "cross_entropy").result().loss_fn_outputs
    expired = [e.session_id for e in events(stack, "session") if e.what == "expired"]  # type: ignore[attr-defined]
    assert alive.holder.get_session_id() not in expired
