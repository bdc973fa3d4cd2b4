"""Adapter slots are given back: finishing a session (or unload_model) frees its models' slots."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker

from tests.harness import Stack


@pytest.fixture(scope="module")
def two_slot_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {"TINKERD_NUM_SLOTS": "2"}
    running = Stack(tmp_path_factory.mktemp("slots"), env_overrides=env).start()
    try:
        yield running
    finally:
        running.stop()


def test_finishing_a_session_frees_its_slots(two_slot_stack: Stack) -> None:
    """Two slots, two models in a finished session: a third model still gets a slot."""
    with tinker.ServiceClient(base_url=two_slot_stack.base_url, api_key="tml-slots-a") as first:
        for _ in range(2):
            first.create_lora_training_client(base_model="tiny-qwen3", rank=4).result()
    # `with` called sessions/{id}/finish: both models are unloaded once their queues drain.
    second = tinker.ServiceClient(base_url=two_slot_stack.base_url, api_key="tml-slots-b")
    training = second.create_lora_training_client(base_model="tiny-qwen3", rank=4).result()
    assert training.model_id.endswith(":train:0")


def test_unload_model_frees_the_slot_and_closes_the_model(two_slot_stack: Stack, tmp_path: Path) -> None:
    client = tinker.ServiceClient(base_url=two_slot_stack.base_url, api_key="tml-slots-c")
    training = client.create_lora_training_client(base_model="tiny-qwen3", rank=4).result()
    headers = {"X-API-Key": "tml-slots-c"}
    with httpx.Client(base_url=two_slot_stack.base_url, headers=headers, timeout=60) as http:
        future = http.post("/api/v1/unload_model", json={"model_id": training.model_id}).json()
        assert future["request_id"] == f"{training.model_id}:unload"
        done = http.post("/api/v1/retrieve_future", json={"request_id": future["request_id"]}).json()
        while done.get("type") == "try_again":
            done = http.post("/api/v1/retrieve_future", json={"request_id": future["request_id"]}).json()
        assert done == {"model_id": training.model_id, "type": "unload_model"}
        # a later request of that model fails clearly instead of waiting forever
        later = http.post("/api/v1/optim_step", json={"model_id": training.model_id, "seq_id": 1, "adam_params": {}}).json()
        result = http.post("/api/v1/retrieve_future", json={"request_id": later["request_id"]}).json()
        while result.get("type") == "try_again":
            result = http.post("/api/v1/retrieve_future", json={"request_id": later["request_id"]}).json()
        assert result["category"] == "user" and "unloaded" in result["error"]
