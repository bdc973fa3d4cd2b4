"""Creating a model: its record in KV `tinker_models`, then its `CreateModel` command (seq_id 0).

One path for both ways the SDK creates a training client: `create_model` (a fresh adapter) and
`load_weights` in create mode (an adapter restored from a checkpoint, on the checkpoint's base
model). The model id is the SDK's own (`ids.model_id(session, model_seq_id)`), so a retry lands on
the same record and the same future.
"""

from __future__ import annotations

from libs.contracts import ids
from libs.contracts import subjects as s
from libs.contracts.common import LoraConfig, now_ns
from libs.contracts.records import ModelRecord
from libs.contracts.requests import CheckpointRef, CreateModel
from services.gateway.accounts import quotas
from services.gateway.accounts.auth import Tenant
from services.gateway.context import Gateway
from services.gateway.http.errors import Conflict
from services.gateway.http.ownership import owned_session
from services.gateway.submit import append
from services.gateway.wire import tinker_wire as w


async def create_model(
    gateway: Gateway,
    tenant: Tenant,
    session_id: str,
    model_seq_id: int,
    lora: LoraConfig,
    digest: str,
    user_metadata: dict[str, object] | None,
    restore: CheckpointRef | None,
    base_model: str | None = None,
) -> w.UntypedAPIFuture:
    """The future of model `model_seq_id` of the caller's session `session_id`, of `base_model`
    (None: the primary one), restoring `restore` when given; `digest` is the request's
    fingerprint. 404 unless the session is the caller's, 403 past the tenant's live-model limit,
    422 if the id already names another model."""
    base = base_model or gateway.model.name
    await owned_session(gateway, tenant, session_id)
    model_id = ids.model_id(session_id, model_seq_id)  # the SDK computes this id itself
    await quotas.check_live_models(gateway, tenant, model_id)
    record = ModelRecord(
        model_id=model_id,
        tenant=tenant.id,
        session_id=session_id,
        base_model=base,
        lora=lora,
        created_ns=now_ns(),
        create_request_id=ids.request_id(model_id, 0),
        user_metadata=user_metadata,
    )
    created, existing = await gateway.store.create(s.KV_MODELS, ids.token(model_id), record, ModelRecord)
    if not created and (existing.tenant != tenant.id or existing.lora != lora):
        raise Conflict(
            f"model_seq_id {model_seq_id} of session {session_id} already created a different model"
        )
    command = CreateModel(
        model_id=model_id,
        seq_id=0,
        session_id=session_id,
        base_model=base,
        lora=lora,
        user_metadata={k: str(v) for k, v in (user_metadata or {}).items()},
        restore=restore,
    )
    request_id = await append(gateway, tenant, model_id, 0, "create_model", digest, command)
    return w.UntypedAPIFuture(request_id=request_id, model_id=model_id)
