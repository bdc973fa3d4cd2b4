"""Final results of futures (`tinker.result.<request_id>`), one message per request.

The gateway's futures projection is a fold of this stream, so any gateway replica answers any
future. Results are structured, not pre-rendered: the gateway renders protobuf or JSON as the
client's `Accept` header asks.
"""

from __future__ import annotations

import msgspec

from libs.contracts.common import Envelope


class DatumResult(msgspec.Struct, frozen=True, array_like=True):
    logprobs: bytes  # float32 little-endian
    loss: float
    k: int = 0  # 0: logprobs is [N]; K >= 1: it is [N, K] (top-K target_tokens)
    metrics: dict[str, float] = {}  # the loss's own per-datum metrics, each `name:sum`


class ForwardBackwardResult(msgspec.Struct, tag="forward_backward", frozen=True, kw_only=True):
    outputs: list[DatumResult]
    metrics: dict[str, float]


class TopK(msgspec.Struct, frozen=True, array_like=True):
    token_ids: bytes  # int32 [length * k]
    logprobs: bytes  # float32 [length * k]
    k: int
    length: int


class SampledSequence(msgspec.Struct, frozen=True, kw_only=True):
    stop_reason: str  # "stop" | "length"
    tokens: bytes  # int32
    logprobs: bytes  # float32
    topk: TopK | None = None


class SampleResult(msgspec.Struct, tag="sample", frozen=True, kw_only=True):
    sequences: list[SampledSequence]
    prompt_logprobs: bytes | None = None  # float32, NaN where not computed
    topk_prompt: TopK | None = None
    prompt_cache_hit_tokens: int = 0


# --- the small JSON results: the SDK's own response schemas (tinker.types), each once -----


class CreateModelResponse(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="create_model"):
    model_id: str


class OptimStepResponse(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="type", tag="optim_step"
):
    metrics: dict[str, float] | None = None


class SaveWeightsResponse(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="save_weights"):
    path: str


class SaveWeightsForSamplerResponse(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    omit_defaults=True,
    tag_field="type",
    tag="save_weights_for_sampler",
):
    """``path`` for a named save, ``sampling_session_id`` for an ephemeral one."""

    path: str | None = None
    sampling_session_id: str | None = None


class SaveWeightsExternalResponse(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    omit_defaults=True,
    tag_field="type",
    tag="save_weights_external",
):
    path: str
    size_bytes: int | None = None


class LoadWeightsResponse(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="type", tag="load_weights"
):
    path: str | None = None
    model_id: str | None = None


class UnloadModelResponse(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="unload_model"):
    model_id: str


class Failure(msgspec.Struct, tag="failure", frozen=True, kw_only=True):
    error: str
    category: str = "user"  # "user" | "server" | "unknown": the SDK's enum


JsonResult = (
    CreateModelResponse
    | OptimStepResponse
    | SaveWeightsResponse
    | SaveWeightsForSamplerResponse
    | SaveWeightsExternalResponse
    | LoadWeightsResponse
    | UnloadModelResponse
)
"""A result the gateway answers as JSON whatever the client accepts."""

ResultBody = ForwardBackwardResult | SampleResult | Failure | JsonResult


class RequestResult(Envelope, tag="result", kw_only=True, frozen=True):
    kind: str
    body: ResultBody
