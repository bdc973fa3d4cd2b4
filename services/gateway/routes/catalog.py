"""Training runs, checkpoints, weights info, publishing, TTLs and signed downloads (RestClient, CLI).

Everything reads the catalogue (KV `tinker_checkpoints`, written by the publisher) and the model
records. Another tenant's run or checkpoint is a 404, never a 403, unless it was published:
published checkpoints (and the runs holding them, with `access_scope=accessible`) are readable by
every tenant, but only the owner may delete, publish, unpublish or change a TTL.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
from litestar import Request, Response, delete, get, post, put
from litestar.response import File, Stream

from libs.contracts import subjects as s
from libs.contracts.common import now_ns
from libs.contracts.ids import unchecked_path
from libs.contracts.records import CheckpointRecord
from services.gateway.accounts.audit import audit
from services.gateway.accounts.auth import Tenant
from services.gateway.catalog import downloads
from services.gateway.catalog.catalog import (
    at,
    check_page,
    checkpoint_view,
    delete_files,
    knows_external,
    last_request_ns,
    owned_checkpoint,
    readable_checkpoint,
    run_checkpoints,
    run_view,
    runs_visible,
    visible_run,
)
from services.gateway.context import Gateway
from services.gateway.http.errors import BadRequest, NotFound
from services.gateway.wire import tinker_wire as w

AnyRequest = Request[Any, Any, Any]
RUN = "/api/v1/training_runs/{run_id:str}"
CHECKPOINT = RUN + "/checkpoints/{segment:str}/{name:str}"


@get("/api/v1/training_runs", operation_id="list_training_runs")
async def list_training_runs(
    gateway: Gateway, tenant: Tenant, limit: int = 20, offset: int = 0, access_scope: str = "owned"
) -> w.TrainingRunsResponse:
    check_page(limit, offset)
    visible = await runs_visible(gateway, tenant, access_scope == "accessible")
    runs = [
        run_view(model, checkpoints, await last_request_ns(gateway, model.model_id))
        for model, checkpoints in visible[offset : offset + limit]
    ]
    cursor = w.Cursor(offset=offset, limit=limit, total_count=len(visible))
    return w.TrainingRunsResponse(training_runs=runs, cursor=cursor)


@get(RUN, operation_id="get_training_run")
async def get_training_run(
    run_id: str, gateway: Gateway, tenant: Tenant, access_scope: str = "owned"
) -> w.TrainingRun:
    return await visible_run(gateway, tenant, run_id, access_scope == "accessible")


@get(RUN + "/checkpoints", operation_id="list_run_checkpoints")
async def list_run_checkpoints(
    request: AnyRequest, run_id: str, gateway: Gateway, tenant: Tenant
) -> w.CheckpointsListResponse:
    run = await visible_run(gateway, tenant, run_id, accessible=True)
    records = await run_checkpoints(gateway, run_id)
    mine = run.model_owner == tenant.id
    external = knows_external(request.headers)
    views = [checkpoint_view(r, external) for r in records if mine or r.public]
    return w.CheckpointsListResponse(checkpoints=views)


@get("/api/v1/checkpoints", operation_id="list_user_checkpoints")
async def list_user_checkpoints(
    request: AnyRequest, gateway: Gateway, tenant: Tenant, limit: int = 100, offset: int = 0
) -> w.CheckpointsListResponse:
    check_page(limit, offset)
    found = await gateway.store.scan(s.KV_CHECKPOINTS, CheckpointRecord)
    mine = sorted((r for _, r in found if r.tenant == tenant.id), key=lambda r: r.created_ns, reverse=True)
    external = knows_external(request.headers)
    views = [checkpoint_view(r, external) for r in mine[offset : offset + limit]]
    cursor = w.Cursor(offset=offset, limit=limit, total_count=len(mine))
    return w.CheckpointsListResponse(checkpoints=views, cursor=cursor)


@delete(CHECKPOINT, status_code=200, operation_id="delete_checkpoint")
async def delete_checkpoint(
    run_id: str, segment: str, name: str, gateway: Gateway, tenant: Tenant
) -> dict[str, str]:
    """Catalogue entry, public name and version directories; a checkpoint that does not exist
    (never did, or was deleted already) is a 404, as on the hosted service."""
    key, record = await owned_checkpoint(gateway, tenant, run_id, f"{segment}/{name}")
    if record is None:
        raise NotFound(f"checkpoint {unchecked_path(run_id, segment, name)} not found")
    await gateway.store.delete(s.KV_CHECKPOINTS, key)
    await asyncio.to_thread(delete_files, gateway.data_dir, record)
    await audit(gateway, tenant, "checkpoint", "deleted", record.tinker_path)
    return {"status": "deleted"}


async def _set_public(
    gateway: Gateway, tenant: Tenant, run_id: str, checkpoint_id: str, public: bool
) -> None:
    key, record = await owned_checkpoint(gateway, tenant, run_id, checkpoint_id)
    changed = await gateway.store.update(
        s.KV_CHECKPOINTS, key, CheckpointRecord, lambda r: msgspec.structs.replace(r, public=public)
    )
    if record is None or changed is None:
        raise NotFound(f"checkpoint {unchecked_path(run_id, checkpoint_id)} not found")
    await audit(gateway, tenant, "checkpoint", "published" if public else "unpublished", changed.tinker_path)


@post(CHECKPOINT + "/publish", status_code=200, operation_id="publish_checkpoint")
async def publish_checkpoint(
    run_id: str, segment: str, name: str, gateway: Gateway, tenant: Tenant
) -> dict[str, str]:
    await _set_public(gateway, tenant, run_id, f"{segment}/{name}", True)
    return {"status": "published"}


@delete(CHECKPOINT + "/publish", status_code=200, operation_id="unpublish_checkpoint")
async def unpublish_checkpoint(
    run_id: str, segment: str, name: str, gateway: Gateway, tenant: Tenant
) -> dict[str, str]:
    await _set_public(gateway, tenant, run_id, f"{segment}/{name}", False)
    return {"status": "unpublished"}


@put(CHECKPOINT + "/ttl", status_code=200, operation_id="set_checkpoint_ttl")
async def set_checkpoint_ttl(
    run_id: str, segment: str, name: str, data: w.CheckpointTtlRequest, gateway: Gateway, tenant: Tenant
) -> dict[str, str | None]:
    """The publisher's reaper deletes the checkpoint once `expires_at` passes; null keeps it."""
    if data.ttl_seconds is not None and data.ttl_seconds <= 0:
        raise BadRequest(f"ttl_seconds must be > 0 or null, got {data.ttl_seconds}")
    expires = now_ns() + data.ttl_seconds * 1_000_000_000 if data.ttl_seconds is not None else None
    key, record = await owned_checkpoint(gateway, tenant, run_id, f"{segment}/{name}")
    changed = await gateway.store.update(
        s.KV_CHECKPOINTS, key, CheckpointRecord, lambda r: msgspec.structs.replace(r, expires_ns=expires)
    )
    if record is None or changed is None:
        raise NotFound(f"checkpoint {unchecked_path(run_id, segment, name)} not found")
    await audit(gateway, tenant, "checkpoint", "ttl_set", changed.tinker_path, ttl_seconds=str(data.ttl_seconds))
    view = checkpoint_view(changed)
    return {"expires_at": view.expires_at.isoformat() if view.expires_at else None}


@post("/api/v1/weights_info", status_code=200, operation_id="weights_info")
async def weights_info(data: w.WeightsInfoRequest, gateway: Gateway, tenant: Tenant) -> w.WeightsInfoResponse:
    record = await readable_checkpoint(gateway, tenant, data.tinker_path)
    lora = record.lora
    return w.WeightsInfoResponse(
        base_model=record.base_model,
        is_lora=True,
        lora_rank=lora.rank,
        train_unembed=lora.train_unembed,
        train_mlp=lora.train_mlp,
        train_attn=lora.train_attn,
    )


def _base_url(gateway: Gateway, request: AnyRequest) -> str:
    return gateway.config.public_url or str(request.base_url)


def _expiry() -> int:
    return int(time.time()) + 3600


@get(CHECKPOINT + "/external_weights_urls", operation_id="external_weights_urls")
async def external_weights_urls(
    request: AnyRequest, run_id: str, segment: str, name: str, gateway: Gateway, tenant: Tenant
) -> w.ExternalWeightsUrlsResponse:
    """One signed URL per file (what `tinker checkpoint download` fetches with urllib)."""
    record = await readable_checkpoint(gateway, tenant, unchecked_path(run_id, segment, name))
    expires = _expiry()
    urls = downloads.sign_files(
        _base_url(gateway, request), gateway.signing_secret, gateway.data_dir, Path(record.directory), expires
    )
    await audit(gateway, tenant, "checkpoint", "read", record.tinker_path, purpose="download")
    return w.ExternalWeightsUrlsResponse(urls=urls, expires=at(expires * 1_000_000_000))


@get(CHECKPOINT + "/archive", operation_id="checkpoint_archive")
async def checkpoint_archive(
    request: AnyRequest, run_id: str, segment: str, name: str, gateway: Gateway, tenant: Tenant
) -> w.ArchiveUrlResponse:
    """SDKs <= 0.35: one signed URL to a tar of the checkpoint (the 200 JSON form)."""
    record = await readable_checkpoint(gateway, tenant, unchecked_path(run_id, segment, name))
    expires = _expiry()
    relative = str(Path(record.directory).relative_to(gateway.data_dir))
    url = downloads.signed_url(_base_url(gateway, request), gateway.signing_secret, relative, expires)
    await audit(gateway, tenant, "checkpoint", "read", record.tinker_path, purpose="download")
    return w.ArchiveUrlResponse(url=url, expires=at(expires * 1_000_000_000))


@get("/api/v1/downloads/{relative:path}", operation_id="download")
async def download(request: AnyRequest, relative: str, gateway: Gateway) -> Response[bytes] | File | Stream:
    """Unauthenticated: the URL's signature is the authorisation (see services.gateway.catalog.downloads)."""
    target = downloads.verify(
        gateway.signing_secret,
        gateway.data_dir,
        relative.lstrip("/"),
        request.query_params.get("expires"),
        request.query_params.get("sig"),
    )
    if target.is_dir():
        headers = {"Content-Length": str(downloads.tar_size(target))}
        return Stream(downloads.tar_stream(target), media_type="application/x-tar", headers=headers)
    return File(target, filename=target.name, content_disposition_type="attachment")


ROUTES = [
    list_training_runs,
    get_training_run,
    list_run_checkpoints,
    list_user_checkpoints,
    delete_checkpoint,
    publish_checkpoint,
    unpublish_checkpoint,
    set_checkpoint_ttl,
    weights_info,
    external_weights_urls,
    checkpoint_archive,
]
PUBLIC_ROUTES = [download]  # signed URLs: the signature is the credential
