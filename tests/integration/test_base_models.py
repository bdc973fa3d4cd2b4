"""Two base models of different shapes (tiny-qwen3 and tiny-qwen3-narrow) in one deployment, each
with its own trainer group (group q and group n, one adapter slot each): both train at once through
the SDK, an unknown base is a 400, and a create for a base whose only group is down waits with a
clear queue state."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
import tinker

from tests.harness import Stack
from tests.integration.test_groups import Run, group_of

NARROW = "tiny-qwen3-narrow"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {
        "TINKERD_TRAINER_GROUPS": f"q=tiny-qwen3,n={NARROW}",
        "TINKERD_GATEWAY_EXTRA_BASE_MODELS": NARROW,
        "TINKERD_NUM_SLOTS": "1",
        "TINKERD_TRAINER_HEARTBEAT_S": "0.5",
        "TINKERD_PLANNER_GROUP_TIMEOUT_S": "3",
    }
    services = ("trainer", "planner", "gateway")  # nothing here samples or saves
    running = Stack(tmp_path_factory.mktemp("bases"), services=services, env_overrides=env).start()
    try:
        yield running
    finally:
        running.stop()


def test_two_base_models_train_at_once_each_on_its_own_group_and_an_unknown_base_is_a_400(stack: Stack) -> None:
    """Capabilities list both base models; a tiny-qwen3 and a tiny-qwen3-narrow model train at
    once, each placed on a group of its base (its shape differs: the losses differ too); an unknown
    base is a 400 naming base_model; with the narrow group held down and marked lost, a create for
    it waits (try_again, queue_state paused_capacity, a reason naming the base). (A lost group's
    resident models are taken over by another group of their base: test_groups.py and
    test_takeover.py.)"""
    with tinker.ServiceClient(base_url=stack.base_url, api_key="tml-groups-bases") as client:
        rest = tinker.RestClient(base_url=stack.base_url, api_key="tml-groups-bases")
        capabilities = rest.get_server_capabilities().result()
        served = {m.model_name for m in capabilities.supported_models}
        assert served == {"tiny-qwen3", NARROW}
        runs: dict[str, Run] = {}

        def start(base: str) -> None:
            runs[base] = Run(client, seed=5, base_model=base)
            runs[base].step()

        threads = [threading.Thread(target=start, args=(base,)) for base in ("tiny-qwen3", NARROW)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert sorted(runs) == sorted(["tiny-qwen3", NARROW])
        assert group_of(stack, runs[NARROW].model_id) == "n"
        assert group_of(stack, runs["tiny-qwen3"].model_id) == "q"
        assert runs[NARROW].seen != runs["tiny-qwen3"].seen  # same seed and data, another model

    with httpx.Client(base_url=stack.base_url, headers={"X-API-Key": "tml-groups-bases-http"}, timeout=60) as http:
        session = http.post("/api/v1/create_session", json={"type": "create_session", "sdk_version": "test"}).json()

        def create(seq: int, base: str) -> httpx.Response:
            body = {
                "type": "create_model",
                "session_id": session["session_id"],
                "model_seq_id": seq,
                "base_model": base,
                "lora_config": {"rank": 2},
            }
            return http.post("/api/v1/create_model", json=body)

        unknown = create(0, "no-such-model")
        assert unknown.status_code == 400 and "base_model" in unknown.json()["error"], unknown.text
        assert unknown.json()["category"] == "user"

        lost = threading.Event()
        stack.listeners.append(
            lambda service, line: lost.set() if service == "planner" and "trainer group n " in line and "LOST" in line else None
        )
        stack.stop_service("trainer@n")
        assert lost.wait(60), "the planner never marked group n lost"
        posted = create(1, NARROW)
        assert posted.status_code == 200, posted.text
        request_id = posted.json()["request_id"]
        waiting = http.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
        while waiting.get("queue_state") == "active":  # until the planner's queue record is read
            waiting = http.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
        assert waiting["type"] == "try_again" and waiting["queue_state"] == "paused_capacity", waiting
        assert NARROW in waiting["queue_state_reason"] and "no trainer group" in waiting["queue_state_reason"]
