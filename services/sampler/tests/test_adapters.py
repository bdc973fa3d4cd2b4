"""Adapters: loading rules, unload, LRU eviction with transparent reload, and multi-adapter batches."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from services.sampler.engine import HFEngine
from services.sampler.tests.conftest import ADAPTER_NAMES, ATTN_MLP, make_adapter
from tests.hf_reference import HFReference

pytestmark = pytest.mark.numerics  # also run under other thread counts and CPU paths (tests/infra)

PROMPTS = [[11, 17, 300, 45, 987, 12], [40, 5, 6], [1200, 44, 88, 301, 7, 9, 1000, 64], [77, 78], [500] * 5]


def load(client: TestClient, name: str, path: Path | str, **extra: Any) -> Any:
    return client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra})


def greedy_body(prompt: list[int], adapter: str | None, max_new_tokens: int) -> dict[str, Any]:
    return {
        "input_ids": prompt,
        "lora_path": adapter,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens},
    }


def run_held(engine: HFEngine, client: TestClient, bodies: list[dict[str, Any]]) -> list[Any]:
    """Queue every request while admission is held, then release them into one scheduler pass."""
    engine.hold_admission()
    with ThreadPoolExecutor(len(bodies)) as pool:
        try:
            futures = [pool.submit(client.post, "/generate", json=body) for body in bodies]
            queued = engine.wait_until_waiting(len(bodies), timeout=60)
        finally:
            engine.release_admission()
        responses = [f.result() for f in futures]
    assert queued, "requests never reached the engine queue"
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json() for r in responses]


def test_concurrent_requests_for_eight_adapters_are_batched_and_correct(
    client: TestClient, engine: HFEngine, reference: HFReference
) -> None:
    """Eight concurrent requests, one per adapter, prefill as one batch and each matches PEFT."""
    cases = [(PROMPTS[i % len(PROMPTS)], name, 4 + i) for i, name in enumerate(ADAPTER_NAMES)]
    before = engine.counters()
    outs = run_held(engine, client, [greedy_body(p, a, n) for p, a, n in cases])
    after = engine.counters()
    assert after.prefill_batches - before.prefill_batches == 1
    assert after.max_prefill_batch >= 8 and after.max_decode_batch >= 8
    for out, (prompt, adapter, n) in zip(outs, cases, strict=True):
        assert out["output_ids"] == reference.greedy(prompt, adapter, n), adapter


def test_requests_join_a_running_batch_correctly(
    small_client: TestClient, small_engine: HFEngine, adapter_dirs: dict[str, Path], reference: HFReference
) -> None:
    """With two batch slots, a third request joins mid-flight (KV merge) and all three stay exact."""
    for name in ("ad0", "ad1", "ad2"):
        assert load(small_client, f"join-{name}", adapter_dirs[name]).status_code == 200
    cases = [(PROMPTS[2], "ad0", 3), (PROMPTS[0], "ad1", 14), (PROMPTS[1], "ad2", 8)]
    before = small_engine.counters()
    outs = run_held(small_engine, small_client, [greedy_body(p, f"join-{a}", n) for p, a, n in cases])
    after = small_engine.counters()
    assert after.prefill_batches - before.prefill_batches == 2  # two admitted together, one joined later
    assert after.prefill_joins - before.prefill_joins == 1
    assert after.max_decode_batch == 2
    for out, (prompt, adapter, n) in zip(outs, cases, strict=True):
        assert out["output_ids"] == reference.greedy(prompt, adapter, n), adapter


def test_lru_eviction_then_transparent_reload(
    small_client: TestClient, small_engine: HFEngine, adapter_dirs: dict[str, Path], reference: HFReference
) -> None:
    """Past max_loaded_loras the least recently used adapter is evicted; using it reloads it."""

    def resident() -> list[str]:
        info = small_client.get("/server_info").json()
        return [name for name in info["resident_lora_adapters"] if name.startswith("lru-")]

    before = small_engine.counters()
    assert load(small_client, "lru-a", adapter_dirs["ad5"]).status_code == 200
    assert load(small_client, "lru-b", adapter_dirs["ad6"]).status_code == 200
    assert small_client.post("/generate", json=greedy_body(PROMPTS[0], "lru-a", 2)).status_code == 200
    assert resident() == ["lru-b", "lru-a"]  # least recently used first

    resp = load(small_client, "lru-c", adapter_dirs["ad7"])
    assert resp.status_code == 200
    assert {"lru-a", "lru-b", "lru-c"} <= set(resp.json()["loaded_adapters"])  # evicted is still servable
    assert resident() == ["lru-a", "lru-c"]

    out = small_client.post("/generate", json=greedy_body(PROMPTS[1], "lru-b", 6))
    assert out.status_code == 200
    assert out.json()["output_ids"] == reference.greedy(PROMPTS[1], "ad6", 6)
    assert resident() == ["lru-c", "lru-b"]
    after = small_engine.counters()
    assert after.adapter_loads - before.adapter_loads == 4  # a, b, c, then b again
    assert after.adapter_evictions - before.adapter_evictions >= 2


def test_pinned_adapters_are_never_evicted(small_client: TestClient, adapter_dirs: dict[str, Path]) -> None:
    """A pinned adapter survives pressure; when every slot is pinned a new load fails cleanly."""
    assert load(small_client, "pin-a", adapter_dirs["ad3"], pinned=True).status_code == 200
    assert load(small_client, "pin-x", adapter_dirs["ad4"]).status_code == 200
    assert load(small_client, "pin-y", adapter_dirs["ad5"]).status_code == 200
    assert "pin-a" in small_client.get("/server_info").json()["resident_lora_adapters"]
    assert load(small_client, "pin-b", adapter_dirs["ad6"], pinned=True).status_code == 200
    resp = load(small_client, "pin-z", adapter_dirs["ad7"])
    assert resp.status_code == 400 and "pinned" in resp.json()["error_message"]
    for name in ("pin-a", "pin-b"):
        assert small_client.post("/unload_lora_adapter", json={"lora_name": name}).status_code == 200


def test_unload_stops_serving_the_name(client: TestClient, adapter_dirs: dict[str, Path]) -> None:
    """After unload the name is gone: generate is 400 and a second unload fails."""
    assert load(client, "tmp", adapter_dirs["ad1"]).status_code == 200
    assert client.post("/generate", json=greedy_body(PROMPTS[0], "tmp", 2)).status_code == 200
    resp = client.post("/unload_lora_adapter", json={"lora_name": "tmp"})
    assert resp.status_code == 200
    body = resp.json()
    assert (
        body["success"] is True and "tmp" not in body["loaded_adapters"] and "ad0" in body["loaded_adapters"]
    )
    gen = client.post("/generate", json=greedy_body(PROMPTS[0], "tmp", 2))
    assert gen.status_code == 400 and "tmp" in gen.json()["error"]["message"]
    again = client.post("/unload_lora_adapter", json={"lora_name": "tmp"})
    assert again.status_code == 400 and again.json()["success"] is False


@pytest.fixture(scope="module")
def bad_adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad-adapters")
    empty = root / "empty"
    empty.mkdir()
    return {
        "rank": make_adapter(model_dir, root / "rank", seed=1, rank=80, targets=ATTN_MLP),
        "embed": make_adapter(model_dir, root / "embed", seed=2, rank=4, targets=["embed_tokens", "q_proj"]),
        "empty": empty,
    }


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("rank", "max_lora_rank"),
        ("embed", "embed_tokens"),
        ("empty", "adapter_model.safetensors"),
        ("missing", "does not exist"),
    ],
)
def test_bad_adapters_are_refused_with_400(
    client: TestClient, bad_adapters: dict[str, Path], case: str, needle: str
) -> None:
    """Rank above the limit, unsupported targets, incomplete or missing directories: success false."""
    path = bad_adapters.get(case, Path("/nonexistent/adapter"))
    resp = load(client, f"bad-{case}", path)
    assert resp.status_code == 400
    body = resp.json()
    assert body["success"] is False and needle in body["error_message"], body["error_message"]
    assert f"bad-{case}" not in body["loaded_adapters"]


def test_adapter_names_are_immutable(client: TestClient, adapter_dirs: dict[str, Path]) -> None:
    """Loading an existing name again is refused (SGLang requires unload first)."""
    resp = load(client, "ad0", adapter_dirs["ad1"])
    assert resp.status_code == 400 and "already loaded" in resp.json()["error_message"]
