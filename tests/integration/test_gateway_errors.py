"""Every error the gateway promises: its HTTP status and its message.

Raw HTTP against the real stack (JSON bodies, the form SDKs <= 0.24 send), plus the official SDK
where it surfaces the error itself. Limits, overload and keys-file mode run on a second, small
stack (gateway only) with lowered limits and a keys file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
import tinker
from tinker import types

from services.gateway.accounts.auth import KeyRing, add_key, check_bind
from services.gateway.http.errors import Unauthorized
from tests.harness import Stack

VOCAB = 2048  # tiny-qwen3
CONTEXT = 2048


class S:
    """State shared by tests that run in file order."""

    sampler_id = ""


class Api:
    """One tenant's raw HTTP view of the gateway."""

    def __init__(self, base_url: str, key: str) -> None:
        self.http = httpx.Client(base_url=base_url, headers={"X-API-Key": key}, timeout=60)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.http.post(path, json=body)

    def session(self) -> str:
        return str(
            self.post("/api/v1/create_session", {"tags": [], "sdk_version": "test"}).json()["session_id"]
        )

    def model(self, rank: int = 2) -> str:
        body = {
            "session_id": self.session(),
            "model_seq_id": 0,
            "base_model": "tiny-qwen3",
            "lora_config": {"rank": rank},
        }
        response = self.post("/api/v1/create_model", body)
        assert response.status_code == 200, response.text
        return str(response.json()["model_id"])

    def fwdbwd(
        self, model_id: str, seq: int, data: list[dict[str, Any]], loss_fn: str = "cross_entropy"
    ) -> httpx.Response:
        payload = {
            "forward_backward_input": {"data": data, "loss_fn": loss_fn},
            "model_id": model_id,
            "seq_id": seq,
        }
        return self.post("/api/v1/forward_backward", payload)

    def result(self, request_id: str) -> dict[str, Any]:
        """Long-poll retrieve_future until the result is there (the server holds each poll)."""
        while True:
            response = self.post("/api/v1/retrieve_future", {"request_id": request_id})
            assert response.status_code == 200, response.text
            body: dict[str, Any] = response.json()
            if body.get("type") != "try_again":
                return body


def datum(tokens: list[int], **inputs: list[float] | list[int]) -> dict[str, Any]:
    """A JSON datum; `target_tokens` defaults to the next tokens, every input to the right length."""
    fields = {"target_tokens": [t % VOCAB for t in tokens[1:]] + [0], **inputs}
    loss_inputs = {
        name: {"data": values, "dtype": "int64" if name == "target_tokens" else "float32"}
        for name, values in fields.items()
        if values is not None
    }
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
        "loss_fn_inputs": loss_inputs,
    }


def tensor(values: list[int] | list[float], dtype: Literal["int64", "float32"]) -> types.TensorData:
    return types.TensorData(data=values, dtype=dtype, shape=[len(values)])


def error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "category"}, body
    return str(body["error"])


@pytest.fixture(scope="module")
def alice(stack: Stack) -> Api:
    return Api(stack.base_url, "tml-errors-alice")


@pytest.fixture(scope="module")
def bob(stack: Stack) -> Api:
    return Api(stack.base_url, "tml-errors-bob")


@pytest.fixture(scope="module")
def model(alice: Api) -> str:
    return alice.model()


# --- unknown things, malformed bodies ------------------------------------------------------------


def test_unknown_model_is_404(alice: Api) -> None:
    assert "model 's-nope:train:0' not found" in error(
        alice.fwdbwd("s-nope:train:0", 1, [datum([1, 2])]), 404
    )
    assert "not found" in error(alice.post("/api/v1/get_info", {"model_id": "s-nope:train:0"}), 404)
    assert "not found" in error(
        alice.post("/api/v1/optim_step", {"model_id": "s-nope:train:0", "seq_id": 1}), 404
    )


def test_unknown_model_through_the_sdk(stack: Stack) -> None:
    rest = tinker.RestClient(base_url=stack.base_url, api_key="tml-errors-alice")
    with pytest.raises(tinker.NotFoundError, match="not found"):
        rest.get_training_run("s-nope:train:0").result()


def test_malformed_body_is_400_naming_the_field(alice: Api) -> None:
    body = {
        "session_id": alice.session(),
        "model_seq_id": 0,
        "base_model": "tiny-qwen3",
        "lora_config": {"rank": "four"},
    }
    assert "lora_config.rank" in error(alice.post("/api/v1/create_model", body), 400)
    assert "session_id" in error(
        alice.post("/api/v1/create_model", {"model_seq_id": 0, "base_model": "x"}), 400
    )
    bad_seq = {
        "forward_backward_input": {"data": [], "loss_fn": "cross_entropy"},
        "model_id": "m",
        "seq_id": "x",
    }
    assert "seq_id" in error(alice.post("/api/v1/forward_backward", bad_seq), 400)
    garbage = alice.http.post(
        "/api/v1/forward_backward", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert "malformed" in error(garbage, 400)


# --- datums --------------------------------------------------------------------------------------


def test_token_ids_outside_the_vocabulary_are_400(alice: Api, model: str) -> None:
    message = error(alice.fwdbwd(model, 1, [datum([1, -3, 2])]), 400)
    assert "data[0].model_input contains token id -3" in message and f"[0, {VOCAB})" in message
    message = error(alice.fwdbwd(model, 2, [datum([1, 2], target_tokens=[2, VOCAB])]), 400)
    assert f"data[0].loss_fn_inputs.target_tokens contains token id {VOCAB}" in message


def test_token_ids_outside_the_vocabulary_through_the_sdk(stack: Stack) -> None:
    service = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-errors-sdk")
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=2).result()
    bad = types.Datum(
        model_input=types.ModelInput.from_ints([1, VOCAB + 5]),
        loss_fn_inputs={"target_tokens": tensor([2, 3], "int64"), "weights": tensor([1.0, 1.0], "float32")},
    )
    with pytest.raises(tinker.BadRequestError, match=f"token id {VOCAB + 5}"):
        training.forward_backward([bad], "cross_entropy").result()
    service.close("success").result()


def test_custom_loss_is_a_400_and_forward_backward_custom_works(stack: Stack) -> None:
    """loss_fn='custom' (a server-side custom loss) is refused at once with a message pointing at
    forward_backward_custom, which then trains: its loss is the client's function of the logprobs."""
    service = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-errors-custom")
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=2).result()
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": tensor([2, 3, 4], "int64"), "weights": tensor([1.0, 1.0, 1.0], "float32")},
        )
    ]
    with pytest.raises(tinker.BadRequestError, match="server-side custom losses") as refused:
        training.forward_backward(data, "custom", loss_fn_config={"loss_id": "nope"}).result()
    assert "forward_backward_custom" in str(refused.value)

    def mean_nll(batch: list[types.Datum], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
        loss = -sum(lp.sum() for lp in logprobs) / 3
        return loss, {"mean_nll": float(loss)}

    out = training.forward_backward_custom(data, mean_nll).result()
    assert out.metrics["mean_nll"] > 0
    service.close("success").result()


def test_loss_inputs_missing_wrong_length_or_unread_are_400(alice: Api, model: str) -> None:
    missing = datum([1, 2, 3])
    del missing["loss_fn_inputs"]["target_tokens"]
    assert "data[0].loss_fn_inputs.target_tokens is required by cross_entropy" in error(
        alice.fwdbwd(model, 3, [missing]), 400
    )
    short = error(alice.fwdbwd(model, 4, [datum([1, 2, 3], weights=[1.0, 1.0])]), 400)
    assert "data[0].loss_fn_inputs.weights has length 2, expected 3" in short
    unread = error(alice.fwdbwd(model, 5, [datum([1, 2, 3], advantages=[1.0, 1.0, 1.0])]), 400)
    assert "data[0].loss_fn_inputs.advantages is not read by cross_entropy" in unread
    assert "is required by importance_sampling" in error(
        alice.fwdbwd(model, 6, [datum([1, 2])], "importance_sampling"), 400
    )


def test_non_text_chunks_are_400_text_only(alice: Api, model: str) -> None:
    image = datum([1, 2])
    image["model_input"]["chunks"] = [{"type": "image", "data": "aGVsbG8=", "format": "png"}]
    assert "text only" in error(alice.fwdbwd(model, 7, [image]), 400)


def test_a_refused_request_fails_its_future_with_error_and_category(alice: Api, model: str) -> None:
    """seq 1..7 above were refused; each still consumed its seq_id and its future failed."""
    failure = alice.result(f"{model}:1")
    assert set(failure) == {"error", "category"} and failure["category"] == "user"
    assert "token id -3" in failure["error"]


# --- identities ----------------------------------------------------------------------------------


def test_identical_retry_gets_the_same_request_id_and_different_content_is_422(
    alice: Api, model: str
) -> None:
    first = alice.fwdbwd(model, 8, [datum([4, 5, 6])])
    again = alice.fwdbwd(model, 8, [datum([4, 5, 6])])
    assert first.status_code == again.status_code == 200
    assert first.json()["request_id"] == again.json()["request_id"] == f"{model}:8"
    message = error(alice.fwdbwd(model, 8, [datum([4, 5, 7])]), 422)
    assert f"seq_id 8 of model {model} was already used" in message


def test_metric_keys_are_name_colon_reduction(alice: Api, model: str) -> None:
    result = alice.result(alice.fwdbwd(model, 9, [datum([4, 5, 6, 7])]).json()["request_id"])
    assert result["metrics"] and all(key.count(":") == 1 for key in result["metrics"])
    assert "loss:sum" in result["metrics"]


def test_metric_keys_through_the_sdk(stack: Stack) -> None:
    service = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-errors-sdk")
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=2).result()
    targets = {"target_tokens": tensor([2, 3, 4], "int64")}
    policy = {
        **targets,
        "logprobs": tensor([-1.0] * 3, "float32"),
        "advantages": tensor([1.0] * 3, "float32"),
    }
    losses: list[tuple[types.LossFnType, dict[str, types.TensorData]]] = [
        ("cross_entropy", targets),
        ("importance_sampling", policy),
    ]
    for loss_fn, inputs in losses:
        datum_ = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs=inputs)
        metrics = training.forward_backward([datum_], loss_fn).result().metrics
        assert metrics and all(key.count(":") == 1 for key in metrics)
    service.close("success").result()


# --- other tenants -------------------------------------------------------------------------------


def test_another_tenant_gets_404_for_model_future_sampler_and_checkpoint(
    alice: Api, bob: Api, model: str, stack: Stack
) -> None:
    assert "not found" in error(bob.fwdbwd(model, 10, [datum([1, 2])]), 404)
    assert "not found" in error(bob.post("/api/v1/get_info", {"model_id": model}), 404)
    assert "not found" in error(bob.post("/api/v1/retrieve_future", {"request_id": f"{model}:8"}), 404)
    saved = alice.result(
        alice.post(
            "/api/v1/save_weights_for_sampler", {"model_id": model, "seq_id": 10, "path": "mine"}
        ).json()["request_id"]
    )
    path = saved["path"]
    session = bob.session()
    sampler = {"session_id": session, "sampling_session_seq_id": 0, "model_path": path}
    assert "not found" in error(bob.post("/api/v1/create_sampling_session", sampler), 404)
    assert "not found" in error(bob.post("/api/v1/weights_info", {"tinker_path": path}), 404)
    run, _, rest = path.removeprefix("tinker://").partition("/")
    assert "not found" in error(bob.http.delete(f"/api/v1/training_runs/{run}/checkpoints/{rest}"), 404)
    assert "not found" in error(bob.http.post(f"/api/v1/training_runs/{run}/checkpoints/{rest}/publish"), 404)
    assert "not found" in error(bob.http.get(f"/api/v1/training_runs/{run}"), 404)
    alice_sampler = alice.post(
        "/api/v1/create_sampling_session", {**sampler, "session_id": alice.session()}
    ).json()
    sampler_id = alice_sampler["sampling_session_id"]
    assert "not found" in error(bob.http.get(f"/api/v1/samplers/{sampler_id}"), 404)
    sample = {
        "sampling_session_id": sampler_id,
        "seq_id": 0,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},
    }
    assert "not found" in error(bob.post("/api/v1/asample", sample), 404)
    S.sampler_id = sampler_id


# --- sampling ------------------------------------------------------------------------------------


def sample(alice: Api, tokens: list[int], **fields: Any) -> httpx.Response:
    chunks = fields.pop("chunks", [{"type": "encoded_text", "tokens": tokens}])
    body = {
        "sampling_session_id": S.sampler_id,
        "seq_id": fields.pop("seq_id", 100),
        "prompt": {"chunks": chunks},
        **fields,
    }
    return alice.post("/api/v1/asample", body)


def test_sampling_prompt_errors(alice: Api) -> None:
    assert S.sampler_id, "runs after test_another_tenant_gets_404_for_model_future_sampler_and_checkpoint"
    too_long = sample(alice, [1, 2, 3], sampling_params={"max_tokens": CONTEXT})
    assert f"exceeds the context length {CONTEXT}" in error(too_long, 400)
    assert f"prompt contains token id {VOCAB}; ids must be in [0, {VOCAB})" in error(sample(alice, [1, VOCAB]), 400)
    image = [{"type": "image", "data": "aGVsbG8=", "format": "png"}]
    assert "text only" in error(sample(alice, [], chunks=image), 400)


def test_sampling_errors_through_the_sdk(stack: Stack) -> None:
    service = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-errors-sdk")
    sampler = service.create_sampling_client(base_model="tiny-qwen3").result()
    params = types.SamplingParams(max_tokens=CONTEXT)
    with pytest.raises(tinker.BadRequestError, match="exceeds the context length"):
        sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, params).result()
    service.close("success").result()


# --- binding and keys (no stack needed) ----------------------------------------------------------


def test_a_non_loopback_bind_without_a_keys_file_refuses_to_start(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"refusing to bind 0\.0\.0\.0 without a keys file"):
        check_bind("0.0.0.0", None)
    check_bind("127.0.0.1", None)
    check_bind("localhost", None)
    check_bind("::1", None)
    keys = tmp_path / "keys.json"
    add_key(keys, "acme")
    check_bind("0.0.0.0", keys)


def test_keys_file_maps_keys_to_tenants(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    first, second = add_key(keys, "acme"), add_key(keys, "acme", name="ci")
    other = add_key(keys, "globex")
    ring = KeyRing(keys)
    assert ring.authenticate(first).id == ring.authenticate(second).id == "acme"
    assert ring.authenticate(other).id == "globex"
    with pytest.raises(Unauthorized, match="unknown API key"):
        ring.authenticate("tml-not-a-known-key")
    assert "sha256" in json.loads(keys.read_text())["keys"][0] and first not in keys.read_text()


# --- a small stack: lowered limits, overload, keys file ------------------------------------------

LIMITS = {
    "TINKERD_GATEWAY_MAX_QUEUE_DEPTH_PER_MODEL": "2",
    "TINKERD_GATEWAY_MAX_DATUMS_PER_REQUEST": "4",
    "TINKERD_GATEWAY_MAX_TOKENS_PER_DATUM": "16",
    "TINKERD_GATEWAY_MAX_REQUEST_BYTES": "4000",
}


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    return {
        "file": str(path),
        "acme": add_key(path, "acme"),
        "acme2": add_key(path, "acme"),
        "globex": add_key(path, "globex"),
    }


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory, keys: dict[str, str]) -> Iterator[Stack]:
    env = {**LIMITS, "TINKERD_GATEWAY_KEYS_FILE": keys["file"]}
    running = Stack(tmp_path_factory.mktemp("small"), services=("gateway",), env_overrides=env).start()
    try:
        yield running
    finally:
        running.stop()


def test_limits_are_413_with_the_limit_in_the_message(small: Stack, keys: dict[str, str]) -> None:
    api = Api(small.base_url, keys["acme"])
    model = api.model()
    assert "data has 5 datums; the limit is 4 per request" in error(
        api.fwdbwd(model, 1, [datum([1, 2])] * 5), 413
    )
    assert "has 17 tokens; the limit is 16 per datum" in error(
        api.fwdbwd(model, 2, [datum(list(range(17)))]), 413
    )
    payload = {
        "forward_backward_input": {"data": [datum([1, 2])], "loss_fn": "cross_entropy"},
        "model_id": model,
        "seq_id": 3,
    }
    padded = json.dumps(payload) + " " * 16_001
    big = api.http.post(
        "/api/v1/forward_backward", content=padded, headers={"content-type": "application/json"}
    )
    assert "the limit is 16000 (4 x max_request_bytes for JSON bodies)" in error(big, 413)
    proto = api.http.post(
        "/api/v1/forward_backward", content=b"\0" * 4001, headers={"content-type": "application/x-protobuf"}
    )
    assert "request body is 4001 bytes; the limit is 4000 (max_request_bytes)" in error(proto, 413)


def test_client_config_makes_the_sdk_chunk_within_the_limits(small: Stack, keys: dict[str, str]) -> None:
    config = Api(small.base_url, keys["acme"]).post("/api/v1/client/config", {"sdk_version": "0.38.0"}).json()
    assert config["fwdbwd_max_chunk_len"] == 4
    assert 0 < config["fwdbwd_max_chunk_bytes_count"] < 4000


def test_overload_is_429_with_retry_after(small: Stack, keys: dict[str, str]) -> None:
    """No planner runs in this stack: create_model (seq 0) and seq 2 stay queued, so the model's
    queue (limit 2) is full for seq 3; seq 1 fills a hole below it and is always admitted."""
    api = Api(small.base_url, keys["acme"])
    model = api.model()
    assert api.fwdbwd(model, 2, [datum([1, 2])]).status_code == 200
    refused = api.fwdbwd(model, 3, [datum([1, 2])])
    assert "max_queue_depth_per_model=2" in error(refused, 429)
    assert int(refused.headers["Retry-After"]) >= 1
    assert api.fwdbwd(model, 1, [datum([1, 2])]).status_code == 200
    assert api.fwdbwd(model, 3, [datum([1, 2])]).status_code == 429  # nothing was claimed by the 429


def test_a_retry_of_a_claimed_request_is_accepted_while_the_queue_is_full(
    small: Stack, keys: dict[str, str]
) -> None:
    """The model's queue (limit 2) holds create_model and seq 2: a new seq 3 is 429, but an
    identical retry of seq 2 gets 200 and the request id it got the first time."""
    api = Api(small.base_url, keys["acme"])
    model = api.model()
    first = api.fwdbwd(model, 2, [datum([1, 2])])
    assert first.status_code == 200
    assert api.fwdbwd(model, 3, [datum([1, 2])]).status_code == 429
    retry = api.fwdbwd(model, 2, [datum([1, 2])])
    assert retry.status_code == 200
    assert retry.json()["request_id"] == first.json()["request_id"]


def test_keys_file_mode_unknown_key_401_known_key_is_its_tenant(small: Stack, keys: dict[str, str]) -> None:
    unknown = httpx.post(
        f"{small.base_url}/api/v1/create_session", json={}, headers={"X-API-Key": "tml-unknown"}
    )
    assert "unknown API key" in error(unknown, 401)
    assert "missing X-API-Key" in error(httpx.post(f"{small.base_url}/api/v1/create_session", json={}), 401)
    acme, acme2, globex = (Api(small.base_url, keys[name]) for name in ("acme", "acme2", "globex"))
    me = acme2.http.get("/api/v1/auth/apikey/me").json()
    assert me["details"]["org_details"]["name"] == "acme"
    session = acme.session()
    heartbeat = {"session_id": session, "type": "session_heartbeat"}
    assert acme2.post("/api/v1/session_heartbeat", heartbeat).status_code == 200  # same tenant, other key
    assert "not found" in error(globex.post("/api/v1/session_heartbeat", heartbeat), 404)
