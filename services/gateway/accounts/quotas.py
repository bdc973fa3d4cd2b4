"""Per-tenant limits, decided before anything is claimed: live models and stored checkpoint bytes.

A shared server is bounded by its disk, and no tenant may take all of it: `create_model` is
refused while the tenant has `max_live_models_per_tenant` models not unloaded (unloading one, or
finishing or expiring its session, makes room), and a named save while the tenant's catalogued
checkpoints hold `max_stored_bytes_per_tenant` bytes (deleting checkpoints, or their TTLs, make
room). Both answer 403 naming the limit, before a seq_id or a model id is claimed, so nothing
is half-applied and a retry after making room is the first attempt. 0 turns a limit off. A
retry of a request that was already accepted is never refused.
"""

from __future__ import annotations

from libs.contracts import ids
from libs.contracts import subjects as s
from libs.contracts.records import CheckpointRecord, ModelRecord, SeqClaim
from services.gateway.accounts.auth import Tenant
from services.gateway.context import Gateway
from services.gateway.http.errors import Forbidden


async def check_live_models(gateway: Gateway, tenant: Tenant, model_id: str) -> None:
    limit = gateway.config.max_live_models_per_tenant
    if limit <= 0:
        return
    models = await gateway.store.scan(s.KV_MODELS, ModelRecord)
    live = {m.model_id for _, m in models if m.tenant == tenant.id and not m.unloaded}
    if model_id in live or len(live) < limit:
        return  # a retried create, or room left
    raise Forbidden(
        f"tenant {tenant.id} has {len(live)} live models; the limit (max_live_models_per_tenant) is "
        f"{limit}: unload one (unload_model, or close its ServiceClient) before creating another"
    )


async def check_stored_bytes(gateway: Gateway, tenant: Tenant, model_id: str, seq_id: int) -> None:
    limit = gateway.config.max_stored_bytes_per_tenant
    if limit <= 0:
        return
    if await gateway.store.get(s.KV_SEQ, ids.seq_key(model_id, seq_id), SeqClaim) is not None:
        return  # this seq_id was accepted already: a retry, answered as before
    records = await gateway.store.scan(s.KV_CHECKPOINTS, CheckpointRecord)
    used = sum(r.size_bytes for _, r in records if r.tenant == tenant.id)
    if used < limit:
        return
    raise Forbidden(
        f"tenant {tenant.id} stores {used} bytes of checkpoints; the limit (max_stored_bytes_per_tenant) "
        f"is {limit} bytes: delete checkpoints (RestClient.delete_checkpoint_from_tinker_path) or give "
        "them a TTL before saving more"
    )
