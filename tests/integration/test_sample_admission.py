"""Sampling permits never leak: an accepted sample holds its permits from the claim until its
result, and an enqueue that fails gives them back at once, leaving the claim for the retry.

Raw HTTP against a small real stack (gateway and sampler). The event log really refuses the job:
the sample stream's message size limit is lowered below the job's size, then restored.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from infra.bus import Bus
from infra.streams import ensure_streams
from libs.contracts import subjects as s
from tests.harness import Stack


def _limit_job_size(nats_url: str, max_bytes: int | None) -> None:
    """Lower the sample stream's message size limit (None: back to the declared streams)."""

    async def run() -> None:
        bus = await Bus.connect(nats_url, "test-admission")
        try:
            if max_bytes is None:
                await ensure_streams(bus.js)
            else:
                info = await bus.js.stream_info(s.STREAM_SAMPLES)
                info.config.max_msg_size = max_bytes
                await bus.js.update_stream(info.config)
        finally:
            await bus.close()

    asyncio.run(run())


def test_a_failed_enqueue_gives_its_permits_back_and_the_retry_samples(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The job's append is refused: the caller gets a 503 in the SDK's error shape, no permit stays
    held, and the SDK's retry (same body, same seq_id) finds the claim, enqueues the job and gets
    the sample; once the result is in, no permit is held."""
    stack = Stack(tmp_path, services=("gateway", "sampler")).start()
    try:
        http = httpx.Client(base_url=stack.base_url, headers={"X-API-Key": "tml-permits"}, timeout=60)

        def post(path: str, body: dict[str, Any]) -> httpx.Response:
            return http.post(path, json=body)

        def permits() -> int:
            return int(http.get("/api/v1/operator/status").json()["gateway"]["sampling_permits_in_use"])

        session = post("/api/v1/create_session", {"type": "create_session", "sdk_version": "test"}).json()["session_id"]
        sampler = post(
            "/api/v1/create_sampling_session",
            {"type": "create_sampling_session", "session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny-qwen3"},
        ).json()["sampling_session_id"]
        body = {
            "type": "sample",
            "sampling_session_id": sampler,
            "seq_id": 1,
            "num_samples": 3,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
            "sampling_params": {"max_tokens": 3, "temperature": 0.0},
        }

        _limit_job_size(stack.nats_url, 64)
        refused = post("/api/v1/asample", body)
        assert refused.status_code == 503, refused.text
        assert set(refused.json()) >= {"error", "category"} and refused.json()["category"] == "server"
        assert permits() == 0, "the refused enqueue kept its sampling permits"

        _limit_job_size(stack.nats_url, None)
        accepted = post("/api/v1/asample", body)
        assert accepted.status_code == 200, accepted.text
        request_id = accepted.json()["request_id"]
        while (result := post("/api/v1/retrieve_future", {"request_id": request_id}).json()).get("type") == "try_again":
            pass  # each poll is held by the server until the result or its wait runs out
        assert len(result["sequences"]) == 3, result
        assert permits() == 0, "permits are still held after the result"
    finally:
        stack.stop()


def test_a_cancelled_sample_stops_generating_frees_its_permits_and_answers_cancelled(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A long greedy sample is cancelled mid-generation (cancel_future, as the SDK sends it for an
    abandoned future): its future answers a `user` failure saying so, the engine's batch empties
    well before the requested tokens were generated, and no sampling permit stays held. Cancelling
    it again is a no-op, another tenant's cancel is a 404, and retrieve_futures is a 400."""
    stack = Stack(tmp_path, services=("gateway", "sampler")).start()
    try:
        http = httpx.Client(base_url=stack.base_url, headers={"X-API-Key": "tml-cancel"}, timeout=60)
        engine = httpx.Client(base_url=stack.sampler_url, timeout=60)

        def post(path: str, body: dict[str, Any]) -> httpx.Response:
            return http.post(path, json=body)

        def counters() -> dict[str, int]:
            return engine.get("/server_info").json()["internal_states"][0]  # type: ignore[no-any-return]

        assert http.post("/api/v1/client/dynamic_config", json={"sdk_version": "t"}).json()["sample_cancel_enabled"]
        session = post("/api/v1/create_session", {"type": "create_session", "sdk_version": "test"}).json()["session_id"]
        sampler = post(
            "/api/v1/create_sampling_session",
            {"type": "create_sampling_session", "session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny-qwen3"},
        ).json()["sampling_session_id"]
        max_tokens, samples = 1_500, 2
        accepted = post(
            "/api/v1/asample",
            {
                "type": "sample",
                "sampling_session_id": sampler,
                "seq_id": 1,
                "num_samples": samples,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0},
            },
        )
        assert accepted.status_code == 200, accepted.text
        request_id = accepted.json()["request_id"]
        while counters()["generated_tokens"] == 0:  # wait until it is decoding (a condition, polled)
            pass
        cancelled = post("/api/v1/cancel_future", {"request_id": request_id})
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        result = post("/api/v1/retrieve_future", {"request_id": request_id}).json()
        assert result["category"] == "user" and "cancelled by the client" in result["error"], result
        while counters()["running_sequences"]:  # the engine drops the rows at its next step
            pass
        assert counters()["generated_tokens"] < max_tokens * samples  # it stopped early
        assert counters()["finished_sequences"] == 0
        status = http.get("/api/v1/operator/status").json()["gateway"]
        assert status["sampling_permits_in_use"] == 0
        again = post("/api/v1/cancel_future", {"request_id": request_id})
        assert again.status_code == 200 and again.json()["status"] == "ok"  # already answered: a no-op
        other = httpx.post(
            f"{stack.base_url}/api/v1/cancel_future", json={"request_id": request_id}, headers={"X-API-Key": "tml-other"}
        )
        assert other.status_code == 404  # another tenant's future does not exist for it
        assert post("/api/v1/retrieve_futures", {"prev_cursor": 0}).status_code == 400
    finally:
        stack.stop()
