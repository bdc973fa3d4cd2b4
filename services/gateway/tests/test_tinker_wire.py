"""The JSON Structs against the real SDK (tinker 0.38, tests only).

Requests: the SDK's own request models are dumped the way the SDK sends them and must decode
into our Structs with every value intact. Responses: our encodings must validate in the
SDK's pydantic response models with the values we meant.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from typing import Any

import msgspec
import numpy as np
import pydantic
import pytest
import torch
from tinker import types
from tinker._compat import model_dump
from tinker.lib.public_interfaces.rest_client import _SessionTraceExportPollResponse
from tinker.proto import response_conv
from tinker.types._pydantic_types.datum import Datum as PydanticDatum
from tinker.types._pydantic_types.forward_backward_input import (
    ForwardBackwardInput as PydanticForwardBackwardInput,
)
from tinker.types._pydantic_types.model_input import ModelInput as PydanticModelInput
from tinker.types._pydantic_types.tensor_data import TensorData as PydanticTensorData
from tinker.types.client_dynamic_config_response import ClientDynamicConfigResponse as SdkDynamicConfig
from tinker.types.create_sampling_session_response import (
    CreateSamplingSessionResponse as SdkCreateSamplingSession,
)
from tinker.types.external_weights_urls_response import ExternalWeightsUrlsResponse as SdkExternalUrls
from tinker.types.generic_event import GenericEvent
from tinker.types.get_server_capabilities_response import GetServerCapabilitiesResponse as SdkCapabilities
from tinker.types.join_sampling_session_response import JoinSamplingSessionResponse as SdkJoin
from tinker.types.save_weights_external_response import SaveWeightsExternalResponseInternal as SdkSaveExternal
from tinker.types.save_weights_for_sampler_response import (
    SaveWeightsForSamplerResponseInternal as SdkSaveForSampler,
)
from tinker.types.try_again_response import TryAgainResponse as SdkTryAgain

from services.gateway.tests import proto_results as pr
from services.gateway.wire import admin_wire as aw
from services.gateway.wire import proto as tp
from services.gateway.wire import tinker_public_pb2 as pb
from services.gateway.wire import tinker_wire as tw

NOW = dt.datetime(2026, 11, 29, 10, 11, 12, 345000, tzinfo=dt.UTC)


def _raw(inputs: dict[str, Any]) -> Any:
    """Loss inputs as users pass them (lists, numpy, torch); the SDK converts them itself."""
    return inputs


# --- requests: SDK dump -> our Struct ---------------------------------------------------


def _assert_subset(expected: Any, actual: Any, path: str = "$") -> None:
    """Every value the SDK sent is in our decoded Struct, unchanged."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), path
        for key, value in expected.items():
            assert key in actual or value is None, f"{path}.{key} missing"  # omitted means null
            _assert_subset(value, actual.get(key), f"{path}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), path
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            _assert_subset(e, a, f"{path}[{i}]")
    else:
        assert expected == actual and type(expected) is type(actual), f"{path}: {expected!r} != {actual!r}"


def _round_trip(sdk_request: pydantic.BaseModel, struct_type: type[msgspec.Struct]) -> Any:
    """Decode the SDK's body both as it sends it (nulls dropped) and as a plain dump."""
    decoded = None
    for body in (
        model_dump(sdk_request, exclude_none=True, mode="json"),
        sdk_request.model_dump(mode="json"),
    ):
        decoded = msgspec.json.decode(json.dumps(body).encode(), type=struct_type)
        _assert_subset(body, msgspec.to_builtins(decoded))
    return decoded


_IMAGE = types.ImageChunk(data=b"\x89PNG\r\n\x1a\n bytes", format="png", expected_tokens=3)
_PROMPT = types.ModelInput(
    chunks=[
        types.EncodedTextChunk(tokens=[1, 2, 3]),
        _IMAGE,
        types.ImageAssetPointerChunk(format="jpeg", location="s3://bucket/cat.jpg"),
        types.DmelChunk(dmel=b"\x00audio"),
        types.EncodedTextChunk(tokens=[4]),
    ]
)

REQUESTS: list[tuple[pydantic.BaseModel, type[msgspec.Struct]]] = [
    (types.ClientConfigRequest(sdk_version="0.38.0"), tw.ClientConfigRequest),
    (
        types.CreateSessionRequest(
            tags=["a", "b"],
            user_metadata={"who": "study", "n": 3},
            sdk_version="0.38.0",
            project_id="p1",
            display_name="run",
        ),
        tw.CreateSessionRequest,
    ),
    (types.CreateSessionRequest(tags=[], user_metadata=None, sdk_version="0.38.0"), tw.CreateSessionRequest),
    (types.SessionHeartbeatRequest(session_id="sess-1"), tw.SessionHeartbeatRequest),
    (
        types.TelemetrySendRequest(
            events=[
                types.SessionStartEvent(
                    event="SESSION_START",
                    event_id="e1",
                    event_session_index=0,
                    severity="INFO",
                    timestamp=NOW,
                ),
                GenericEvent(
                    event="GENERIC_EVENT",
                    event_id="e2",
                    event_name="x",
                    event_session_index=1,
                    severity="WARNING",
                    timestamp=NOW,
                    event_data={"k": [1, "v"]},
                ),
                types.UnhandledExceptionEvent(
                    event="UNHANDLED_EXCEPTION",
                    event_id="e3",
                    event_session_index=2,
                    severity="ERROR",
                    timestamp=NOW,
                    error_message="boom",
                    error_type="ValueError",
                ),
                types.SessionEndEvent(
                    event="SESSION_END",
                    event_id="e4",
                    event_session_index=3,
                    severity="INFO",
                    timestamp=NOW,
                    duration="0:01:00",
                ),
            ],
            platform="Linux",
            sdk_version="0.38.0",
            session_id="sess-1",
            process_uuid="uuid",
        ),
        tw.TelemetrySendRequest,
    ),
    (
        types.CreateModelRequest(
            session_id="sess-1",
            model_seq_id=0,
            base_model="Qwen/Qwen3-0.6B",
            user_metadata={"renderer_name": "role_colon"},
            lora_config=types.LoraConfig(rank=8, seed=1, train_unembed=False),
        ),
        tw.CreateModelRequest,
    ),
    (
        types.CreateModelRequest(
            session_id="s", model_seq_id=1, base_model="m", optimizer_config=types.DimuonOptimizerConfig()
        ),
        tw.CreateModelRequest,
    ),
    (types.GetInfoRequest(model_id="sess-1:train:0"), tw.GetInfoRequest),
    (
        types.OptimStepRequest(
            optim_params=types.AdamParams(learning_rate=3e-4, eps=1e-8), model_id="m", seq_id=2
        ),
        tw.OptimStepRequest,
    ),
    (
        types.OptimStepRequest(
            optim_params=types.DimuonParams(learning_rate=0.02, beta1=0.5), model_id="m", seq_id=3
        ),
        tw.OptimStepRequest,
    ),
    (
        types.SaveWeightsRequest(
            model_id="m", path="ckpt1", seq_id=7, ttl_seconds=3600, user_metadata={"k": "v"}
        ),
        tw.SaveWeightsRequest,
    ),
    (
        types.SaveWeightsForSamplerRequest(model_id="m", path="s1", seq_id=8, ttl_seconds=7200),
        tw.SaveWeightsForSamplerRequest,
    ),
    (
        types.SaveWeightsForSamplerRequest(
            model_id="m", sampling_session_seq_id=1, kind="inflight", seq_id=9
        ),
        tw.SaveWeightsForSamplerRequest,
    ),
    (
        types.SaveWeightsExternalRequest(
            model_id="m", path="e1", seq_id=10, age_encryption_recipients=["age1xyz"]
        ),
        tw.SaveWeightsExternalRequest,
    ),
    (
        types.LoadWeightsRequest(
            session_id="sess-1",
            model_seq_id=1,
            path="tinker://m/weights/ckpt1",
            optimizer=True,
            optimizer_config=types.AdamOptimizerConfig(),
            weights_access_token="t",
        ),
        tw.LoadWeightsRequest,
    ),
    (
        types.LoadWeightsRequest(model_id="m", seq_id=1, path="tinker://m/weights/ckpt1", optimizer=False),
        tw.LoadWeightsRequest,
    ),
    (
        types.CreateCustomLossRequest(
            session_id="sess-1",
            custom_loss_seq_id=0,
            name="my_loss",
            inputs=[
                types.CustomLossInput(name="logprobs", rank=1),
                types.CustomLossInput(name="adv", rank=0),
            ],
            graph=types.CustomLossGraph(
                nodes=[
                    types.CustomLossNode(op="placeholder", name="logprobs", target="logprobs"),
                    types.CustomLossNode(
                        op="call_function",
                        name="mul",
                        target="operator.mul",
                        args=[{"ref": "logprobs"}, 2.0],
                        kwargs={"x": {"float": "inf"}},
                    ),
                    types.CustomLossNode(op="output", name="output", target="output", args=[{"ref": "mul"}]),
                ]
            ),
        ),
        tw.CreateCustomLossRequest,
    ),
    (
        types.CopyWeightsRequest(
            source_path="tinker://m/weights/a", session_id="s", model_seq_id=2, ttl_seconds=3600
        ),
        tw.CopyWeightsRequest,
    ),
    (types.UnloadModelRequest(model_id="m"), tw.UnloadModelRequest),
    (
        types.CreateSamplingSessionRequest(
            session_id="s", sampling_session_seq_id=0, model_path="tinker://m/sampler_weights/s1"
        ),
        tw.CreateSamplingSessionRequest,
    ),
    (
        types.CreateSamplingSessionRequest(
            session_id="s", sampling_session_seq_id=2, base_model="Qwen/Qwen3-0.6B"
        ),
        tw.CreateSamplingSessionRequest,
    ),
    (
        types.SampleRequest(
            num_samples=2,
            prompt=_PROMPT,
            sampling_params=types.SamplingParams(max_tokens=4, stop=["\n"], temperature=0.7, seed=5),
            sampling_session_id="sess-1:sample:0",
            seq_id=0,
            prompt_logprobs=True,
            topk_prompt_logprobs=3,
            topk_sample_logprobs=2,
            target_prompt_logprobs=PydanticTensorData.from_torch_sparse(torch.tensor([[5, 0, 0], [0, 0, 7]])),
            prompt_alt_tokens_k=2,
            prompt_logprobs_last_n=3,
            record_stability_info=True,
        ),
        tw.SampleRequest,
    ),
    (
        types.SampleRequest(
            prompt=PydanticModelInput.from_ints([1]), sampling_params=types.SamplingParams(stop="END")
        ),
        tw.SampleRequest,
    ),
    (
        types.SampleRequest(
            prompt=PydanticModelInput.from_ints([1]),
            sampling_params=types.SamplingParams(stop=[13, 42], top_k=5, top_p=0.9),
        ),
        tw.SampleRequest,
    ),
    (types.JoinSamplingSessionRequest(sampling_session_id="sess-1:sample:0"), tw.JoinSamplingSessionRequest),
    (types.FutureRetrieveRequest(request_id="req-1", allow_metadata_only=True), tw.FutureRetrieveRequest),
    (
        types.FuturesRetrieveRequest(
            target=types.SamplingSessionFuturesTarget(
                sampling_session_id="sess-1:sample:0", cloned_sampler_id=3
            ),
            prev_cursor=5,
            timeout=30.0,
            retrieved_request_ids=["req-1"],
        ),
        tw.FuturesRetrieveRequest,
    ),
    (
        types.SessionSearchRequest(
            project_ids=["p"],
            user_metadata={"k": "v"},
            display_name="run",
            owner=types.UserSearchOwner(owner_urns=["tml:user:1"]),
            statuses=[
                types.ClientFinishedSessionStatusQuery(reasons=["success"]),
                types.ActiveSessionStatusQuery(),
            ],
            limit=20,
            cursor=types.SessionSearchCursor(last_created_at=NOW, last_session_id="sess-0"),
        ),
        tw.SessionSearchRequest,
    ),
    (types.SessionSearchRequest(), tw.SessionSearchRequest),
]


@pytest.mark.parametrize(
    ("sdk_request", "struct_type"),
    REQUESTS,
    ids=lambda v: type(v).__name__ if isinstance(v, pydantic.BaseModel) else "",
)
def test_sdk_request_bodies_decode_with_every_value(
    sdk_request: pydantic.BaseModel, struct_type: type[msgspec.Struct]
) -> None:
    _round_trip(sdk_request, struct_type)


def test_sample_request_prompt_and_params_are_usable() -> None:
    request = _round_trip(REQUESTS[[t for _, t in REQUESTS].index(tw.SampleRequest)][0], tw.SampleRequest)
    assert [type(c).__name__ for c in request.prompt.chunks] == [
        "EncodedTextChunk",
        "ImageChunk",
        "ImageAssetPointerChunk",
        "DmelChunk",
        "EncodedTextChunk",
    ]
    assert request.prompt.chunks[1].data == _IMAGE.data  # base64 on the wire, bytes here
    assert request.sampling_params.stop_strings == ["\n"] and request.sampling_params.stop_token_ids == []
    assert request.target_prompt_logprobs.to_numpy().tolist() == [[5, 0, 0], [0, 0, 7]]
    with pytest.raises(ValueError, match="only text"):
        request.prompt.token_ids()
    assert tw.ModelInput(
        chunks=[tw.EncodedTextChunk(tokens=[1, 2]), tw.EncodedTextChunk(tokens=[3])]
    ).token_ids() == [1, 2, 3]


def test_sampling_params_stop_forms() -> None:
    decode = msgspec.json.Decoder(tw.SamplingParams).decode
    assert decode(b'{"stop": "END"}').stop_strings == ["END"]
    assert decode(b'{"stop": [13, 42]}').stop_token_ids == [13, 42]
    assert decode(b'{"stop": [13, 42]}').stop_strings == []
    empty = decode(b'{"stop": []}')
    assert empty.stop == [] and empty.stop_strings == [] and empty.stop_token_ids == []
    assert decode(b"{}").stop is None and decode(b'{"stop": null}').stop is None
    with pytest.raises(msgspec.ValidationError, match="mixes"):
        decode(b'{"stop": ["a", 1]}')


def test_optim_step_accepts_all_three_parameter_names() -> None:
    decode = msgspec.json.Decoder(tw.OptimStepRequest).decode
    adam = decode(
        b'{"model_id": "m", "seq_id": 2, "type": "optim_step", "adam_params": {"learning_rate": 0.001}}'
    ).params()
    assert adam == tw.AdamParams(learning_rate=0.001)
    dimuon = decode(
        b'{"model_id": "m", "optimizer_params": {"type": "dimuon", "learning_rate": 0.02}}'
    ).params()
    assert dimuon == tw.DimuonParams(learning_rate=0.02)
    assert decode(
        b'{"model_id": "m", "optim_params": {"learning_rate": 0.5, "beta2": 0.9}}'
    ).params() == tw.AdamParams(learning_rate=0.5, beta2=0.9)
    assert decode(
        b'{"model_id": "m", "optim_params": {"type": "dimuon", "learning_rate": 0.5}}'
    ).params() == tw.DimuonParams(learning_rate=0.5)
    with pytest.raises(ValueError, match="none of"):
        decode(b'{"model_id": "m"}').params()
    with pytest.raises(msgspec.ValidationError):
        decode(b'{"model_id": "m", "optimizer_params": {"type": "dimuon", "learning_rate": -1}}')
    with pytest.raises(msgspec.ValidationError, match="type"):
        decode(b'{"model_id": "m", "type": "save_weights"}')


def test_adam_defaults_match_the_sdk_exactly() -> None:
    assert msgspec.to_builtins(tw.AdamParams()) == types.AdamParams().model_dump()
    assert msgspec.to_builtins(tw.AdamParams()) == {
        "learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0
    }  # fmt: skip


def test_requests_ignore_fields_a_newer_sdk_adds() -> None:
    body = b'{"session_id": "s", "model_seq_id": 0, "base_model": "b", "type": "create_model", "new_field": {"x": 1}}'
    request = msgspec.json.decode(body, type=tw.CreateModelRequest)
    assert request.optimizer_config == tw.OptimizerConfig(type="adamw") and request.lora_config is None


def test_captured_wire_bodies_decode() -> None:
    """Bodies as captured from SDK 0.38.0 (protocol reference §12)."""
    captured = [
        (
            b'{"tags":[],"user_metadata":{"who":"study"},"sdk_version":"0.38.0","type":"create_session"}',
            tw.CreateSessionRequest,
        ),
        (
            b'{"session_id":"sess-1","model_seq_id":0,"base_model":"Qwen/Qwen3-0.6B","lora_config":{"rank":8,"seed":1,"train_unembed":true,'
            b'"train_mlp":true,"train_attn":true},"optimizer_config":{"type":"adamw"},"type":"create_model"}',
            tw.CreateModelRequest,
        ),
        (
            b'{"model_id":"sess-1:train:0","path":"s1","kind":"snapshot","seq_id":8}',
            tw.SaveWeightsForSamplerRequest,
        ),
        (
            b'{"num_samples":2,"prompt":{"chunks":[{"tokens":[1,2,3],"type":"encoded_text"}]},"sampling_params":{"max_tokens":4,"stop":["\\n"],'
            b'"temperature":0.7,"top_k":-1,"top_p":1.0},"sampling_session_id":"sess-1:sample:0","seq_id":0,"prompt_logprobs":false}',
            tw.SampleRequest,
        ),
        (b'{"reason":{"type":"success"},"detail":"study done"}', tw.SessionFinishRequest),
        (b'{"reason":{"type":"interrupted"},"detail":null}', tw.SessionFinishRequest),
        (b'{"request_id":"req-1","allow_metadata_only":true}', tw.FutureRetrieveRequest),
        (b'{"request_id":"req-1"}', tw.CancelFutureRequest),
        (b'{"tinker_path":"tinker://sess-1:train:0/weights/ckpt1"}', tw.WeightsInfoRequest),
        (b'{"ttl_seconds":null}', tw.CheckpointTtlRequest),
        (b'{"project_id":"p"}', tw.SessionProjectRequest),
        (b"{}", tw.AuthTokenRequest),
    ]
    for body, struct_type in captured:
        decoded = msgspec.json.decode(body, type=struct_type)
        _assert_subset(json.loads(body), msgspec.to_builtins(decoded))


# --- SDK <= 0.24 JSON forward/backward --------------------------------------------------


def _legacy_input() -> PydanticForwardBackwardInput:
    data = [
        PydanticDatum(
            model_input=PydanticModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs=_raw({"target_tokens": [2, 3, 4], "weights": [0.0, 1.0, 1.0]}),
        ),
        PydanticDatum(
            model_input=PydanticModelInput.from_ints([5, 6]),
            loss_fn_inputs=_raw(
                {
                    "target_tokens": torch.tensor([[7, 0, 0, 0], [0, 0, 0, 9]]),
                    "advantages": np.array([0.5, -0.5], np.float32),
                }
            ),
        ),
    ]
    return PydanticForwardBackwardInput(
        data=data, loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    )


def test_legacy_json_forward_backward_and_forward_decode() -> None:
    fb_input = _legacy_input()
    struct_types: dict[str, type[tw.LegacyForwardBackwardRequest | tw.LegacyForwardRequest]] = {
        "forward_backward_input": tw.LegacyForwardBackwardRequest,
        "forward_input": tw.LegacyForwardRequest,
    }
    for wrapper, struct_type in struct_types.items():
        body = {wrapper: fb_input.model_dump(mode="json"), "model_id": "sess-1:train:0", "seq_id": 4}
        request = msgspec.json.decode(json.dumps(body).encode(), type=struct_type)
        _assert_subset(body, msgspec.to_builtins(request))
        payload = (
            request.forward_backward_input
            if isinstance(request, tw.LegacyForwardBackwardRequest)
            else request.forward_input
        )
        assert payload.loss_fn_config == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
        assert payload.data[0].model_input.token_ids() == [1, 2, 3]
        for ours, sdk in zip(payload.data, fb_input.data, strict=True):
            for name, td in sdk.loss_fn_inputs.items():
                got = ours.loss_fn_inputs[name].to_numpy()
                assert got.dtype == td.to_numpy().dtype
                np.testing.assert_array_equal(got, td.to_numpy())
        assert payload.data[1].loss_fn_inputs["target_tokens"].sparse_crow_indices is not None


def test_tensor_data_shape_errors() -> None:
    with pytest.raises(ValueError, match="does not hold"):
        tw.TensorData(data=[1, 2, 3], dtype="int64", shape=[2, 2]).to_numpy()
    with pytest.raises(ValueError, match="needs shape"):
        tw.TensorData(data=[1], dtype="int64", sparse_crow_indices=[0, 1]).to_numpy()
    assert tw.TensorData(data=[1, 2], dtype="float32").to_numpy().dtype == np.float32
    round_trip = tw.TensorData.from_numpy(np.arange(6, dtype=np.int32).reshape(2, 3))
    assert (round_trip.dtype, round_trip.shape) == ("int64", [2, 3])


# --- responses: our Struct -> SDK pydantic ----------------------------------------------


def _sdk_view(struct: msgspec.Struct, model: type[pydantic.BaseModel]) -> tuple[Any, dict[str, Any]]:
    body = json.loads(msgspec.json.encode(struct))
    return model.model_validate(body), body


def _checkpoint(name: str, kind: tw.CheckpointType = "training") -> tw.Checkpoint:
    segment = {"training": "weights", "sampler": "sampler_weights", "external": "external_weights"}[kind]
    return tw.Checkpoint(
        checkpoint_id=f"{segment}/{name}",
        checkpoint_type=kind,
        time=NOW,
        tinker_path=f"tinker://sess-1:train:0/{segment}/{name}",
        size_bytes=1234,
        user_metadata={"step": "2"},
        expires_at=NOW + dt.timedelta(hours=1) if kind == "sampler" else None,
    )


RUN = tw.TrainingRun(
    training_run_id="sess-1:train:0",
    base_model="Qwen/Qwen3-0.6B",
    model_owner="tml:user:1",
    is_lora=True,
    lora_rank=8,
    last_request_time=NOW,
    last_checkpoint=_checkpoint("ckpt1"),
    last_sampler_checkpoint=_checkpoint("s1", "sampler"),
    user_metadata={"renderer_name": "role_colon"},
)

FUTURE_RESULTS: list[tuple[msgspec.Struct, type[pydantic.BaseModel]]] = [
    (tw.CreateModelResponse(model_id="sess-1:train:0"), types.CreateModelResponse),
    (tw.OptimStepResponse(metrics={"grad_norm:mean": 0.5}), types.OptimStepResponse),
    (tw.OptimStepResponse(), types.OptimStepResponse),
    (tw.SaveWeightsResponse(path="tinker://sess-1:train:0/weights/ckpt1"), types.SaveWeightsResponse),
    (tw.SaveWeightsForSamplerResponse(path="tinker://sess-1:train:0/sampler_weights/s1"), SdkSaveForSampler),
    (tw.SaveWeightsForSamplerResponse(sampling_session_id="sess-1:sample:1"), SdkSaveForSampler),
    (
        tw.SaveWeightsExternalResponse(path="tinker://sess-1:train:0/external_weights/e1", size_bytes=99),
        SdkSaveExternal,
    ),
    (
        tw.LoadWeightsResponse(path="tinker://x/weights/y", model_id="sess-1:train:1"),
        types.LoadWeightsResponse,
    ),
    (tw.LoadWeightsResponse(), types.LoadWeightsResponse),
    (tw.CreateCustomLossResponse(loss_id="loss-0"), types.CreateCustomLossResponse),
    (tw.UnloadModelResponse(model_id="m"), types.UnloadModelResponse),
]

DIRECT_RESPONSES: list[tuple[msgspec.Struct, type[pydantic.BaseModel]]] = [
    (
        tw.UntypedAPIFuture(request_id="req-10", sample_sequence_ids=["req-10:seq:0", "req-10:seq:1"]),
        types.UntypedAPIFuture,
    ),
    (tw.UntypedAPIFuture(request_id="req-1", model_id="sess-1:train:0"), types.UntypedAPIFuture),
    (
        tw.TryAgainResponse(request_id="req-1", queue_state="paused_capacity", queue_state_reason="busy"),
        SdkTryAgain,
    ),
    (tw.RequestFailedResponse(error="prompt too long", category="user"), types.RequestFailedResponse),
    (tw.ClientConfigResponse(proto_compress_fwdbwd=True), types.ClientConfigResponse),
    (tw.ClientDynamicConfigResponse(), SdkDynamicConfig),
    (tw.CreateSessionResponse(session_id="sess-1", info_message="hi"), types.CreateSessionResponse),
    (tw.SessionHeartbeatResponse(), types.SessionHeartbeatResponse),
    (tw.TelemetryResponse(status="accepted"), types.TelemetryResponse),
    (tw.HealthResponse(status="ok"), types.HealthResponse),
    (tw.AuthTokenResponse(jwt="eyJ.x.y"), types.AuthTokenResponse),
    (
        tw.GetServerCapabilitiesResponse(
            supported_models=[
                tw.SupportedModel(model_name="Qwen/Qwen3-0.6B", max_context_length=4096, trainable=True)
            ]
        ),
        SdkCapabilities,
    ),
    (tw.GetServerCapabilitiesResponse(supported_models=[]), SdkCapabilities),
    (
        tw.GetInfoResponse(
            model_id="sess-1:train:0",
            model_data=tw.ModelData(
                arch="qwen3", model_name="Qwen/Qwen3-0.6B", tokenizer_id="Qwen/Qwen3-0.6B"
            ),
            is_lora=True,
            lora_rank=8,
            model_name="Qwen/Qwen3-0.6B",
        ),
        types.GetInfoResponse,
    ),
    (
        tw.GetInfoResponse(
            model_id="m",
            model_data=tw.ModelData(),
            optimizer_config=tw.OptimizerConfig(type="dimuon", version=1),
        ),
        types.GetInfoResponse,
    ),
    (tw.CopyWeightsResponse(tinker_path="tinker://s:train:2/weights/a"), types.CopyWeightsResponse),
    (tw.CreateSamplingSessionResponse(sampling_session_id="sess-1:sample:0"), SdkCreateSamplingSession),
    (
        tw.GetSamplerResponse(
            sampler_id="sess-1:sample:0",
            base_model="Qwen/Qwen3-0.6B",
            model_path="tinker://m/sampler_weights/s1",
        ),
        types.GetSamplerResponse,
    ),
    (tw.JoinSamplingSessionResponse(client_counter=3), SdkJoin),
    (
        tw.FuturesRetrieveResponse(
            completions=[
                tw.FutureFinished(request_id="r1", response_payload_uncompressed_size=10),
                tw.FutureFinished(request_id="r2"),
                tw.FutureFailed(request_id="r3"),
            ],
            cursor=7,
        ),
        types.FuturesRetrieveResponse,
    ),
    (RUN, types.TrainingRun),
    (
        tw.TrainingRun(
            training_run_id="r", base_model="b", model_owner="o", is_lora=False, last_request_time=NOW
        ),
        types.TrainingRun,
    ),
    (
        tw.TrainingRunsResponse(training_runs=[RUN], cursor=tw.Cursor(offset=0, limit=20, total_count=1)),
        types.TrainingRunsResponse,
    ),
    (
        tw.CheckpointsListResponse(
            checkpoints=[_checkpoint("ckpt1"), _checkpoint("s1", "sampler"), _checkpoint("e1", "external")]
        ),
        types.CheckpointsListResponse,
    ),
    (
        tw.CheckpointsListResponse(checkpoints=[], cursor=tw.Cursor(offset=100, limit=100, total_count=100)),
        types.CheckpointsListResponse,
    ),
    (
        tw.WeightsInfoResponse(
            base_model="Qwen/Qwen3-0.6B",
            is_lora=True,
            lora_rank=8,
            train_unembed=True,
            train_mlp=True,
            train_attn=False,
        ),
        types.WeightsInfoResponse,
    ),
    (
        tw.ExternalWeightsUrlsResponse(urls={"adapter_model.safetensors": "http://x/y"}, expires=NOW),
        SdkExternalUrls,
    ),
    (tw.ListSessionsResponse(sessions=["sess-1", "sess-2"]), types.ListSessionsResponse),
    (
        tw.GetSessionResponse(
            training_run_ids=["sess-1:train:0"], sampler_ids=["sess-1:sample:0"], display_name="run"
        ),
        types.GetSessionResponse,
    ),
    (tw.TraceExportResponse(status="pending"), _SessionTraceExportPollResponse),
    (tw.TraceExportResponse(status="failed", error="no trace"), _SessionTraceExportPollResponse),
    (
        tw.SessionSearchResponse(
            sessions=[
                tw.SessionSummary(
                    session_id="sess-1",
                    created_at=NOW,
                    owner="tml:user:1",
                    project_id="p",
                    checkpoints_count=2,
                    status=aw.SessionStatus(type="active"),
                ),
                tw.SessionSummary(
                    session_id="sess-0",
                    created_at=NOW,
                    owner="tml:user:1",
                    project_id="p",
                    checkpoints_count=0,
                    status=aw.SessionStatus(type="client_finished", reason=aw.FinishReason(type="success")),
                ),
            ],
            next_cursor=tw.SessionSearchCursor(last_created_at=NOW, last_session_id="sess-0"),
        ),
        types.SessionSearchResponse,
    ),
]


@pytest.mark.parametrize(
    ("struct", "model"), FUTURE_RESULTS + DIRECT_RESPONSES, ids=lambda v: type(v).__name__
)
def test_responses_validate_in_the_sdk_models_with_our_values(
    struct: msgspec.Struct, model: type[pydantic.BaseModel]
) -> None:
    sdk, body = _sdk_view(struct, model)
    declared = {key: value for key, value in body.items() if key in model.model_fields}
    _assert_subset(declared, sdk.model_dump(mode="json"))  # what we sent is what the SDK holds


@pytest.mark.parametrize(("struct", "model"), FUTURE_RESULTS, ids=lambda v: type(v).__name__)
def test_future_results_never_carry_an_error_key(
    struct: msgspec.Struct, model: type[pydantic.BaseModel]
) -> None:
    body = json.loads(msgspec.json.encode(struct))
    assert "error" not in body and body.get("type") != "try_again" and "status" not in body


def test_future_envelopes_carry_what_the_sdk_dispatches_on() -> None:
    assert json.loads(msgspec.json.encode(tw.TryAgainResponse(request_id="r", queue_state="active"))) == {
        "type": "try_again", "request_id": "r", "queue_state": "active"
    }  # fmt: skip
    assert json.loads(msgspec.json.encode(tw.CompleteMetadataResponse(response_payload_size=5))) == {
        "status": "complete_metadata", "response_payload_size": 5
    }  # fmt: skip
    failed = json.loads(msgspec.json.encode(tw.RequestFailedResponse(error="bad", category="server")))
    assert failed == {"error": "bad", "category": "server"}
    assert types.RequestFailedResponse.model_validate(failed).category is types.RequestErrorCategory.Server
    assert json.loads(msgspec.json.encode(tw.UntypedAPIFuture(request_id="r"))) == {"request_id": "r"}


def test_client_config_writes_every_flag_with_the_sdk_defaults() -> None:
    body = json.loads(msgspec.json.encode(tw.ClientConfigResponse()))
    sdk_defaults = types.ClientConfigResponse().model_dump()
    assert {k: body[k] for k in sdk_defaults} == sdk_defaults
    assert set(body) - set(sdk_defaults) == {
        "proto_write_fwdbwd",
        "fwd_via_fwdbwd",
        "create_model_via_load_weights",
    }
    assert (
        json.loads(msgspec.json.encode(tw.ClientDynamicConfigResponse())) == SdkDynamicConfig().model_dump()
    )


def test_checkpoint_listing_parses_into_sdk_checkpoints() -> None:
    listing = tw.CheckpointsListResponse(
        checkpoints=[_checkpoint("ckpt1"), _checkpoint("s1", "sampler")],
        cursor=tw.Cursor(offset=0, limit=100, total_count=2),
    )
    sdk = types.CheckpointsListResponse.model_validate_json(msgspec.json.encode(listing))
    assert [c.checkpoint_id for c in sdk.checkpoints] == ["weights/ckpt1", "sampler_weights/s1"]
    assert sdk.checkpoints[0].time == NOW and sdk.checkpoints[1].expires_at == NOW + dt.timedelta(hours=1)
    assert sdk.checkpoints[0].public is False and sdk.checkpoints[0].expires_at is None
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(sdk.checkpoints[1].tinker_path)
    assert (parsed.training_run_id, parsed.checkpoint_type, parsed.checkpoint_id) == (
        "sess-1:train:0",
        "sampler",
        "sampler_weights/s1",
    )


# --- JSON results for SDKs <= 0.24 ------------------------------------------------------


class _Legacy024SampledSequence(pydantic.BaseModel):
    """The SDK 0.24 pydantic shape (tinker/types/_pydantic_types/sampled_sequence.py)."""

    model_config = pydantic.ConfigDict(extra="ignore")
    stop_reason: Any
    tokens: list[int]
    logprobs: list[float] | None = None


class _Legacy024SampleResponse(pydantic.BaseModel):
    """The SDK 0.24 pydantic shape (tinker/types/_pydantic_types/sample_response.py)."""

    model_config = pydantic.ConfigDict(extra="ignore")
    sequences: list[_Legacy024SampledSequence]
    type: str = "sample"
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_cache_hit_tokens: int = 0


def test_legacy_forward_backward_json_matches_the_protobuf_result() -> None:
    outputs: list[dict[str, np.ndarray]] = [
        {"logprobs": np.array([-1.0, -2.0], np.float32), "ids": np.array([[1, 2], [3, 4]], np.int64)},
        {"logprobs": np.array([-0.5], np.float32), "ids": np.array([[5, 6, 7]], np.int32)},
    ]
    message = tp.forward_backward_output(outputs, {"loss:sum": 3.5})
    legacy = json.loads(msgspec.json.encode(tw.legacy_forward_backward_output(message)))
    assert set(legacy) == {"loss_fn_output_type", "loss_fn_outputs", "metrics"}
    via_proto = response_conv.deserialize_forward_backward_output(message.SerializeToString())
    assert (
        legacy["loss_fn_output_type"] == via_proto.loss_fn_output_type
        and legacy["metrics"] == via_proto.metrics
    )
    for json_datum, sdk_datum in zip(legacy["loss_fn_outputs"], via_proto.loss_fn_outputs, strict=True):
        for name, raw in json_datum.items():
            td = PydanticTensorData.model_validate(raw)
            assert (td.dtype, td.shape) == (sdk_datum[name].dtype, sdk_datum[name].shape)
            np.testing.assert_array_equal(td.to_numpy(), sdk_datum[name].to_numpy())


def test_legacy_sample_json_matches_the_protobuf_result() -> None:
    ids = np.array([[0, 0], [5, 6], [7, 0]], np.int32)
    lps = np.array([[-99999.0, -99999.0], [-0.5, -1.0], [-0.25, -99999.0]], np.float32)
    response = pb.SampleResponse(
        sequences=[
            pr.sampled_sequence([1, 2], [-0.5, -0.25], "length"),
            pr.sampled_sequence([3], None, "stop"),
        ],
        prompt_logprobs=pr.float32_bytes([math.nan, -1.5, -0.75]),
        topk_prompt_logprobs=pr.topk_logprobs(ids, lps),
        prompt_cache_hit_tokens=1,
    )
    legacy_body = msgspec.json.encode(tw.legacy_sample_response(response))
    assert json.loads(legacy_body)["type"] == "sample"
    legacy = _Legacy024SampleResponse.model_validate_json(legacy_body)
    sdk = response_conv.deserialize_sample_response(response.SerializeToString())
    assert legacy.prompt_logprobs == sdk.prompt_logprobs == [None, -1.5, -0.75]
    assert (
        legacy.topk_prompt_logprobs
        == sdk.topk_prompt_logprobs
        == [None, [(5, -0.5), (6, -1.0)], [(7, -0.25)]]
    )
    assert legacy.prompt_cache_hit_tokens == 1
    for ours, theirs in zip(legacy.sequences, sdk.sequences, strict=True):
        assert (ours.stop_reason, ours.tokens, ours.logprobs) == (
            theirs.stop_reason,
            theirs.tokens,
            theirs.logprobs,
        )
    assert "logprobs" not in json.loads(legacy_body)["sequences"][1]


def test_json_datums_carry_provenance_spans_and_samples_their_recording_flag() -> None:
    """The JSON form of a datum's provenance (which the JSON-era SDK never sends) mirrors the
    protobuf arms: tagged spans, decoded into the same structs."""
    body = {
        "forward_backward_input": {
            "loss_fn": "stable_reinforce",
            "data": [
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                    "loss_fn_inputs": {"target_tokens": {"data": [2, 3, 4], "dtype": "int64"}},
                    "model_input_spans": [
                        {"type": "prompt_tokens", "sequence_id": "s:sample:0:1:0", "length": 2},
                        {"type": "sampled_tokens", "sequence_id": "s:sample:0:1:0", "offset": 0, "length": 1},
                    ],
                    "loss_fn_input_spans": [
                        {"type": "sampled_tokens", "sequence_id": "s:sample:0:1:0", "offset": 0, "length": 3}
                    ],
                },
                {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1]}]}},
            ],
        },
        "model_id": "s:train:0",
        "seq_id": 1,
    }
    request = msgspec.json.decode(json.dumps(body).encode(), type=tw.LegacyForwardBackwardRequest)
    first, second = request.forward_backward_input.data
    assert first.model_input_spans == [
        tp.PromptProvenanceSpan(sequence_id="s:sample:0:1:0", offset=0, length=2),
        tp.SampledProvenanceSpan(sequence_id="s:sample:0:1:0", offset=0, length=1),
    ]
    assert first.loss_fn_input_spans == [tp.SampledProvenanceSpan(sequence_id="s:sample:0:1:0", length=3)]
    assert second.model_input_spans is None and second.loss_fn_input_spans is None
    sample = types.SampleRequest(
        prompt=types.ModelInput.from_ints([1, 2]),
        sampling_params=types.SamplingParams(max_tokens=2),
        num_samples=1,
        sampling_session_id="s:sample:0",
        seq_id=0,
        record_stability_info=True,
    )
    decoded = msgspec.json.decode(json.dumps(model_dump(sample, mode="json")).encode(), type=tw.SampleRequest)
    assert decoded.record_stability_info is True
