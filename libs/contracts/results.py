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


class JsonResult(msgspec.Struct, tag="json", frozen=True, kw_only=True):
    """A small JSON body (create_model, optim_step, save_*, load_weights, ...)."""

    body: dict[str, object]


class Failure(msgspec.Struct, tag="failure", frozen=True, kw_only=True):
    error: str
    category: str = "user"  # "user" | "server" | "unknown": the SDK's enum


ResultBody = ForwardBackwardResult | SampleResult | JsonResult | Failure


class RequestResult(Envelope, tag="result", kw_only=True, frozen=True):
    kind: str
    body: ResultBody
