"""The protobuf decoder under truncated and mutated bodies (hypothesis, bounded for CI).

Requests come from the SDK's own encoder (`tinker.proto.request_conv`) over random datums, then
are cut or mutated (bytes flipped, inserted, deleted, duplicated). Whatever the bytes, the
gateway's decode path — `decode_forward_backward_request`, `datums_from_proto`,
`check_loss` — either gives a request or refuses it with a `ValueError` (the decoder's
`ProtoDecodeError`, naming the field) or a `TinkerError` (a 4xx); nothing else escapes (no
IndexError, struct.error, UnicodeDecodeError, overflow, recursion). Unmutated bytes decode to
what the SDK encoded.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tinker import types
from tinker.proto import request_conv

from services.gateway.config import GatewayConfig
from services.gateway.http.errors import TinkerError
from services.gateway.wire import proto as tp
from services.gateway.wire.validation import Limits, check_loss, datums_from_proto

LIMITS = Limits(GatewayConfig(max_tokens_per_datum=64, max_datums_per_request=8), vocab_size=2048, max_context=64)
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

tokens = st.lists(st.integers(min_value=-5, max_value=3000), min_size=1, max_size=12)


@st.composite
def sdk_datum(draw: st.DrawFn) -> types.Datum:
    ids = draw(tokens)
    n = len(ids)
    inputs: dict[str, types.TensorData] = {
        "target_tokens": types.TensorData.from_numpy(np.array(draw(st.lists(st.integers(0, 3000), min_size=n, max_size=n)), dtype=np.int64))
    }
    if draw(st.booleans()):
        floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
        inputs["weights"] = types.TensorData.from_numpy(np.array(draw(st.lists(floats, min_size=n, max_size=n)), dtype=np.float32))
    if draw(st.booleans()):
        inputs["advantages"] = types.TensorData.from_numpy(np.ones(draw(st.integers(0, n + 1)), dtype=np.float32))
    return types.Datum(model_input=types.ModelInput.from_ints(ids), loss_fn_inputs=inputs)


@st.composite
def sdk_request(draw: st.DrawFn) -> tuple[bytes, int, list[list[int]]]:
    data = draw(st.lists(sdk_datum(), min_size=1, max_size=4))
    loss_fn = draw(st.sampled_from(["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]))
    config = draw(st.none() | st.dictionaries(st.sampled_from(["clip_low_threshold", "clip_high_threshold", "beta"]), st.floats(-10, 10), max_size=2))
    seq = draw(st.integers(0, 2**31 - 1))  # int32 on the wire
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),  # type: ignore[arg-type]
        model_id="s-1:train:0",
        seq_id=seq,
    )
    ids = [list(d.model_input.to_ints()) for d in data]
    return request_conv.forward_backward_request_to_proto(request).SerializeToString(), seq, ids


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    body, _, _ = draw(sdk_request())
    out = bytearray(body)
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["truncate", "flip", "insert", "delete", "duplicate"]))
        at = draw(st.integers(0, max(0, len(out))))
        if how == "truncate":
            del out[at:]
        elif how == "flip" and out:
            out[min(at, len(out) - 1)] = draw(st.integers(0, 255))
        elif how == "insert":
            out[at:at] = draw(st.binary(min_size=1, max_size=12))
        elif how == "delete":
            del out[at : at + draw(st.integers(1, 8))]
        else:
            out[at:at] = out[at : at + draw(st.integers(1, 16))]
    return bytes(out)


def gateway_decode(body: bytes) -> None:
    """What POST /api/v1/forward_backward does with a protobuf body before appending it."""
    request = tp.decode_forward_backward_request(body)
    datums = datums_from_proto(request.data, LIMITS)
    check_loss(request.loss_fn, request.config, datums)


@FUZZ
@given(sdk_request())
def test_sdk_requests_decode_to_what_the_sdk_encoded(case: tuple[bytes, int, list[list[int]]]) -> None:
    body, seq, ids = case
    request = tp.decode_forward_backward_request(body)
    assert request.model_id == "s-1:train:0" and request.seq_id == seq
    assert [tp.model_input_tokens(d).tolist() for d in request.data] == ids


@FUZZ
@given(st.one_of(mutated(), st.binary(max_size=200)))
def test_mutated_bodies_are_decoded_or_refused_with_a_named_field(body: bytes) -> None:
    try:
        gateway_decode(body)
    except (ValueError, TinkerError):
        pass  # ProtoDecodeError (a ValueError naming the field) -> 400; TinkerError -> its 4xx
