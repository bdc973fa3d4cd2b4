"""Turns Tinker wire datums into bus datums, checking everything before anything is appended.

Every message names the field and the limit. Limits come from the gateway config and the
request's own base model (vocabulary size, context length).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from libs.contracts.common import BusDatum, BusTensor
from libs.contracts.loss_specs import LOSS_SPECS, unsupported_loss_error, validate_loss_request
from services.gateway.config import GatewayConfig
from services.gateway.http.errors import BadRequest, PayloadTooLarge
from services.gateway.wire import proto
from services.gateway.wire import tinker_public_pb2 as pb
from services.gateway.wire import tinker_wire as w

INT_INPUTS = frozenset({"target_tokens"})


class Limits:
    def __init__(self, config: GatewayConfig, vocab_size: int, max_context: int, base: str = "") -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.base = base  # the base model's name, for messages

    @property
    def max_tokens_per_datum(self) -> int:
        return min(self.config.max_tokens_per_datum, self.max_context)


def check_count(num_datums: int, limits: Limits) -> None:
    if num_datums > limits.config.max_datums_per_request:
        raise PayloadTooLarge(
            f"data has {num_datums} datums; the limit is {limits.config.max_datums_per_request} per request "
            "(max_datums_per_request)"
        )


JSON_INFLATION = 4
"""JSON bodies (SDKs <= 0.24) spell every number out: they get this many times the protobuf limit."""


def check_body_size(size: int, limits: Limits, json: bool = False) -> None:
    limit = limits.config.max_request_bytes * (JSON_INFLATION if json else 1)
    if size > limit:
        form = f"{JSON_INFLATION} x max_request_bytes for JSON bodies" if json else "max_request_bytes"
        raise PayloadTooLarge(f"request body is {size} bytes; the limit is {limit} ({form})")


def _tokens_in_vocab(name: str, tokens: np.ndarray, limits: Limits) -> None:
    vocab = limits.vocab_size
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        bad = int(tokens[(tokens < 0) | (tokens >= vocab)][0])
        which = f"base model {limits.base!r}" if limits.base else "this base model"
        raise BadRequest(f"{name} contains token id {bad}; ids must be in [0, {vocab}) for {which}")


def _bus_datum(index: int, tokens: np.ndarray, inputs: dict[str, np.ndarray], limits: Limits) -> BusDatum:
    where = f"data[{index}]"
    if tokens.size > limits.max_tokens_per_datum:
        raise PayloadTooLarge(
            f"{where}.model_input has {tokens.size} tokens; the limit is {limits.max_tokens_per_datum} per datum"
            + (f" for base model {limits.base!r}" if limits.base else "")
        )
    _tokens_in_vocab(f"{where}.model_input", tokens, limits)
    bus_inputs = {}
    for name, array in inputs.items():
        if array.ndim not in (1, 2):  # [N], or [N, K] for top-K targets (the loss spec says which)
            raise BadRequest(f"{where}.loss_fn_inputs.{name} must be [N] or [N, K], got shape {list(array.shape)}")
        if name in INT_INPUTS:
            arr = array.astype(np.int64)
            _tokens_in_vocab(f"{where}.loss_fn_inputs.{name}", arr, limits)
        else:
            arr = array.astype(np.float32)
            if not np.isfinite(arr).all():
                raise BadRequest(f"{where}.loss_fn_inputs.{name} contains a non-finite value")
        bus_inputs[name] = BusTensor.of(arr)
    return BusDatum(tokens=tokens.astype("<i4").tobytes(), inputs=bus_inputs)


def datums_from_proto(data: Sequence[pb.Datum], limits: Limits) -> list[BusDatum]:
    check_count(len(data), limits)
    out = []
    for index, datum in enumerate(data):
        try:
            tokens = proto.model_input_tokens(datum).astype(np.int64)
        except ValueError as exc:
            raise BadRequest(f"data[{index}].model_input: text only ({exc})") from exc
        inputs = {}
        for name, tensor in datum.loss_fn_inputs.items():
            try:
                inputs[name] = proto.tensor_to_numpy(tensor, where=f"data[{index}].loss_fn_inputs.{name}")
            except ValueError as exc:
                raise BadRequest(str(exc)) from exc
        out.append(_bus_datum(index, tokens, inputs, limits))
    return out


def datums_from_json(data: Sequence[w.Datum], limits: Limits) -> list[BusDatum]:
    check_count(len(data), limits)
    out = []
    for index, datum in enumerate(data):
        try:
            tokens = np.asarray(datum.model_input.token_ids(), dtype=np.int64)
        except ValueError as exc:
            raise BadRequest(f"data[{index}].model_input: text only ({exc})") from exc
        inputs = {}
        for name, tensor in datum.loss_fn_inputs.items():
            try:
                inputs[name] = tensor.to_numpy()
            except ValueError as exc:
                raise BadRequest(f"data[{index}].loss_fn_inputs.{name}: {exc}") from exc
        out.append(_bus_datum(index, tokens, inputs, limits))
    return out


STABLE_REINFORCE_REFUSED = (
    "loss_fn 'stable_reinforce' is turned off on this server (TINKERD_STABLE_REINFORCE=refuse): the "
    "hosted StableReinforce objective is unpublished, and this deployment does not offer Tinkerd's own "
    "objective under that name; train with importance_sampling, ppo, cispo, dro or gspo"
)


def check_loss(
    loss_fn: str,
    config: dict[str, float | str],
    datums: Sequence[BusDatum],
    refuse_stable_reinforce: bool = False,
) -> None:
    """What the client sent, before provenance is resolved (a loss's resolved inputs must be absent).
    `refuse_stable_reinforce`: the operator's switch (`GatewayConfig.stable_reinforce`)."""
    if loss_fn not in LOSS_SPECS:
        raise BadRequest(unsupported_loss_error(loss_fn))
    if loss_fn == "stable_reinforce" and refuse_stable_reinforce:
        raise BadRequest(STABLE_REINFORCE_REFUSED)
    error = validate_loss_request(
        loss_fn,
        config,
        [d.num_tokens for d in datums],
        [{name: tuple(t.shape) for name, t in d.inputs.items()} for d in datums],
        resolved=False,
    )
    if error is not None:
        raise BadRequest(error)


def check_adam(params: w.AdamParams) -> None:
    for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        value = getattr(params, name)
        if not math.isfinite(value):
            raise BadRequest(f"adam_params.{name} must be finite, got {value}")
    if params.learning_rate < 0:
        raise BadRequest(f"adam_params.learning_rate must be >= 0, got {params.learning_rate}")
    for name in ("beta1", "beta2"):
        value = getattr(params, name)
        if not 0.0 <= value < 1.0:
            raise BadRequest(f"adam_params.{name} must be in [0, 1), got {value}")
    if params.eps <= 0 or params.weight_decay < 0 or params.grad_clip_norm < 0:
        raise BadRequest("adam_params: eps must be > 0, weight_decay and grad_clip_norm >= 0")
