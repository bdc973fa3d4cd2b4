"""Results built as the generated protobuf messages from plain arrays, for the wire tests."""

from __future__ import annotations

from typing import Literal

import numpy as np
import numpy.typing as npt

from services.gateway.wire import tinker_public_pb2 as pb


def tensor_from_numpy(array: npt.ArrayLike) -> pb.Tensor:
    """A dense Tensor (float32, int32 or int64) holding ``array`` with its shape."""
    values = np.asarray(array)
    if values.dtype.kind == "f":
        return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=values.shape, dense=values.astype("<f4").tobytes())
    if values.dtype == np.int32:
        return pb.Tensor(dtype=pb.DTYPE_INT32, shape=values.shape, dense=values.astype("<i4").tobytes())
    return pb.Tensor(dtype=pb.DTYPE_INT64, shape=values.shape, dense=values.astype("<i8").tobytes())


def float32_bytes(values: npt.ArrayLike) -> bytes:
    """Little-endian float32 bytes, e.g. prompt logprobs with NaN where not scored."""
    return np.asarray(values, dtype="<f4").tobytes()


def topk_logprobs(token_ids: npt.ArrayLike, logprobs: npt.ArrayLike) -> pb.TopkLogprobs:
    """Pack ``[length, k]`` matrices; pad empty cells with token 0 and logprob -99999."""
    ids, lps = np.asarray(token_ids), np.asarray(logprobs)
    if ids.ndim != 2 or ids.shape != lps.shape:
        raise ValueError(f"top-k needs two equal [length, k] matrices, got {ids.shape} and {lps.shape}")
    return pb.TopkLogprobs(
        token_ids=ids.astype("<i4").tobytes(),
        logprobs=lps.astype("<f4").tobytes(),
        k=ids.shape[1],
        length=ids.shape[0],
    )


def sampled_sequence(
    tokens: npt.ArrayLike,
    logprobs: npt.ArrayLike | None,
    stop_reason: Literal["stop", "length"],
    *,
    topk: pb.TopkLogprobs | None = None,
) -> pb.SampledSequence:
    """One sampled sequence; ``logprobs`` (one per token) should always be sent."""
    return pb.SampledSequence(
        stop_reason=pb.STOP_REASON_LENGTH if stop_reason == "length" else pb.STOP_REASON_STOP,
        tokens=np.asarray(tokens, dtype="<i4").tobytes(),
        logprobs=None if logprobs is None else float32_bytes(logprobs),
        topk_sampled_logprobs=topk,
    )
