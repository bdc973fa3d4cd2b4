"""Weights endpoints: save_weights (save_state), save_weights_for_sampler, save_weights_external and
load_weights (create mode and legacy mode).

Each is one sequenced command on the model's stream (see `submit.sequenced`); the trainer writes
the files and the publisher registers the checkpoint and answers the future.
"""

from __future__ import annotations

import msgspec
from litestar import post

from libs.checkpoints import age
from libs.contracts import ids
from libs.contracts import subjects as s
from libs.contracts.common import LoraConfig, now_ns
from libs.contracts.records import ModelRecord, SamplerRecord
from libs.contracts.requests import CheckpointRef, LoadWeights, SaveForSampler, SaveWeights
from services.gateway import model_creation
from services.gateway.accounts import quotas
from services.gateway.accounts.auth import Tenant
from services.gateway.catalog.catalog import check_name, resolve_checkpoint
from services.gateway.context import Gateway
from services.gateway.http.errors import BadRequest
from services.gateway.sampling.sampleable import check_sampleable
from services.gateway.submit import check_seq, fingerprint_json, owned_model, sequenced
from services.gateway.wire import tinker_wire as w

FIRST_SEQ = 1
"""The seq_id of a model's first request after its create (seq_id 0)."""


def check_ttl(ttl_seconds: int | None) -> int | None:
    if ttl_seconds is not None and ttl_seconds <= 0:
        raise BadRequest(f"ttl_seconds must be > 0 (or null for no expiry), got {ttl_seconds}")
    return ttl_seconds


def check_recipients(values: list[str] | None) -> list[str] | None:
    """The age recipients of an encrypted export (None: a plain one), or a 400 naming the entry."""
    if values is None:
        return None
    try:
        age.parse_recipients(values)
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    return [value.strip() for value in values]


def _future(request_id: str, model_id: str) -> w.UntypedAPIFuture:
    return w.UntypedAPIFuture(request_id=request_id, model_id=model_id)


@post("/api/v1/save_weights", status_code=200, operation_id="save_weights")
async def save_weights(data: w.SaveWeightsRequest, gateway: Gateway, tenant: Tenant) -> w.UntypedAPIFuture:
    await owned_model(gateway, tenant, data.model_id)
    seq = check_seq(data.seq_id)
    await quotas.check_stored_bytes(gateway, tenant, data.model_id, seq)

    async def build() -> SaveWeights:
        name, ttl = check_name(data.path, "path"), check_ttl(data.ttl_seconds)
        return SaveWeights(
            model_id=data.model_id, seq_id=seq, name=name, ttl_s=ttl, user_metadata=data.user_metadata
        )

    digest = fingerprint_json("save_weights", msgspec.to_builtins(data))
    request_id = await sequenced(gateway, tenant, data.model_id, seq, "save_weights", digest, build)
    return _future(request_id, data.model_id)


@post("/api/v1/save_weights_for_sampler", status_code=200, operation_id="save_weights_for_sampler")
async def save_weights_for_sampler(
    data: w.SaveWeightsForSamplerRequest, gateway: Gateway, tenant: Tenant
) -> w.UntypedAPIFuture:
    model = await owned_model(gateway, tenant, data.model_id)
    seq = check_seq(data.seq_id)
    if data.path:  # named exports are catalogued (ephemeral ones for a sampler are not)
        await quotas.check_stored_bytes(gateway, tenant, data.model_id, seq)
    sampler_id: str | None = None

    async def build() -> SaveForSampler:
        nonlocal sampler_id
        name, ttl = (check_name(data.path, "path") if data.path else None), check_ttl(data.ttl_seconds)
        if name is None:  # the SDK samples it next (save_weights_and_get_sampling_client)
            check_sampleable(gateway, model.base_model)
            sampler_id = await register_sampler(
                gateway, tenant, model, seq, data.sampling_session_seq_id, inflight=data.kind == "inflight"
            )
        return SaveForSampler(
            model_id=data.model_id, seq_id=seq, name=name, sampling_session_id=sampler_id, ttl_s=ttl
        )

    # The SDK draws a new sampling_session_seq_id on every attempt: it is not part of the identity.
    digest = fingerprint_json(
        "save_weights_for_sampler", msgspec.to_builtins(data), ("sampling_session_seq_id",)
    )
    request_id = await sequenced(
        gateway, tenant, data.model_id, seq, "save_weights_for_sampler", digest, build
    )
    return _future(request_id, data.model_id)


async def register_sampler(
    gateway: Gateway, tenant: Tenant, model: ModelRecord, seq: int, sampling_seq: int | None, inflight: bool
) -> str:
    """The sampler an ephemeral sampler export is for, registered before the save can possibly complete
    (the publisher fills in its adapter when the export is written). An inflight sampler follows
    the model's inflight target (docs/semantics.md, "Inflight sampling clients")."""
    if sampling_seq is None:
        raise BadRequest(
            "save_weights_for_sampler needs a path (named) or sampling_session_seq_id (ephemeral)"
        )
    sampler_id = ids.sampler_id(model.session_id, sampling_seq)
    record = SamplerRecord(
        sampler_id=sampler_id,
        tenant=tenant.id,
        session_id=model.session_id,
        base_model=model.base_model,
        pending_request_id=ids.request_id(model.model_id, seq),
        created_ns=now_ns(),
        inflight_model_id=model.model_id if inflight else None,
        save_seq_id=seq,
    )
    await gateway.store.create(s.KV_SAMPLERS, ids.token(sampler_id), record, SamplerRecord)
    return sampler_id


@post("/api/v1/save_weights_external", status_code=200, operation_id="save_weights_external")
async def save_weights_external(
    data: w.SaveWeightsExternalRequest, gateway: Gateway, tenant: Tenant
) -> w.UntypedAPIFuture:
    """A PEFT export under `tinker://RUN/external_weights/NAME`, downloadable through signed URLs."""
    await owned_model(gateway, tenant, data.model_id)
    seq = check_seq(data.seq_id)
    await quotas.check_stored_bytes(gateway, tenant, data.model_id, seq)

    async def build() -> SaveForSampler:
        name, ttl = check_name(data.path, "path"), check_ttl(data.ttl_seconds)
        recipients = check_recipients(data.age_encryption_recipients)
        return SaveForSampler(
            model_id=data.model_id, seq_id=seq, name=name, ttl_s=ttl, external=True, age_recipients=recipients
        )

    digest = fingerprint_json("save_weights_external", msgspec.to_builtins(data))
    request_id = await sequenced(gateway, tenant, data.model_id, seq, "save_weights_external", digest, build)
    return _future(request_id, data.model_id)


async def _restore_ref(
    gateway: Gateway, tenant: Tenant, data: w.LoadWeightsRequest
) -> tuple[CheckpointRef, LoraConfig, str]:
    """(what to restore, its LoRA config, the base model it was trained on)."""
    checkpoint = await resolve_checkpoint(gateway, tenant, data.path, kind="training")
    ref = CheckpointRef(tinker_path=data.path, directory=checkpoint.directory, with_optimizer=data.optimizer)
    return ref, checkpoint.lora, checkpoint.base_model


@post("/api/v1/load_weights", status_code=200, operation_id="load_weights")
async def load_weights(data: w.LoadWeightsRequest, gateway: Gateway, tenant: Tenant) -> w.UntypedAPIFuture:
    """Create mode (session_id + model_seq_id: a new model from the checkpoint, as
    create_training_client_from_state sends it) or legacy mode (model_id + seq_id: load_state).

    As on the hosted service, legacy mode is accepted only as the model's first request (seq_id 1);
    later ones are a 400 `LoadWeights is not permitted with seq_id N` (the seq_id is consumed)."""
    digest = fingerprint_json("load_weights", msgspec.to_builtins(data))
    if data.session_id is not None and data.model_seq_id is not None:
        ref, lora, base = await _restore_ref(gateway, tenant, data)
        return await model_creation.create_model(  # a model of the checkpoint's base model
            gateway, tenant, data.session_id, data.model_seq_id, lora, digest, data.user_metadata, ref, base
        )
    if data.model_id is None:
        raise BadRequest(
            "load_weights needs session_id and model_seq_id (create mode) or model_id and seq_id"
        )
    model = await owned_model(gateway, tenant, data.model_id)
    seq = check_seq(data.seq_id)

    async def build() -> LoadWeights:
        if seq != FIRST_SEQ:
            raise BadRequest(
                f"LoadWeights is not permitted with seq_id {seq}: load_state only as a training client's "
                "first request; to resume elsewhere, create_training_client_from_state(path)"
            )
        ref, lora, base = await _restore_ref(gateway, tenant, data)
        if base != model.base_model:
            raise BadRequest(
                f"checkpoint {data.path} was trained on base model {base!r}; model {model.model_id} is of "
                f"{model.base_model!r}"
            )
        if lora.rank != model.lora.rank:
            raise BadRequest(
                f"checkpoint {data.path} has LoRA rank {lora.rank}; model {model.model_id} has rank {model.lora.rank}"
            )
        return LoadWeights(model_id=model.model_id, seq_id=seq, restore=ref)

    request_id = await sequenced(gateway, tenant, model.model_id, seq, "load_weights", digest, build)
    return _future(request_id, model.model_id)


ROUTES = [save_weights, save_weights_for_sampler, save_weights_external, load_weights]
