"""Two gateway replicas on one NATS: any replica answers anything, exactly once.

One stack runs two gateways (`gateway`, `gateway-1`) on their own ports. Every test sends the
same request to both, or alternates replicas call by call, and checks what one gateway alone
promises: one model per (session, model_seq_id), one request per (model, seq_id), the same 422 for
a reused seq_id and the same 400 for a refused one at either replica, every future answered at
either replica, and credentials minted by one replica (JWTs, signed download URLs) accepted by
the other. Raw HTTP (the JSON bodies SDKs <= 0.24 send) pins the seq_ids; the official SDK runs
one client per replica on the same model's checkpoints.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from infra.bus import Bus, kv_scan
from libs.contracts import ids
from libs.contracts import subjects as s
from tests.faults.checks import exactly_once
from tests.harness import Stack
from tests.sdk import json_datum

VOCAB = 2048  # tiny-qwen3


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = Stack(tmp_path_factory.mktemp("replicas"), gateways=2).start()
    try:
        yield running
    finally:
        running.stop()


class Replicas:
    """One tenant's raw HTTP clients, one per gateway replica (`at(i)`)."""

    def __init__(self, stack: Stack, key: str) -> None:
        self.clients = [
            httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=120) for url in stack.base_urls
        ]

    def at(self, replica: int) -> httpx.Client:
        return self.clients[replica % len(self.clients)]

    def result(self, replica: int, request_id: str) -> dict[str, Any]:
        """Long-poll retrieve_future at one replica until the result is there."""
        while True:
            got = self.at(replica).post("/api/v1/retrieve_future", json={"request_id": request_id})
            assert got.status_code == 200, got.text
            body: dict[str, Any] = got.json()
            if body.get("type") != "try_again":
                return body


def datum(seed: int) -> dict[str, Any]:
    return json_datum([(seed * 37 + 11 * i) % VOCAB for i in range(9)])


def fb_body(model_id: str, seq: int, seed: int) -> dict[str, Any]:
    return {
        "forward_backward_input": {"data": [datum(seed)], "loss_fn": "cross_entropy"},
        "model_id": model_id,
        "seq_id": seq,
    }


def create_model(api: Replicas, replica: int, session: str, seq: int = 0) -> httpx.Response:
    body = {"session_id": session, "model_seq_id": seq, "base_model": "tiny-qwen3", "lora_config": {"rank": 2}}
    return api.at(replica).post("/api/v1/create_model", json=body)


def session_at(api: Replicas, replica: int) -> str:
    response = api.at(replica).post("/api/v1/create_session", json={"tags": [], "sdk_version": "test"})
    assert response.status_code == 200, response.text
    return str(response.json()["session_id"])


def kv_keys(stack: Stack, bucket: str, prefix: str) -> list[str]:
    async def scan() -> list[str]:
        bus = await Bus.connect(stack.nats_url, "test-replicas")
        try:
            return sorted(k for k in await kv_scan(bus, bucket) if k.startswith(prefix))
        finally:
            await bus.close()

    return asyncio.run(scan())


def test_a_create_sent_to_both_replicas_makes_one_model(stack: Stack) -> None:
    """A session made at replica 0 is known at replica 1; the same create_model at both gives the
    same model id, and KV holds one model for that (session, model_seq_id)."""
    api = Replicas(stack, "tml-replicas-create")
    session = session_at(api, 0)
    beat = api.at(1).post("/api/v1/session_heartbeat", json={"session_id": session})
    assert beat.status_code == 200, beat.text
    first, second = create_model(api, 0, session), create_model(api, 1, session)
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    model_id = first.json()["model_id"]
    assert second.json()["model_id"] == model_id
    assert kv_keys(stack, s.KV_MODELS, ids.token(session)) == [ids.token(model_id)]


def test_seq_ids_sent_to_both_replicas_run_once_and_answer_at_either(stack: Stack) -> None:
    """Each of four forward_backward seq_ids is sent to one replica and retried at the other: both
    answers carry the same request id, each future is read at the replica that did not take it
    first, the results equal those of the same calls on a second model through one replica only,
    KV holds one claim per seq_id, and the streams show nothing planned, run or answered twice."""
    api = Replicas(stack, "tml-replicas-seq")
    model_id = create_model(api, 0, session_at(api, 0)).json()["model_id"]
    reference_id = create_model(api, 1, session_at(api, 1)).json()["model_id"]
    got, want = [], []
    for seq in range(1, 5):
        first = seq % 2  # alternate which replica sees the call first
        a = api.at(first).post("/api/v1/forward_backward", json=fb_body(model_id, seq, seq))
        b = api.at(first + 1).post("/api/v1/forward_backward", json=fb_body(model_id, seq, seq))
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        assert a.json()["request_id"] == b.json()["request_id"]
        got.append(api.result(first + 1, a.json()["request_id"]))
        ref = api.at(1).post("/api/v1/forward_backward", json=fb_body(reference_id, seq, seq))
        want.append(api.result(1, ref.json()["request_id"]))
    assert [g["loss_fn_outputs"] for g in got] == [w["loss_fn_outputs"] for w in want]
    claims = kv_keys(stack, s.KV_SEQ, ids.token(model_id) + ".")
    assert claims == sorted(ids.seq_key(model_id, n) for n in range(5))  # 0 is the create itself
    report = exactly_once(stack.nats_url)
    assert report.clean, report


def test_reused_and_refused_seq_ids_answer_the_same_at_both_replicas(stack: Stack) -> None:
    """seq_id 1 reused with other content is 422 at both replicas; seq_id 2 with a target token
    outside the vocabulary is the same 400 at both, and still consumes its seq_id: seq_id 3,
    sent to the replica that did not refuse it first, runs."""
    api = Replicas(stack, "tml-replicas-refuse")
    model_id = create_model(api, 0, session_at(api, 0)).json()["model_id"]
    ok = api.at(0).post("/api/v1/forward_backward", json=fb_body(model_id, 1, 1))
    assert ok.status_code == 200, ok.text
    for replica in (0, 1):
        reused = api.at(replica).post("/api/v1/forward_backward", json=fb_body(model_id, 1, 99))
        assert reused.status_code == 422, reused.text
        assert "seq_id 1" in reused.json()["error"]
    bad = fb_body(model_id, 2, 2)
    bad["forward_backward_input"]["data"][0]["loss_fn_inputs"]["target_tokens"]["data"][0] = VOCAB + 5
    refusals = [api.at(replica).post("/api/v1/forward_backward", json=bad) for replica in (1, 0)]
    assert [r.status_code for r in refusals] == [400, 400], [r.text for r in refusals]
    assert refusals[0].json() == refusals[1].json()
    after = api.at(0).post("/api/v1/forward_backward", json=fb_body(model_id, 3, 3))
    assert after.status_code == 200, after.text
    assert "loss_fn_outputs" in api.result(1, after.json()["request_id"])


def test_a_jwt_and_a_signed_url_from_one_replica_work_at_the_other(stack: Stack) -> None:
    """With no configured signing secret, the replicas share the one the first stored: a JWT
    minted by replica 0 authenticates at replica 1, and a checkpoint's signed archive URL handed
    out by replica 0 downloads from replica 1."""
    api = Replicas(stack, "tml-replicas-secret")
    token = api.at(0).post("/api/v1/auth/token").json()["jwt"]
    me = httpx.get(f"{stack.base_urls[1]}/api/v1/auth/apikey/me", headers={"X-API-Key": token}, timeout=30)
    assert me.status_code == 200, me.text
    service = tinker.ServiceClient(base_url=stack.base_urls[0], api_key="tml-replicas-secret")
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=2).result()
    path = training.save_state("replicas").result().path
    run_id, segment, name = path.removeprefix("tinker://").split("/")
    archive = api.at(0).get(f"/api/v1/training_runs/{run_id}/checkpoints/{segment}/{name}/archive")
    assert archive.status_code == 200, archive.text
    url = httpx.URL(archive.json()["url"]).copy_with(port=stack.ports[1])
    download = httpx.get(url, timeout=60)
    assert download.status_code == 200, download.text[:200]
    assert len(download.content) > 0


def test_sdk_clients_on_two_replicas_share_one_model(stack: Stack, tmp_path: Path) -> None:
    """An SDK client at replica 0 trains and saves for sampling; an SDK client at replica 1
    samples from that path and loads the saved state into a new training run of its own."""
    trainer_side = tinker.ServiceClient(base_url=stack.base_urls[0], api_key="tml-replicas-sdk")
    training = trainer_side.create_lora_training_client(base_model="tiny-qwen3", rank=2, seed=3).result()
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
            loss_fn_inputs={
                "target_tokens": types.TensorData(data=[6, 7, 8, 9], dtype="int64", shape=[4]),
                "weights": types.TensorData(data=[1.0] * 4, dtype="float32", shape=[4]),
            },
        )
    ]
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler_path = training.save_weights_for_sampler("replicas-sampler").result().path
    state_path = training.save_state("replicas-state").result().path
    other_side = tinker.ServiceClient(base_url=stack.base_urls[1], api_key="tml-replicas-sdk")
    sampling = other_side.create_sampling_client(model_path=sampler_path).result()
    sampled = sampling.sample(
        types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=3, seed=1)
    ).result()
    assert len(sampled.sequences[0].tokens) == 3
    resumed = other_side.create_training_client_from_state(state_path).result()
    assert resumed.model_id != training.model_id
    assert resumed.forward(data, "cross_entropy").result().loss_fn_outputs
