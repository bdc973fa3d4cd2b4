"""A property-based fuzz of the gateway's HTTP API (hypothesis over the wire types, bounded for CI).

Every route the gateway serves is called with bodies drawn from its own wire type's JSON schema
(`msgspec.json.schema` of the handler's request Struct): well-formed bodies, bodies with fields
dropped, retyped or replaced by junk, extreme numbers, non-standard JSON (NaN, Infinity), real ids
of a live session, model and sampler mixed with made-up ones, and plain garbage; path and query
parameters likewise; a valid API key mostly, sometimes none or a wrong one. `forward_backward` also
gets SDK-encoded protobuf bodies, cut and mutated.

The properties, for every response: a 2xx, or a 4xx whose JSON body is the SDK's
`{error, category}`; never a 5xx (the routes of features not offered answer 400, in the same
shape); never a hang (a 30 s client timeout; `retrieve_future` holds a poll 1 s here). After
the fuzz, the stack is healthy: healthz answers 200 and a fresh SDK client trains a step.
"""

from __future__ import annotations

import json
import math
import typing
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import msgspec
import numpy as np
import pytest
import tinker
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tinker import types

from services.gateway.app import ALL_ROUTES
from services.gateway.routes import unsupported
from services.gateway.wire import tinker_wire as w
from tests.fuzz.test_proto_fuzz import mutated, sdk_request
from tests.harness import Stack

EXAMPLES = 20  # per route (about 50 routes)
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
KEY = "tml-fuzz-tenant"
CATEGORIES = {"user", "server", "unknown"}
JSON_BODIES: dict[str, Any] = {  # handlers that read the raw body: the JSON type they decode it as
    "/api/v1/forward_backward": w.LegacyForwardBackwardRequest,
    "/api/v1/forward": w.LegacyForwardRequest,
}
NOT_OFFERED = {path for handler in unsupported.ROUTES for path in handler.paths}
STREAMS = {"/api/v1/console/live", "/api/v1/console/operator/live"}  # server-sent events: only the head is read


class Ids:
    """Real identifiers of a live session, model, sampler and checkpoint, plus made-up ones."""

    session = model = sampler = path = ""

    @classmethod
    def pool(cls) -> list[str]:
        real = [cls.session, cls.model, cls.sampler, cls.path, f"{cls.model}:1", f"{cls.model}:99"]
        made_up = ["", "x", "s-0:train:0", "tinker://nope/weights/a", "../../etc/passwd", "a" * 300, "é\u2603", "%00", "{}"]
        return real + made_up


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {"TINKERD_GATEWAY_RETRIEVE_WAIT_S": "1"}
    running = Stack(tmp_path_factory.mktemp("fuzz"), env_overrides=env).start()
    try:
        client = tinker.ServiceClient(base_url=running.base_url, api_key=KEY)
        trainer = client.create_lora_training_client(base_model="tiny-qwen3", rank=2).result()
        Ids.model = trainer.model_id
        Ids.session = Ids.model.split(":")[0]
        Ids.path = trainer.save_state("fuzz").result().path
        body = {"type": "create_sampling_session", "session_id": Ids.session, "sampling_session_seq_id": 1000, "base_model": "tiny-qwen3"}
        created = httpx.post(f"{running.base_url}/api/v1/create_sampling_session", json=body, headers={"X-API-Key": KEY})
        Ids.sampler = created.json()["sampling_session_id"]
        yield running
    finally:
        running.stop()


# --- strategies from a JSON schema ------------------------------------------------------------

JUNK: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
INTS = st.sampled_from([0, 1, -1, 2, 7, 2**31 - 1, 2**31, -(2**31), 2**53, 2**63 - 1, 2**64, -(2**64)]) | st.integers(-10, 5000)
NUMBERS = st.sampled_from([0.0, -0.0, 1e-45, 3e38, 1e308, -1e308, 0.5, 1.0]) | st.floats(allow_nan=False, allow_infinity=False)


def from_schema(schema: dict[str, Any], defs: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """Values shaped like `schema`, now and then something else entirely."""
    if depth > 6:
        return JUNK
    if "$ref" in schema:
        return st.deferred(lambda: from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs, depth + 1))
    if "anyOf" in schema or "oneOf" in schema:
        choices = schema.get("anyOf") or schema.get("oneOf") or []
        return st.one_of([from_schema(s, defs, depth + 1) for s in choices])
    if "enum" in schema:
        return st.sampled_from(schema["enum"]) | st.text(max_size=8)
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}, defs, depth) for k in kind])
    shaped: st.SearchStrategy[Any]
    if kind == "object" and "properties" in schema:
        fields = {name: from_schema(sub, defs, depth + 1) | JUNK for name, sub in schema["properties"].items()}
        required = set(schema.get("required", ()))
        shaped = st.fixed_dictionaries(
            {k: v for k, v in fields.items() if k in required},
            optional={k: v for k, v in fields.items() if k not in required},
        )
        if required:  # sometimes a required field is missing
            shaped = shaped | st.fixed_dictionaries({}, optional=fields)
    elif kind == "object":
        values = from_schema(schema.get("additionalProperties") or {}, defs, depth + 1)
        shaped = st.dictionaries(st.text(max_size=12) | st.sampled_from(["weights", "beta", "lr"]), values, max_size=3)
    elif kind == "array":
        shaped = st.lists(from_schema(schema.get("items", {}), defs, depth + 1), max_size=4)
    elif kind == "string":
        shaped = st.sampled_from(Ids.pool()) | st.text(max_size=16)
    elif kind == "integer":
        shaped = INTS
    elif kind == "number":
        shaped = NUMBERS | INTS
    elif kind == "boolean":
        shaped = st.booleans()
    elif kind == "null":
        shaped = st.none()
    else:
        shaped = JUNK
    return shaped


def body_strategy(data_type: Any) -> st.SearchStrategy[bytes]:
    schema = msgspec.json.schema(data_type)
    shaped = from_schema(schema, schema.get("$defs", {}))
    nonstandard = shaped.map(lambda v: json.dumps(v, allow_nan=True).replace("0.5", "NaN").replace("1e+308", "Infinity"))
    return st.one_of(
        shaped.map(lambda v: json.dumps(v).encode()),
        nonstandard.map(str.encode),
        JUNK.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
    )


def routes() -> list[tuple[str, str, Any]]:
    out = []
    for handler in ALL_ROUTES:
        hints = typing.get_type_hints(handler.fn)
        for path in sorted(handler.paths):
            for method in sorted(handler.http_methods):
                out.append((method, path, JSON_BODIES.get(path, hints.get("data"))))
    return out


def fill_path(path: str, values: list[str]) -> str:
    parts, i = [], 0
    for piece in path.split("/"):
        if piece.startswith("{"):
            parts.append(quote(values[i % len(values)], safe="") or "x")
            i += 1
        else:
            parts.append(piece)
    return "/".join(parts)


headers_strategy = st.sampled_from(
    [{"X-API-Key": KEY}] * 6 + [{}, {"X-API-Key": "garbage"}, {"X-API-Key": "tml-someone-else"}, {"X-API-Key": ""}]
)


def assert_well_formed(method: str, path: str, response: httpx.Response) -> None:
    """`path` is the route's template; even a route of `NOT_OFFERED` answers a 4xx, never a 5xx."""
    where = f"{method} {response.request.url.path} -> {response.status_code}: {response.text[:300]}"
    assert response.status_code < 500, where
    if response.status_code >= 400:
        body = response.json()
        assert isinstance(body.get("error"), str) and body.get("category") in CATEGORIES, where


ROUTES = routes()


@pytest.mark.parametrize(("method", "path", "data_type"), ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_every_response_is_a_2xx_or_a_4xx_in_the_sdk_error_shape(stack: Stack, method: str, path: str, data_type: Any) -> None:
    http = httpx.Client(base_url=stack.base_url, timeout=30)

    @FUZZ
    @given(
        body=body_strategy(data_type) if data_type is not None else st.just(b""),
        path_values=st.lists(st.sampled_from(Ids.pool()) | st.text(min_size=1, max_size=8), min_size=1, max_size=3),
        query=st.dictionaries(st.sampled_from(["limit", "offset", "access_scope"]), st.sampled_from(["1", "-1", "x", "999999999999", "owned", "all"]), max_size=2),
        headers=headers_strategy,
    )
    def call(body: bytes, path_values: list[str], query: dict[str, str], headers: dict[str, str]) -> None:
        url = fill_path(path, path_values or ["x"])
        content = body if method in ("POST", "PUT") else None
        if path in STREAMS:
            with http.stream(method, url, params=query, headers=headers) as streamed:
                if streamed.status_code >= 400:
                    streamed.read()
                    assert_well_formed(method, path, streamed)
                else:  # the head of a live stream; its body never ends
                    assert streamed.headers["content-type"].startswith("text/event-stream"), url
            return
        response = http.request(method, url, content=content, params=query, headers={**headers, "content-type": "application/json"})
        assert_well_formed(method, path, response)

    try:
        call()
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- stack logs ---\n{stack.dump_logs()[-6000:]}") from exc
    finally:
        http.close()


@FUZZ
@given(body=st.one_of(mutated(), sdk_request().map(lambda case: case[0]), st.binary(max_size=100)))
def test_protobuf_bodies_are_accepted_or_refused_with_a_4xx(stack: Stack, body: bytes) -> None:
    response = httpx.post(
        f"{stack.base_url}/api/v1/forward_backward",
        content=body,
        headers={"X-API-Key": KEY, "content-type": "application/x-protobuf"},
        timeout=30,
    )
    assert_well_formed("POST", "/api/v1/forward_backward", response)


def test_the_stack_is_healthy_after_the_fuzz(stack: Stack) -> None:
    """Runs last in this module: healthz is 200 and a new client trains a step end to end."""
    assert httpx.get(f"{stack.base_url}/api/v1/healthz", timeout=30).status_code == 200
    client = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-fuzz-after")
    trainer = client.create_lora_training_client(base_model="tiny-qwen3", rank=2).result()
    tokens = list(range(5, 17))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:])),
            "weights": types.TensorData.from_numpy(np.ones(len(tokens) - 1, dtype=np.float32)),
        },
    )
    out = trainer.forward_backward([datum], "cross_entropy").result(timeout=120)
    assert out.metrics is not None and math.isfinite(out.metrics["loss:sum"])
    stepped = trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=120)
    assert stepped.metrics is not None and stepped.metrics["optimizer_step"] == 1

