"""Training endpoints: create_model, get_info, forward_backward (protobuf or JSON), forward,
optim_step, save_weights, save_weights_for_sampler, load_weights, unload_model.

Each handler authenticates, decodes, validates, and appends one command to the model's stream
(see `submit.append`). Nothing runs here: the planner and trainers do the work, and the result
arrives through `retrieve_future`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zstandard
from litestar import Request, post

from libs.contracts.common import BusDatum, LoraConfig
from libs.contracts.loss_specs import NEEDS_PROVENANCE
from libs.contracts.requests import (
    ForwardBackward,
    OptimStep,
)
from libs.contracts.sampling import SequenceRecord
from services.gateway import model_creation
from services.gateway.accounts.auth import Tenant
from services.gateway.context import Gateway
from services.gateway.http.errors import BadRequest, TinkerError
from services.gateway.sampling import stability
from services.gateway.submit import (
    append,
    check_seq,
    fingerprint_bytes,
    fingerprint_json,
    owned_model,
    unload,
)
from services.gateway.wire import proto
from services.gateway.wire import tinker_wire as w
from services.gateway.wire.validation import (
    Limits,
    check_adam,
    check_body_size,
    check_loss,
    datums_from_json,
    datums_from_proto,
)

PROTOBUF = "application/x-protobuf"
DIMUON_REFUSED = (
    "optimizer_config.type 'dimuon' is not supported: the Dimuon update rule is unpublished, and this "
    "server does not pass off a guess as it; create the model with adamw (the default)"
)


def limits(gateway: Gateway, base: str | None = None) -> Limits:
    """The request limits of base model `base` (a record's name; None: the primary one). The
    body-size limits are the config's alone, the same for every base."""
    model = gateway.model if base is None else gateway.model_named(base)
    return Limits(gateway.config, model.vocab_size, model.max_context, model.name)


def _future(request_id: str, model_id: str | None = None) -> w.UntypedAPIFuture:
    return w.UntypedAPIFuture(request_id=request_id, model_id=model_id)


@post("/api/v1/create_model", status_code=200, operation_id="create_model")
async def create_model(data: w.CreateModelRequest, gateway: Gateway, tenant: Tenant) -> w.UntypedAPIFuture:
    served = gateway.served(data.base_model)
    if served is None:
        names = ", ".join(repr(m.name) for m in gateway.models)
        raise BadRequest(f"base_model {data.base_model!r} is not served here; this deployment serves {names}")
    lora = data.lora_config or LoraConfig(rank=32)
    if not 1 <= lora.rank <= gateway.config.max_lora_rank:
        raise BadRequest(f"lora_config.rank must be in [1, {gateway.config.max_lora_rank}], got {lora.rank}")
    if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
        raise BadRequest("lora_config: at least one of train_attn, train_mlp, train_unembed must be true")
    if data.optimizer_config.type == "dimuon":
        raise BadRequest(DIMUON_REFUSED)
    if data.optimizer_config.type != "adamw":
        raise BadRequest(
            f"optimizer_config.type {data.optimizer_config.type!r} is not supported; use 'adamw'"
        )
    if data.model_seq_id < 0:
        raise BadRequest(f"model_seq_id must be >= 0, got {data.model_seq_id}")
    digest = fingerprint_json("create_model", msgspec.to_builtins(data))
    return await model_creation.create_model(
        gateway,
        tenant,
        data.session_id,
        data.model_seq_id,
        lora,
        digest,
        data.user_metadata,
        None,
        served.name,
    )


@post("/api/v1/get_info", status_code=200, operation_id="get_info")
async def get_info(data: w.GetInfoRequest, gateway: Gateway, tenant: Tenant) -> w.GetInfoResponse:
    record = await owned_model(gateway, tenant, data.model_id)
    model = gateway.model_named(record.base_model)
    return w.GetInfoResponse(
        model_id=record.model_id,
        model_data=w.ModelData(arch=model.arch, model_name=model.name, tokenizer_id=str(model.path)),
        is_lora=True,
        lora_rank=record.lora.rank,
        model_name=model.name,
    )


Spans = proto.Spans


@dataclass(frozen=True)
class _FBInput:
    """A forward_backward as either wire format gives it: the loss and each datum's provenance."""

    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    spans: list[tuple[Spans, Spans]]  # (model_input_spans, loss_fn_input_spans) per datum


async def _forward_backward(
    gateway: Gateway,
    tenant: Tenant,
    request: _FBInput,
    seq_id: int | None,
    digest: str,
    decode: Callable[[Limits], list[BusDatum]],
) -> w.UntypedAPIFuture:
    """Check everything, resolve provenance, then append once; a refusal appends a `Rejected`.

    A forward-only pass's kind is "forward": a refused one never poisons a gradient window.
    `decode(limits)` checks the datums against the limits of the model's base model."""
    kind = "forward" if request.forward_only else "forward_backward"
    model = await owned_model(gateway, tenant, request.model_id)
    seq = check_seq(seq_id)
    records: list[SequenceRecord] = []
    try:
        base_limits = limits(gateway, model.base_model)
        datums = decode(base_limits)
        check_loss(request.loss_fn, request.config, datums, gateway.config.stable_reinforce == "refuse")
        if request.loss_fn in NEEDS_PROVENANCE:
            resolved = await stability.resolve(gateway, model.session_id, datums, request.spans)
            datums, records = resolved.datums, resolved.records
        command = ForwardBackward(
            model_id=request.model_id,
            seq_id=request.seq_id,
            loss_fn=request.loss_fn,
            loss_config=request.config,
            forward_only=request.forward_only,
            data=datums,
        )
    except TinkerError as refused:
        await append(gateway, tenant, request.model_id, seq, kind, digest, None, refused)
        raise
    request_id = await append(gateway, tenant, request.model_id, seq, kind, digest, command)
    await stability.touch(gateway, records)
    return _future(request_id, request.model_id)


@post("/api/v1/forward_backward", status_code=200, operation_id="forward_backward")
async def forward_backward(request: Request, gateway: Gateway, tenant: Tenant) -> w.UntypedAPIFuture:  # type: ignore[type-arg]
    body = await request.body()
    if request.headers.get("content-encoding", "").lower() == "zstd":
        try:
            body = zstandard.ZstdDecompressor().decompress(
                body, max_output_size=gateway.config.max_request_bytes * 4
            )
        except zstandard.ZstdError as exc:
            raise BadRequest(f"body is not valid zstd: {exc}") from exc
    is_proto = PROTOBUF in request.headers.get("content-type", "")
    check_body_size(len(body), limits(gateway), json=not is_proto)
    if is_proto:
        try:
            req = proto.decode_forward_backward_request(body)
        except ValueError as exc:
            raise BadRequest(f"invalid ForwardBackwardRequest: {exc}") from exc

        request_input = _FBInput(
            model_id=req.model_id,
            seq_id=req.seq_id,
            loss_fn=req.loss_fn,
            config=req.config,
            forward_only=req.forward_only,
            spans=req.spans,
        )
        digest = fingerprint_bytes("forward_backward", body)
        return await _forward_backward(
            gateway, tenant, request_input, req.seq_id, digest, lambda lim: datums_from_proto(req.data, lim)
        )
    legacy = msgspec.json.decode(body, type=w.LegacyForwardBackwardRequest)
    return await _legacy(
        gateway, tenant, legacy.model_id, legacy.seq_id, legacy.forward_backward_input, body, False
    )


async def _legacy(
    gateway: Gateway,
    tenant: Tenant,
    model_id: str,
    seq_id: int | None,
    inp: w.ForwardBackwardInput,
    body: bytes,
    forward_only: bool,
) -> w.UntypedAPIFuture:
    request_input = _FBInput(
        model_id=model_id,
        seq_id=seq_id or 0,
        loss_fn=inp.loss_fn,
        config=dict(inp.loss_fn_config or {}),
        forward_only=forward_only,
        spans=[(d.model_input_spans or [], d.loss_fn_input_spans or []) for d in inp.data],
    )
    digest = fingerprint_bytes("forward" if forward_only else "forward_backward", body)
    return await _forward_backward(
        gateway, tenant, request_input, seq_id, digest, lambda lim: datums_from_json(inp.data, lim)
    )


@post("/api/v1/forward", status_code=200, operation_id="forward")
async def forward(request: Request, gateway: Gateway, tenant: Tenant) -> w.UntypedAPIFuture:  # type: ignore[type-arg]
    """SDKs up to 0.24 send forward-only passes here as JSON."""
    body = await request.body()
    check_body_size(len(body), limits(gateway), json=True)
    legacy = msgspec.json.decode(body, type=w.LegacyForwardRequest)
    return await _legacy(gateway, tenant, legacy.model_id, legacy.seq_id, legacy.forward_input, body, True)


@post("/api/v1/optim_step", status_code=200, operation_id="optim_step")
async def optim_step(data: w.OptimStepRequest, gateway: Gateway, tenant: Tenant) -> w.UntypedAPIFuture:
    await owned_model(gateway, tenant, data.model_id)
    seq = check_seq(data.seq_id)
    digest = fingerprint_json("optim_step", msgspec.to_builtins(data))
    try:
        params = data.params()
        if not isinstance(params, w.AdamParams):
            raise BadRequest(
                "optimizer_params: only AdamW (adam_params) is supported (the Dimuon update rule is "
                "unpublished); this model was created with adamw"
            )
        check_adam(params)
    except (ValueError, BadRequest) as exc:
        refused = exc if isinstance(exc, BadRequest) else BadRequest(str(exc))
        await append(gateway, tenant, data.model_id, seq, "optim_step", digest, None, refused)
        raise refused from None
    command = OptimStep(model_id=data.model_id, seq_id=seq, adam=params)
    return _future(
        await append(gateway, tenant, data.model_id, seq, "optim_step", digest, command), data.model_id
    )


@post("/api/v1/unload_model", status_code=200, operation_id="unload_model")
async def unload_model(data: w.UnloadModelRequest, gateway: Gateway, tenant: Tenant) -> w.UntypedAPIFuture:
    """Free the model's adapter slot once everything already submitted has run (checkpoints stay)."""
    record = await owned_model(gateway, tenant, data.model_id, current=True)
    return _future(await unload(gateway, record), record.model_id)


ROUTES = [
    create_model,
    get_info,
    forward_backward,
    forward,
    optim_step,
    unload_model,
]
