"""Sessions as RestClient lists them: ids, and the training runs and samplers each one created.

Runs and samplers are found by key prefix in their KV buckets (`ids.session_models_prefix`,
`ids.session_samplers_prefix`). Another tenant's session is a 404.
"""

from __future__ import annotations

import msgspec
from litestar import get, put

from libs.contracts import ids
from libs.contracts import subjects as s
from libs.contracts.records import ModelRecord, SamplerRecord, SessionRecord
from services.gateway.accounts.audit import audit
from services.gateway.accounts.auth import Tenant
from services.gateway.catalog.catalog import check_page, str_metadata
from services.gateway.context import Gateway
from services.gateway.http.errors import BadRequest
from services.gateway.http.ownership import owned_session
from services.gateway.wire import tinker_wire as w


@get("/api/v1/sessions", operation_id="list_sessions")
async def list_sessions(
    gateway: Gateway, tenant: Tenant, limit: int = 20, offset: int = 0, access_scope: str = "owned"
) -> w.ListSessionsResponse:
    check_page(limit, offset)
    found = await gateway.store.scan(s.KV_SESSIONS, SessionRecord)
    mine = sorted((r for _, r in found if r.tenant == tenant.id), key=lambda r: r.created_ns, reverse=True)
    return w.ListSessionsResponse(sessions=[r.session_id for r in mine[offset : offset + limit]])


@get("/api/v1/sessions/{session_id:str}", operation_id="get_session")
async def get_session(
    session_id: str, gateway: Gateway, tenant: Tenant, access_scope: str = "owned"
) -> w.GetSessionResponse:
    session = await owned_session(gateway, tenant, session_id)
    models = await gateway.store.scan(s.KV_MODELS, ModelRecord, prefix=ids.session_models_prefix(session_id))
    samplers = await gateway.store.scan(
        s.KV_SAMPLERS, SamplerRecord, prefix=ids.session_samplers_prefix(session_id)
    )
    return w.GetSessionResponse(
        training_run_ids=[m.model_id for _, m in sorted(models, key=lambda kv: kv[1].created_ns)],
        sampler_ids=[x.sampler_id for _, x in sorted(samplers, key=lambda kv: kv[1].created_ns)],
        user_metadata=str_metadata(session.user_metadata),
    )


@put("/api/v1/sessions/{session_id:str}/project", status_code=200, operation_id="assign_session_project")
async def assign_session_project(
    session_id: str, data: w.SessionProjectRequest, gateway: Gateway, tenant: Tenant
) -> dict[str, str]:
    """Projects are labels: the session's project groups its usage, storage and search results."""
    await owned_session(gateway, tenant, session_id)
    if not data.project_id:
        raise BadRequest("project_id is required")
    await gateway.store.update(
        s.KV_SESSIONS,
        ids.token(session_id),
        SessionRecord,
        lambda r: msgspec.structs.replace(r, project_id=data.project_id),
    )
    await audit(gateway, tenant, "project", "session_assigned", session_id, project_id=data.project_id)
    return {"session_id": session_id, "project_id": data.project_id}


ROUTES = [list_sessions, get_session, assign_session_project]
