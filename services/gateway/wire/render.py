"""Renders a structured result as the SDK expects it: protobuf when `Accept` asks, JSON otherwise."""

from __future__ import annotations

import numpy as np
from litestar import Response

from libs.contracts.results import (
    DatumResult,
    Failure,
    ForwardBackwardResult,
    RequestResult,
    SampleResult,
    TopK,
)
from services.gateway.wire import proto
from services.gateway.wire import tinker_public_pb2 as pb
from services.gateway.wire import tinker_wire as w

PROTOBUF = "application/x-protobuf"


def forward_backward_proto(result: ForwardBackwardResult) -> pb.ForwardBackwardOutput:
    outputs = [
        {"logprobs": _logprobs(d), "loss": np.asarray([d.loss], dtype=np.float32)} for d in result.outputs
    ]
    return proto.forward_backward_output(outputs, result.metrics)


def _logprobs(datum: DatumResult) -> np.ndarray:
    """[N], or [N, K] for top-K targets."""
    flat = np.frombuffer(datum.logprobs, dtype="<f4")
    return flat.reshape(-1, datum.k) if datum.k else flat


def _topk(topk: TopK | None) -> pb.TopkLogprobs | None:
    if topk is None:
        return None
    return pb.TopkLogprobs(token_ids=topk.token_ids, logprobs=topk.logprobs, k=topk.k, length=topk.length)


def sample_proto(result: SampleResult) -> pb.SampleResponse:
    return pb.SampleResponse(
        sequences=[
            pb.SampledSequence(
                stop_reason=pb.STOP_REASON_LENGTH if seq.stop_reason == "length" else pb.STOP_REASON_STOP,
                tokens=seq.tokens,
                logprobs=seq.logprobs,
                topk_sampled_logprobs=_topk(seq.topk),
            )
            for seq in result.sequences
        ],
        prompt_logprobs=result.prompt_logprobs,
        topk_prompt_logprobs=_topk(result.topk_prompt),
        prompt_cache_hit_tokens=result.prompt_cache_hit_tokens,
    )


def render(result: RequestResult, accept: str) -> Response[object]:
    body = result.body
    wants_proto = PROTOBUF in accept
    if isinstance(body, Failure):
        category = body.category if body.category in ("user", "server", "unknown") else "unknown"
        return Response(w.RequestFailedResponse(error=body.error, category=category))  # type: ignore[arg-type]
    if isinstance(body, ForwardBackwardResult):
        message = forward_backward_proto(body)
        if wants_proto:
            return Response(message.SerializeToString(), media_type=PROTOBUF)
        return Response(w.legacy_forward_backward_output(message))
    if isinstance(body, SampleResult):
        sample = sample_proto(body)
        if wants_proto:
            return Response(sample.SerializeToString(), media_type=PROTOBUF)
        return Response(w.legacy_sample_response(sample))
    return Response(body)  # one of the SDK's small response types (results.JsonResult)
