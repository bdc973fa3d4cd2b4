"""The catalogue as RestClient and the CLI see it: runs, checkpoints, publishing, TTLs, deletion,
signed downloads, sessions and the operator views, on one stack with a known signing secret and a
fast checkpoint reaper.
"""

from __future__ import annotations

import asyncio
import io
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx
import pytest
import tinker
from nats.js.kv import KV_DEL, KV_PURGE
from tinker import types

from infra.bus import Bus
from libs.contracts import ids
from libs.contracts import subjects as s
from services.gateway.catalog import downloads
from tests.harness import Stack

SECRET = "test-signing-secret"
OWNER, OTHER = "tml-catalog-owner", "tml-catalog-other"
S = SimpleNamespace()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {"TINKERD_GATEWAY_SIGNING_SECRET": SECRET, "TINKERD_PUBLISHER_REAP_INTERVAL_S": "0.2"}
    running = Stack(tmp_path_factory.mktemp("catalog"), env_overrides=env).start()
    try:
        yield running
    finally:
        running.stop()


def http(stack: Stack, key: str = OWNER) -> httpx.Client:
    return httpx.Client(base_url=stack.base_url, headers={"X-API-Key": key}, timeout=60)


def status(response: httpx.Response, code: int) -> Any:
    assert response.status_code == code, response.text
    return response.json()


def checkpoint_url(path: str, suffix: str = "") -> str:
    run, _, checkpoint_id = path.removeprefix("tinker://").partition("/")
    return f"/api/v1/training_runs/{run}/checkpoints/{checkpoint_id}{suffix}"


def test_setup_runs_with_checkpoints(stack: Stack) -> None:
    service = tinker.ServiceClient(base_url=stack.base_url, api_key=OWNER, user_metadata={"suite": "catalog"})
    S.service = service
    S.runs = []
    for rank in (2, 3, 4):
        training = service.create_lora_training_client(
            base_model="tiny-qwen3",
            rank=rank,
            user_metadata={"renderer_name": "role_colon", "rank": str(rank)},
        ).result()
        S.runs.append(training.model_id)
    S.training = training
    S.state = training.save_state("state", user_metadata={"note": "first"}).result().path
    S.sampler = training.save_weights_for_sampler("sampler").result().path
    S.external = training.save_weights_external("export").result().path


def test_runs_are_listed_newest_first_and_paged(stack: Stack) -> None:
    client = http(stack)
    first = status(client.get("/api/v1/training_runs", params={"limit": 2, "offset": 0}), 200)
    assert [r["training_run_id"] for r in first["training_runs"]] == S.runs[::-1][:2]
    assert first["cursor"] == {"offset": 0, "limit": 2, "total_count": 3}
    rest = status(client.get("/api/v1/training_runs", params={"limit": 2, "offset": 2}), 200)
    assert [r["training_run_id"] for r in rest["training_runs"]] == [S.runs[0]]
    assert (
        "limit must be in [1, 1000]"
        in status(client.get("/api/v1/training_runs", params={"limit": 0}), 400)["error"]
    )


def test_a_run_carries_its_metadata_and_last_checkpoints(stack: Stack) -> None:
    run = tinker.RestClient(base_url=stack.base_url, api_key=OWNER).get_training_run(S.runs[-1]).result()
    assert run.user_metadata == {"renderer_name": "role_colon", "rank": "4"}
    assert run.lora_rank == 4 and run.is_lora and run.base_model == "tiny-qwen3"
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == S.state
    assert run.last_checkpoint.user_metadata == {"note": "first"}
    assert run.last_sampler_checkpoint is not None and run.last_sampler_checkpoint.tinker_path == S.sampler
    assert run.last_request_time >= run.last_checkpoint.time
    empty = tinker.RestClient(base_url=stack.base_url, api_key=OWNER).get_training_run(S.runs[0]).result()
    assert empty.last_checkpoint is None and empty.last_sampler_checkpoint is None


def test_weights_info_for_every_kind(stack: Stack) -> None:
    client = http(stack)
    for path in (S.state, S.sampler, S.external):
        info = status(client.post("/api/v1/weights_info", json={"tinker_path": path}), 200)
        assert info["lora_rank"] == 4 and info["is_lora"] and info["base_model"] == "tiny-qwen3"
    assert (
        "must start with tinker://"
        in status(client.post("/api/v1/weights_info", json={"tinker_path": "x"}), 400)["error"]
    )


def test_other_tenants_see_nothing_until_published(stack: Stack) -> None:
    other, run = http(stack, OTHER), S.training.model_id
    assert status(other.get("/api/v1/training_runs"), 200)["training_runs"] == []
    assert status(other.get("/api/v1/checkpoints"), 200)["checkpoints"] == []
    for path in (f"/api/v1/training_runs/{run}", f"/api/v1/training_runs/{run}/checkpoints"):
        assert "not found" in status(other.get(path), 404)["error"]
    status(http(stack).post(checkpoint_url(S.sampler, "/publish")), 200)
    visible = status(other.get(f"/api/v1/training_runs/{run}/checkpoints"), 200)["checkpoints"]
    assert [c["tinker_path"] for c in visible] == [S.sampler] and visible[0]["public"] is True
    assert status(other.get(f"/api/v1/training_runs/{run}", params={"access_scope": "accessible"}), 200)
    assert status(other.get(f"/api/v1/training_runs/{run}", params={"access_scope": "owned"}), 404)
    listed = status(other.get("/api/v1/training_runs", params={"access_scope": "accessible"}), 200)
    assert [r["training_run_id"] for r in listed["training_runs"]] == [run]
    assert "not found" in status(other.post(checkpoint_url(S.sampler, "/publish")), 404)["error"]
    assert "not found" in status(other.delete(checkpoint_url(S.sampler)), 404)["error"]
    sampler = tinker.ServiceClient(base_url=stack.base_url, api_key=OTHER).create_sampling_client(
        model_path=S.sampler
    )
    assert (
        sampler.result()
        .sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2))
        .result()
    )
    status(http(stack).delete(checkpoint_url(S.sampler, "/publish")), 200)
    assert (
        "not found"
        in status(other.post("/api/v1/weights_info", json={"tinker_path": S.sampler}), 404)["error"]
    )


def checkpoint_dirs(stack: Stack, path: str) -> list[Path]:
    run, segment, name = path.removeprefix("tinker://").split("/")
    base = stack.data_dir / "checkpoints" / ids.token(run) / segment
    return [p for p in (base / name, *(base / ".versions").glob(f"{name}@*")) if p.exists() or p.is_symlink()]


def test_delete_removes_record_link_and_versions_and_a_second_delete_is_404(stack: Stack) -> None:
    doomed = S.training.save_state("doomed").result().path
    assert len(checkpoint_dirs(stack, doomed)) == 2  # the public name and one version
    client = http(stack)
    status(client.delete(checkpoint_url(doomed)), 200)
    assert checkpoint_dirs(stack, doomed) == []
    assert doomed not in {
        c["tinker_path"] for c in status(client.get("/api/v1/checkpoints"), 200)["checkpoints"]
    }
    assert "not found" in status(client.delete(checkpoint_url(doomed)), 404)["error"]
    assert status(client.delete("/api/v1/training_runs/s-unknown:train:0/checkpoints/weights/x"), 404)


async def wait_deleted(nats_url: str, key: str, timeout_s: float = 60) -> None:
    """Until the catalogue key is deleted (a KV watch: woken by the delete, no polling)."""
    bus = await Bus.connect(nats_url, "test-catalog")
    watcher = await (await bus.kv(s.KV_CHECKPOINTS)).watch(key)

    async def gone() -> None:
        async for entry in watcher:
            if entry is not None and entry.operation in (KV_DEL, KV_PURGE):
                return

    try:
        await asyncio.wait_for(gone(), timeout_s)
    finally:
        await watcher.stop()
        await bus.close()


def test_ttl_sets_expiry_and_the_reaper_deletes_expired_checkpoints(stack: Stack) -> None:
    client = http(stack)
    kept = status(client.put(checkpoint_url(S.state, "/ttl"), json={"ttl_seconds": 3600}), 200)
    assert kept["expires_at"] is not None
    assert (
        status(client.put(checkpoint_url(S.state, "/ttl"), json={"ttl_seconds": None}), 200)["expires_at"]
        is None
    )
    assert (
        "ttl_seconds must be > 0"
        in status(client.put(checkpoint_url(S.state, "/ttl"), json={"ttl_seconds": 0}), 400)["error"]
    )
    brief = S.training.save_state("brief").result().path
    status(client.put(checkpoint_url(brief, "/ttl"), json={"ttl_seconds": 1}), 200)
    run, _, name = brief.removeprefix("tinker://").split("/")
    asyncio.run(wait_deleted(stack.nats_url, f"{ids.token(run)}.training.{name}"))
    assert checkpoint_dirs(stack, brief) == []
    assert brief not in {
        c["tinker_path"] for c in status(client.get("/api/v1/checkpoints"), 200)["checkpoints"]
    }


def test_signed_urls_download_every_file(stack: Stack) -> None:
    body = status(http(stack).get(checkpoint_url(S.external, "/external_weights_urls")), 200)
    version = next(p for p in checkpoint_dirs(stack, S.external) if "@" in p.name)
    assert set(body["urls"]) == {p.name for p in version.iterdir()}
    for name, url in body["urls"].items():
        assert httpx.get(url).content == (version / name).read_bytes()  # no API key: the signature is enough
    S.url = body["urls"]["adapter_config.json"]


def test_downloads_refuse_bad_or_expired_signatures(stack: Stack) -> None:
    parts = urlsplit(S.url)
    query = dict(item.split("=") for item in parts.query.split("&"))
    base = f"{stack.base_url}{parts.path}"
    assert "signature is invalid" in status(httpx.get(base, params={**query, "sig": "0" * 64}), 403)["error"]
    assert "not signed" in status(httpx.get(base), 403)["error"]
    relative, past = unquote(parts.path.removeprefix("/api/v1/downloads/")), int(time.time()) - 10
    expired = {"expires": str(past), "sig": downloads.signature(SECRET.encode(), relative, past)}
    assert "expired" in status(httpx.get(base, params=expired), 403)["error"]
    tampered = {**query, "expires": str(int(query["expires"]) + 60)}
    assert "signature is invalid" in status(httpx.get(base, params=tampered), 403)["error"]


def test_archive_is_a_tar_of_the_checkpoint(stack: Stack) -> None:
    archive = status(http(stack).get(checkpoint_url(S.state, "/archive")), 200)
    response = httpx.get(archive["url"])
    assert response.status_code == 200 and int(response.headers["content-length"]) == len(response.content)
    with tarfile.open(fileobj=io.BytesIO(response.content)) as tar:
        names = set(tar.getnames())
    version = next(p for p in checkpoint_dirs(stack, S.state) if "@" in p.name)
    assert names == {p.name for p in version.iterdir()}


def test_sessions_list_their_runs_and_samplers(stack: Stack) -> None:
    client, session_id = http(stack), S.service.holder.get_session_id()
    assert session_id in status(client.get("/api/v1/sessions"), 200)["sessions"]
    session = status(client.get(f"/api/v1/sessions/{session_id}"), 200)
    assert session["training_run_ids"] == S.runs and session["user_metadata"] == {"suite": "catalog"}
    S.training.save_weights_and_get_sampling_client().result()
    assert status(client.get(f"/api/v1/sessions/{session_id}"), 200)["sampler_ids"]
    status(client.put(f"/api/v1/sessions/{session_id}/project", json={"project_id": "p1"}), 200)
    other = http(stack, OTHER)
    assert session_id not in status(other.get("/api/v1/sessions"), 200)["sessions"]
    assert "not found" in status(other.get(f"/api/v1/sessions/{session_id}"), 404)["error"]
    assert (
        "not found"
        in status(other.put(f"/api/v1/sessions/{session_id}/project", json={"project_id": "p"}), 404)["error"]
    )


def test_operator_status_and_metrics(stack: Stack) -> None:
    report = status(httpx.get(f"{stack.base_url}/api/v1/operator/status"), 200)
    assert set(S.runs) <= {m["model_id"] for m in report["models"]}
    assert report["trainers"] and s.STREAM_REQUESTS in report["streams"] and report["consumers"]
    text = httpx.get(f"{stack.base_url}/metrics").text
    assert 'tinkerd_gateway_requests_accepted_total{kind="save_weights"}' in text
    assert 'tinkerd_gateway_requests_completed_total{kind="save_weights",outcome="ok"}' in text
    assert "tinkerd_gateway_futures_waiting " in text and "tinkerd_gateway_sampling_permits_in_use 0" in text


def test_close(stack: Stack) -> None:
    S.service.close("success").result()
