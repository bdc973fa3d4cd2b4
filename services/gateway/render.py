"""Renders a structured result as the SDK expects it: protobuf when `Accept` asks, JSON otherwise."""

from __future__ import annotations

import numpy as np
from litestar import Response

from libs.contracts.results import (
    Failure,
    ForwardBackwardResult,
    RequestResult,
    SampleResult,
    TopK,
)
from services.gateway import tinker_proto as tp
from services.gateway import tinker_wire as w

PROTOBUF = "application/x-protobuf"


def forward_backward_proto(result: ForwardBackwardResult) -> tp.ForwardBackwardOutput:
    outputs = [
        {"logprobs": np.frombuffer(d.logprobs, dtype="<f4"), "loss": np.asarray([d.loss], dtype=np.float32)}
        for d in result.outputs
    ]
    return tp.forward_backward_output(outputs, result.metrics)


def _topk(topk: TopK | None) -> tp.TopkLogprobs | None:
    if topk is None:
        return None
    return tp.TopkLogprobs(token_ids=topk.token_ids, logprobs=topk.logprobs, k=topk.k, length=topk.length)


def sample_proto(result: SampleResult) -> tp.SampleResponse:
    return tp.SampleResponse(
        sequences=[
            tp.SampledSequence(
                stop_reason=tp.StopReason.LENGTH if seq.stop_reason == "length" else tp.StopReason.STOP,
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
        proto = forward_backward_proto(body)
        if wants_proto:
            return Response(tp.encode_forward_backward_output(proto), media_type=PROTOBUF)
        return Response(w.legacy_forward_backward_output(proto))
    if isinstance(body, SampleResult):
        sample = sample_proto(body)
        if wants_proto:
            return Response(tp.encode_sample_response(sample), media_type=PROTOBUF)
        return Response(w.legacy_sample_response(sample))
    return Response(body)  # one of the SDK's small response types (results.JsonResult)
