"""The gateway's protobuf wire against the real SDK (tinker 0.38, tests only).

Requests are built by the SDK's own encoder (``tinker.proto.request_conv``) or its generated
pb2 classes and decoded by ``proto``; results are built by ``proto`` and decoded by the SDK's
``tinker.proto.response_conv``. The ``.proto`` text and the checked-in generated module are
checked against the descriptor embedded in the SDK.
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from google.protobuf import descriptor_pb2
from tinker import types
from tinker.proto import request_conv, response_conv
from tinker.proto import tinker_public_pb2 as pb

from services.gateway.tests import proto_results as pr
from services.gateway.wire import proto as tp
from services.gateway.wire import tinker_public_pb2 as gpb


def _raw(inputs: dict[str, Any]) -> Any:
    """Loss inputs as users pass them (lists, numpy, torch); the SDK converts them itself."""
    return inputs


# --- the .proto text ---------------------------------------------------------------------

_SCALARS = {
    descriptor_pb2.FieldDescriptorProto.TYPE_DOUBLE: "double",
    descriptor_pb2.FieldDescriptorProto.TYPE_FLOAT: "float",
    descriptor_pb2.FieldDescriptorProto.TYPE_INT64: "int64",
    descriptor_pb2.FieldDescriptorProto.TYPE_UINT64: "uint64",
    descriptor_pb2.FieldDescriptorProto.TYPE_INT32: "int32",
    descriptor_pb2.FieldDescriptorProto.TYPE_UINT32: "uint32",
    descriptor_pb2.FieldDescriptorProto.TYPE_BOOL: "bool",
    descriptor_pb2.FieldDescriptorProto.TYPE_STRING: "string",
    descriptor_pb2.FieldDescriptorProto.TYPE_BYTES: "bytes",
}


def _sdk_schema() -> tuple[dict[str, dict[str, tuple[Any, ...]]], dict[str, dict[str, int]]]:
    """{message: {field: (number, type, label, oneof)}} and {enum: {value: number}} from the SDK."""
    fd = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(fd)
    assert (fd.package, fd.syntax) == ("tinker_public", "proto3")

    def type_of(field: descriptor_pb2.FieldDescriptorProto) -> str:
        return _SCALARS.get(field.type) or field.type_name.rsplit(".", 1)[-1]

    messages = {}
    for message in fd.message_type:
        entries = {nested.name: nested for nested in message.nested_type if nested.options.map_entry}
        fields = {}
        for field in message.field:
            entry = entries.get(field.type_name.rsplit(".", 1)[-1])
            if entry is not None:
                key, value = entry.field
                kind, label = f"map<{type_of(key)},{type_of(value)}>", ""
            else:
                kind = type_of(field)
                label = "repeated" if field.label == field.LABEL_REPEATED else ""
                label = "optional" if field.proto3_optional else label
            in_oneof = field.HasField("oneof_index") and not field.proto3_optional
            oneof = message.oneof_decl[field.oneof_index].name if in_oneof else ""
            fields[field.name] = (field.number, kind, label, oneof)
        messages[message.name] = fields
    enums = {enum.name: {v.name: v.number for v in enum.value} for enum in fd.enum_type}
    return messages, enums


def _our_schema() -> tuple[dict[str, dict[str, tuple[Any, ...]]], dict[str, dict[str, int]]]:
    text = (Path(tp.__file__).parent / "tinker_public.proto").read_text()
    text = re.sub(r"//[^\n]*", "", text)
    assert re.search(r'syntax\s*=\s*"proto3"\s*;', text) and re.search(r"package\s+tinker_public\s*;", text)
    field_re = re.compile(r"(optional\s+|repeated\s+)?(map<\s*\w+\s*,\s*\w+\s*>|\w+)\s+(\w+)\s*=\s*(\d+)\s*;")
    messages: dict[str, dict[str, tuple[Any, ...]]] = {}
    enums: dict[str, dict[str, int]] = {}
    for kind, name, body in re.findall(r"(message|enum)\s+(\w+)\s*\{((?:[^{}]|\{[^{}]*\})*)\}", text):
        if kind == "enum":
            enums[name] = {v: int(n) for v, n in re.findall(r"(\w+)\s*=\s*(\d+)\s*;", body)}
            continue
        fields = {}
        oneofs = {m.span(): m.group(1) for m in re.finditer(r"oneof\s+(\w+)\s*\{[^{}]*\}", body)}
        for match in field_re.finditer(body):
            oneof = next((o for (a, b), o in oneofs.items() if a <= match.start() < b), "")
            type_text = re.sub(r"\s+", "", match.group(2))
            fields[match.group(3)] = (int(match.group(4)), type_text, (match.group(1) or "").strip(), oneof)
        messages[name] = fields
    return messages, enums


def test_proto_text_matches_the_sdk_descriptor() -> None:
    """Every message, field (name, number, type, label, oneof) and enum value agrees."""
    assert _our_schema() == _sdk_schema()


def test_generated_module_is_the_sdk_descriptor_byte_for_byte() -> None:
    """The checked-in tinker_public_pb2 compiles to exactly the SDK's descriptor (so both load
    into one descriptor pool); run `make proto` after editing the .proto."""
    assert gpb.DESCRIPTOR.serialized_pb == pb.DESCRIPTOR.serialized_pb
    assert gpb.ForwardBackwardRequest is pb.ForwardBackwardRequest


# --- (a) requests made by the SDK's own encoder -----------------------------------------


def _sdk_request_bytes(
    data: list[types.Datum], loss_fn: types.LossFnType, config: Any = None, *, forward_only: bool = False
) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="sess-1:train:0",
        seq_id=7,
    )
    message = request_conv.forward_backward_request_to_proto(request)
    message.forward_only = forward_only  # what AsyncTrainingResource.forward_backward does
    return message.SerializeToString()


def _assert_datum_matches(ours: Any, sdk: types.Datum, spans: tuple[Any, Any]) -> None:
    assert len(ours.model_input) == len(sdk.model_input.chunks)
    for mine, theirs in zip(ours.model_input, sdk.model_input.chunks, strict=True):
        if isinstance(theirs, types.EncodedTextChunk):
            assert mine.WhichOneof("chunk") == "encoded_text"
            assert np.frombuffer(mine.encoded_text.tokens, "<i4").tolist() == list(theirs.tokens)
        elif isinstance(theirs, types.ImageChunk):
            assert mine.WhichOneof("chunk") == "image"
            image = mine.image
            expected = image.expected_tokens if image.HasField("expected_tokens") else None
            assert (image.data, image.format, expected) == (
                theirs.data,
                theirs.format,
                theirs.expected_tokens,
            )
            assert not image.HasField("override_dimensions")
        else:
            assert isinstance(theirs, types.DmelChunk) and mine.WhichOneof("chunk") == "dmel"
            assert mine.dmel.dmel == theirs.dmel
    assert set(ours.loss_fn_inputs) == set(sdk.loss_fn_inputs)
    for name, td in sdk.loss_fn_inputs.items():
        tensor = ours.loss_fn_inputs[name]
        assert tensor.dtype == (pb.DTYPE_FLOAT32 if td.dtype == "float32" else pb.DTYPE_INT64)
        assert (tensor.WhichOneof("encoding") == "sparse_csr") == (td.sparse_crow_indices is not None)
        expected = td.to_numpy()
        got = tp.tensor_to_numpy(tensor, where=name)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)
    for mine_spans, sdk_spans in zip(spans, (sdk.model_input_spans, sdk.loss_fn_input_spans), strict=True):
        expected_spans = [(type(s).__name__, s.sequence_id, s.offset, s.length) for s in sdk_spans or []]
        assert [(type(s).__name__, s.sequence_id, s.offset, s.length) for s in mine_spans] == expected_spans


def test_cross_entropy_request_from_the_sdk_decodes_field_for_field() -> None:
    """Token lists, int64 targets, float32 weights, two datums of different lengths."""
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs=_raw({"target_tokens": [2, 3, 4], "weights": [0.0, 1.0, 1.0]}),
        ),
        types.Datum(
            model_input=types.ModelInput(
                chunks=[types.EncodedTextChunk(tokens=[9, 8]), types.EncodedTextChunk(tokens=[151_643])]
            ),
            loss_fn_inputs=_raw(
                {
                    "target_tokens": np.array([8, 151_643, 0]),
                    "weights": np.array([1.0, 1.0, 0.5], np.float32),
                }
            ),
        ),
    ]
    request = tp.decode_forward_backward_request(_sdk_request_bytes(data, "cross_entropy"))
    assert (request.model_id, request.seq_id, request.loss_fn, request.forward_only) == (
        "sess-1:train:0",
        7,
        "cross_entropy",
        False,
    )
    assert request.config == {}
    for ours, sdk, spans in zip(request.data, data, request.spans, strict=True):
        _assert_datum_matches(ours, sdk, spans)
    assert tp.model_input_tokens(request.data[1]).tolist() == [9, 8, 151_643]


def test_ppo_config_numbers_and_text_merge_from_both_maps() -> None:
    """The SDK writes numbers to both config maps and text to v2 only; one merged config comes out."""
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([5, 6]),
            loss_fn_inputs=_raw(
                {"target_tokens": [6, 7], "logprobs": [-0.5, -1.5], "advantages": [1.0, -1.0]}
            ),
        )
    ]
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "loss_id": "custom-7"}
    request = tp.decode_forward_backward_request(_sdk_request_bytes(data, "ppo", config, forward_only=True))
    assert request.forward_only is True
    assert request.config == config
    _assert_datum_matches(request.data[0], data[0], request.spans[0])


def test_2d_torch_targets_arrive_as_sparse_csr_and_densify_exactly() -> None:
    """The SDK auto-sparsifies 2-D target_tokens/weights when CSR is smaller."""
    targets = torch.zeros(6, 5, dtype=torch.int64)
    targets[0, 1], targets[3, 4], targets[5, 0] = 11, 12, 13
    weights = torch.zeros(6, 5)
    weights[0, 1], weights[3, 4] = 1.0, -0.25
    dense_targets = torch.arange(12, dtype=torch.int64).reshape(3, 4) + 1  # no zeros: stays dense
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(list(range(6))),
            loss_fn_inputs=_raw({"target_tokens": targets, "weights": weights}),
        ),
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs=_raw({"target_tokens": dense_targets}),
        ),
    ]
    assert data[0].loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
    request = tp.decode_forward_backward_request(_sdk_request_bytes(data, "cross_entropy"))
    sparse = request.data[0].loss_fn_inputs["target_tokens"]
    assert sparse.WhichOneof("encoding") == "sparse_csr" and list(sparse.shape) == [6, 5]
    np.testing.assert_array_equal(tp.tensor_to_numpy(sparse), targets.numpy())
    np.testing.assert_array_equal(
        tp.tensor_to_numpy(request.data[0].loss_fn_inputs["weights"]), weights.numpy()
    )
    np.testing.assert_array_equal(tp.tensor_to_numpy(sparse, pad_value=-1)[1], [-1] * 5)
    for ours, sdk, spans in zip(request.data, data, request.spans, strict=True):
        _assert_datum_matches(ours, sdk, spans)


def test_provenance_spans_and_image_and_audio_chunks_survive() -> None:
    with_spans = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4, 5]),
        loss_fn_inputs=_raw(
            {"target_tokens": [2, 3, 4, 5, 6], "logprobs": [0.0] * 5, "advantages": [0.5] * 5}
        ),
    ).with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id="req-1:seq:0", offset=0, length=3),
            types.SampledProvenanceSpan(sequence_id="req-1:seq:0", offset=0, length=2),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id="req-1:seq:0", offset=1, length=2),
            types.SampledProvenanceSpan(sequence_id="req-1:seq:0", offset=2**40, length=3),
        ],
    )
    multimodal = types.Datum(
        model_input=types.ModelInput(
            chunks=[
                types.EncodedTextChunk(tokens=[7]),
                types.ImageChunk(data=b"\x89PNG\r\n\x1a\n fake", format="png", expected_tokens=4),
                types.ImageChunk(data=b"\xff\xd8 jpeg", format="jpeg"),
                types.DmelChunk(dmel=b"\x00\x01 audio"),
            ]
        ),
        loss_fn_inputs=_raw({"target_tokens": [1] * 6, "weights": [1.0] * 6}),
    )
    request = tp.decode_forward_backward_request(
        _sdk_request_bytes([with_spans, multimodal], "stable_reinforce", {"kl_coeff": 0.1})
    )
    assert request.config == {"kl_coeff": 0.1}
    for ours, sdk, spans in zip(request.data, [with_spans, multimodal], request.spans, strict=True):
        _assert_datum_matches(ours, sdk, spans)
    with pytest.raises(ValueError, match="ImageChunk"):
        tp.model_input_tokens(request.data[1])


# --- (b) results read by the SDK's own decoder ------------------------------------------


def test_forward_backward_output_is_read_back_by_the_sdk() -> None:
    """Datums of different lengths, float and int fields, and a trailing-shape change
    (which starts a second ArrayRecord) all come back in order."""
    outputs: list[dict[str, np.ndarray]] = [
        {
            "logprobs": np.array([-1.0, -2.5, -0.125], np.float32),
            "elementwise_loss": np.array([1.0, 2.5, 0.125]),
            "ids": np.array([[1, 2], [3, 4], [5, 6]], np.int64),
        },
        {
            "logprobs": np.array([-3.0], np.float32),
            "elementwise_loss": np.array([3.0], np.float32),
            "ids": np.array([[7, 8]], np.int64),
        },
        {
            "logprobs": np.zeros(0, np.float32),
            "elementwise_loss": np.zeros(0),
            "ids": np.zeros((0, 2), np.int32),
        },
        {
            "logprobs": np.array([-0.5, -0.25], np.float32),
            "elementwise_loss": np.array([0.5, 0.25]),
            "ids": np.array([[1, 2, 3], [4, 5, 6]], np.int64),
        },
    ]
    metrics = {"loss:sum": 7.25, "tokens:sum": 9.0, "lr:mean": 1e-4}
    message = tp.forward_backward_output(outputs, metrics)
    assert [r.num_datums for r in message.loss_fn_outputs] == [2, 1, 1]  # int32 ids, then 3-wide ids
    sdk = response_conv.deserialize_forward_backward_output(message.SerializeToString())
    assert sdk.loss_fn_output_type == "ArrayRecord"
    assert sdk.metrics == metrics
    assert len(sdk.loss_fn_outputs) == len(outputs)
    for got, want in zip(sdk.loss_fn_outputs, outputs, strict=True):
        assert set(got) == set(want)
        for name, array in want.items():
            expected_dtype = "float32" if array.dtype.kind == "f" else "int64"
            assert got[name].dtype == expected_dtype
            assert got[name].shape == list(array.shape)
            np.testing.assert_array_equal(
                got[name].to_numpy(), array.astype(np.float32 if expected_dtype == "float32" else np.int64)
            )
    # A prefixed output type is cut to its last part, as the SDK does.
    prefixed = tp.forward_backward_output(outputs[:1], {}, loss_fn_output_type="tinker:ArrayRecord")
    assert (
        response_conv.deserialize_forward_backward_output(prefixed.SerializeToString()).loss_fn_output_type
        == "ArrayRecord"
    )


def test_forward_backward_output_edge_cases() -> None:
    empty = response_conv.deserialize_forward_backward_output(
        tp.forward_backward_output([], {"loss:sum": 0.0}).SerializeToString()
    )
    assert empty.loss_fn_outputs == [] and empty.metrics == {"loss:sum": 0.0}
    with pytest.raises(ValueError, match="name:reduction"):
        tp.forward_backward_output([], {"loss": 1.0})
    with pytest.raises(ValueError, match="name:reduction"):
        tp.forward_backward_output([], {"a:b:c": 1.0})
    with pytest.raises(ValueError, match="fields"):
        tp.forward_backward_output([{"logprobs": np.zeros(1)}, {"other": np.zeros(1)}], {})
    batched = tp.forward_backward_output(
        [{"x": np.arange(6).reshape(3, 2)}, {"x": np.arange(2).reshape(1, 2)}], {}
    )
    split = tp.batched_tensor_datums(batched.loss_fn_outputs[0].fields["x"])
    assert [a.tolist() for a in split] == [[[0, 1], [2, 3], [4, 5]], [[0, 1]]]


def _topk(rows: list[list[tuple[int, float]] | None], k: int) -> pb.TopkLogprobs:
    ids = np.zeros((len(rows), k), np.int32)
    lps = np.full((len(rows), k), -99999.0, np.float32)
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row or []):
            ids[i, j], lps[i, j] = token, logprob
    return pr.topk_logprobs(ids, lps)


def test_sample_response_is_read_back_by_the_sdk() -> None:
    prompt_topk: list[list[tuple[int, float]] | None] = [
        None,
        [(5, -0.5), (6, -1.0), (7, -2.0)],
        [(8, -0.25)],
    ]
    sample_topk: list[list[tuple[int, float]] | None] = [[(1, -0.125), (2, -4.0)], [(3, -0.5)]]
    alt_tokens = pr.tensor_from_numpy(np.array([[4, 5], [6, 7]], np.int64))
    alt_logprobs = pr.tensor_from_numpy(np.array([[-1.0, -2.0], [-3.0, -4.0]], np.float32))
    response = pb.SampleResponse(
        sequences=[
            pr.sampled_sequence([10, 11], [-0.5, -0.75], "stop", topk=_topk(sample_topk, 2)),
            pr.sampled_sequence([12, 13, 14, 15], [-0.1, -0.2, -0.3, -0.4], "length"),
            pr.sampled_sequence([16], None, "stop"),
        ],
        prompt_logprobs=pr.float32_bytes([math.nan, -1.25, -0.5]),
        topk_prompt_logprobs=_topk(prompt_topk, 3),
        prompt_cache_hit_tokens=2,
        target_prompt_logprobs=pb.Tensor(
            dtype=pb.DTYPE_FLOAT32,
            shape=[2, 3],
            sparse_csr=pb.SparseCsr(
                values=pr.float32_bytes([-0.5, -1.5]),
                crow_indices=np.array([0, 1, 2], "<i8").tobytes(),
                col_indices=np.array([2, 0], "<i8").tobytes(),
            ),
        ),
        prompt_alt_tokens=pb.PromptAltTokens(tokens=alt_tokens, logprobs=alt_logprobs),
    )
    sdk = response_conv.deserialize_sample_response(response.SerializeToString())
    assert [s.tokens for s in sdk.sequences] == [[10, 11], [12, 13, 14, 15], [16]]
    assert [s.stop_reason for s in sdk.sequences] == ["stop", "length", "stop"]
    assert sdk.sequences[0].logprobs == [-0.5, -0.75]
    # logprobs travel as float32: exactly the float32 values, nothing else
    assert sdk.sequences[1].logprobs == np.array([-0.1, -0.2, -0.3, -0.4], np.float32).tolist()
    assert sdk.sequences[2].logprobs is None
    assert sdk.sequences[0].topk_logprobs == sample_topk
    assert sdk.sequences[1].topk_logprobs is None
    assert sdk.prompt_logprobs == [None, -1.25, -0.5]
    assert sdk.topk_prompt_logprobs == prompt_topk
    assert sdk.prompt_cache_hit_tokens == 2
    assert sdk.target_prompt_logprobs is not None
    np.testing.assert_array_equal(sdk.target_prompt_logprobs.to_numpy(), [[0, 0, -0.5], [-1.5, 0, 0]])
    assert sdk.prompt_alt_tokens is not None
    assert sdk.prompt_alt_tokens.tokens.tolist() == [[4, 5], [6, 7]]
    assert sdk.prompt_alt_tokens.logprobs.tolist() == [[-1.0, -2.0], [-3.0, -4.0]]


def test_minimal_sample_response_has_no_optional_parts() -> None:
    sdk = response_conv.deserialize_sample_response(
        pb.SampleResponse(sequences=[pr.sampled_sequence([1], [-0.5], "stop")]).SerializeToString()
    )
    assert sdk.prompt_logprobs is None and sdk.topk_prompt_logprobs is None
    assert sdk.target_prompt_logprobs is None and sdk.prompt_alt_tokens is None
    assert sdk.prompt_cache_hit_tokens == 0 and sdk.sequences[0].tokens == [1]


# --- (c) random requests through the SDK's pb2 ------------------------------------------


def _random_text(rng: random.Random) -> str:
    return "".join(rng.choice("abcXYZ:/_-é漢🙂") for _ in range(rng.randint(0, 12)))


def _random_tensor(rng: random.Random, msg: Any) -> None:
    dtype = rng.choice([pb.DTYPE_FLOAT32, pb.DTYPE_INT64, pb.DTYPE_INT32, pb.DTYPE_BFLOAT16])
    np_dtype = {
        pb.DTYPE_FLOAT32: "<f4",
        pb.DTYPE_INT64: "<i8",
        pb.DTYPE_INT32: "<i4",
        pb.DTYPE_BFLOAT16: "<u2",
    }[dtype]
    msg.dtype = dtype
    if rng.random() < 0.3:
        rows, cols = rng.randint(0, 5), rng.randint(1, 6)
        mask = np.array([[rng.random() < 0.3 for _ in range(cols)] for _ in range(rows)], bool).reshape(
            rows, cols
        )
        counts = mask.sum(axis=1)
        msg.shape.extend([rows, cols])
        msg.sparse_csr.values = np.arange(1, int(mask.sum()) + 1).astype(np_dtype).tobytes()
        msg.sparse_csr.crow_indices = np.concatenate([[0], np.cumsum(counts)]).astype("<i8").tobytes()
        msg.sparse_csr.col_indices = np.nonzero(mask)[1].astype("<i8").tobytes()
    else:
        shape = [rng.randint(0, 4) for _ in range(rng.randint(1, 3))]
        msg.shape.extend(shape)
        msg.dense = (
            np.array([rng.randint(-1000, 1000) for _ in range(math.prod(shape))]).astype(np_dtype).tobytes()
        )


def _random_request(rng: random.Random) -> Any:
    msg = pb.ForwardBackwardRequest(
        model_id=_random_text(rng),
        seq_id=rng.choice([0, 1, 2**31 - 1, -1, -(2**31)]),
        loss_fn=_random_text(rng),
        forward_only=rng.random() < 0.5,
    )
    for _ in range(rng.randint(0, 3)):
        msg.loss_fn_config[_random_text(rng)] = rng.uniform(-1e9, 1e9)
    for _ in range(rng.randint(0, 3)):
        value = msg.loss_fn_config_v2[_random_text(rng)]
        if rng.random() < 0.5:
            value.number = rng.choice([0.0, -0.0, math.inf, rng.uniform(-1, 1)])
        else:
            value.text = _random_text(rng)
    for _ in range(rng.randint(0, 4)):
        datum = msg.data.add()
        for _ in range(rng.randint(0, 3)):
            chunk = datum.model_input.add()
            kind = rng.random()
            if kind < 0.6:
                chunk.encoded_text.tokens = np.array(
                    [rng.randint(-(2**31), 2**31 - 1) for _ in range(rng.randint(0, 20))], "<i4"
                ).tobytes()
            elif kind < 0.8:
                chunk.image.data = rng.randbytes(rng.randint(0, 30))
                chunk.image.format = rng.choice(["png", "jpeg"])
                if rng.random() < 0.5:
                    chunk.image.expected_tokens = rng.randint(-5, 5000)
                if rng.random() < 0.3:
                    chunk.image.override_dimensions.width = rng.randint(0, 2**32 - 1)
                    chunk.image.override_dimensions.height = rng.randint(0, 2**32 - 1)
            else:
                chunk.dmel.dmel = rng.randbytes(rng.randint(0, 30))
        for i in range(rng.randint(0, 3)):
            _random_tensor(rng, datum.loss_fn_inputs[f"{i}{_random_text(rng)}"])
        for spans in (datum.model_input_spans, datum.loss_fn_input_spans):
            for _ in range(rng.randint(0, 3)):
                span = spans.add()
                arm = span.prompt_tokens if rng.random() < 0.5 else span.sampled_tokens
                arm.sequence_id = _random_text(rng)
                arm.offset = rng.choice([0, 1, 2**62, -5])
                arm.length = rng.randint(0, 2**40)
    return msg


def _assert_same_request(ours: tp.ForwardBackwardRequest, theirs: Any) -> None:
    """What the gateway reads from a request equals what the SDK's own pb2 classes read."""
    assert (ours.model_id, ours.seq_id, ours.loss_fn, ours.forward_only) == (
        theirs.model_id,
        theirs.seq_id,
        theirs.loss_fn,
        theirs.forward_only,
    )
    expected_config: dict[str, float | str] = dict(theirs.loss_fn_config)
    for key, value in theirs.loss_fn_config_v2.items():
        expected_config[key] = getattr(value, value.WhichOneof("value"))
    assert ours.config == expected_config
    assert len(ours.data) == len(theirs.data) == len(ours.spans)
    for datum, sdk_datum, spans in zip(ours.data, theirs.data, ours.spans, strict=True):
        known = pb.Datum()
        known.CopyFrom(datum)
        known.DiscardUnknownFields()  # a newer SDK's fields are skipped, not refused
        assert known == sdk_datum
        for tensor in datum.loss_fn_inputs.values():
            assert tp.tensor_to_numpy(tensor).shape == tuple(tensor.shape)
        for mine, sdk_spans in zip(
            spans, (sdk_datum.model_input_spans, sdk_datum.loss_fn_input_spans), strict=True
        ):
            expected = []
            for span in sdk_spans:
                arm = span.WhichOneof("span")
                inner = getattr(span, arm)
                kind = tp.PromptProvenanceSpan if arm == "prompt_tokens" else tp.SampledProvenanceSpan
                expected.append(kind(sequence_id=inner.sequence_id, offset=inner.offset, length=inner.length))
            assert mine == expected


def test_random_requests_from_sdk_pb2_decode_identically() -> None:
    rng = random.Random(1234)
    for _ in range(300):
        message = _random_request(rng)
        _assert_same_request(tp.decode_forward_backward_request(message.SerializeToString()), message)


def test_unknown_fields_are_skipped_at_every_level() -> None:
    """Fields a newer SDK might add (any wire type) are ignored, top level and nested."""
    rng = random.Random(7)
    message = _random_request(rng)
    while not message.data:
        message = _random_request(rng)
    unknown = (
        bytes([0x98, 0x06, 0x2A])
        + bytes([0xA5, 0x06])
        + b"\x01\x02\x03\x04"
        + bytes([0xA9, 0x06])
        + b"12345678"
        + bytes([0xB2, 0x06, 0x03])
        + b"xyz"
    )
    datum = message.data[0].SerializeToString() + unknown
    tail = b"".join(
        b"\x1a" + _varint(len(d.SerializeToString())) + d.SerializeToString() for d in message.data[1:]
    )
    head = pb.ForwardBackwardRequest()
    head.CopyFrom(message)
    del head.data[:]
    body = unknown + head.SerializeToString() + b"\x1a" + _varint(len(datum)) + datum + tail + unknown
    _assert_same_request(tp.decode_forward_backward_request(body), message)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# --- malformed input --------------------------------------------------------------------


def _error(body: bytes) -> str:
    with pytest.raises(tp.ProtoDecodeError) as info:
        tp.decode_forward_backward_request(body)
    return str(info.value)


def test_malformed_requests_name_the_field() -> None:
    assert "ForwardBackwardRequest.model_id" in _error(b"\x08\x05")  # varint where a string belongs
    assert "ForwardBackwardRequest.seq_id" in _error(b"\x12\x01x")
    assert "invalid UTF-8" in _error(b"\x0a\x02\xff\xfe")
    assert "truncated" in _error(b"\x0a\x05ab")
    bad_dtype = pb.ForwardBackwardRequest()
    bad_dtype.data.add().loss_fn_inputs["weights"].dtype = 1
    body = bad_dtype.SerializeToString().replace(b"\x18\x01", b"\x18\x09")
    assert "ForwardBackwardRequest.data[0].loss_fn_inputs['weights'].dtype" in _error(body)
    empty_chunk = pb.ForwardBackwardRequest()
    empty_chunk.data.add().model_input.add()
    assert "ForwardBackwardRequest.data[0].model_input[0]" in _error(empty_chunk.SerializeToString())
    assert "wire type 3" in _error(b"\x0b")  # groups are not proto3


def test_v2_entry_without_number_or_text_is_rejected() -> None:
    message = pb.ForwardBackwardRequest()
    message.loss_fn_config["beta"] = 0.5
    message.loss_fn_config_v2["beta"].SetInParent()
    with pytest.raises(tp.ProtoDecodeError, match=r"loss_fn_config_v2\['beta'\]"):
        tp.decode_forward_backward_request(message.SerializeToString())


def test_every_truncation_and_corruption_raises_only_proto_decode_error() -> None:
    rng = random.Random(99)
    message = _random_request(rng)
    while len(message.SerializeToString()) < 200:
        message = _random_request(rng)
    body = message.SerializeToString()
    for cut in range(len(body)):
        try:
            tp.decode_forward_backward_request(body[:cut])
        except tp.ProtoDecodeError:
            pass
    for _ in range(500):
        corrupt = bytearray(body)
        for _ in range(rng.randint(1, 4)):
            corrupt[rng.randrange(len(corrupt))] = rng.randrange(256)
        try:
            request = tp.decode_forward_backward_request(bytes(corrupt))
            for datum in request.data:
                for tensor in datum.loss_fn_inputs.values():
                    tp.tensor_to_numpy(tensor)
        except tp.ProtoDecodeError:
            pass


def test_tensor_helpers_reject_inconsistent_sizes() -> None:
    with pytest.raises(tp.ProtoDecodeError, match="whole number"):
        tp.tensor_to_numpy(pb.Tensor(dtype=pb.DTYPE_INT64, shape=[1], dense=b"\x00" * 5))
    with pytest.raises(tp.ProtoDecodeError, match=r"weights\.shape"):
        tp.tensor_to_numpy(
            pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 2], dense=b"\x00" * 12), where="weights"
        )
    with pytest.raises(tp.ProtoDecodeError, match="unsupported dtype"):
        tp.tensor_to_numpy(pb.Tensor(dense=b""))
    bad_csr = pb.SparseCsr(
        values=pr.float32_bytes([1.0]),
        crow_indices=np.array([0, 1], "<i8").tobytes(),
        col_indices=np.array([5], "<i8").tobytes(),
    )
    with pytest.raises(tp.ProtoDecodeError, match="sparse_csr"):
        tp.tensor_to_numpy(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 3], sparse_csr=bad_csr))
    assert tp.tensor_to_numpy(
        pb.Tensor(dtype=pb.DTYPE_INT64, dense=np.arange(3, dtype="<i8").tobytes())
    ).tolist() == [0, 1, 2]
    bf16 = pb.Tensor(dtype=pb.DTYPE_BFLOAT16, shape=[2], dense=np.array([0x3F80, 0xC000], "<u2").tobytes())
    assert tp.tensor_to_numpy(bf16).tolist() == [1.0, -2.0]
