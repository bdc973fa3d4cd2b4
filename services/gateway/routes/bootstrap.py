"""Bootstrap, sessions, telemetry, capabilities and health: what the SDK calls before training."""

from __future__ import annotations

import hashlib
import os
import uuid

import msgspec
from litestar import Request, Response, get, post

from infra.stack_state import UP, describe, read_state, service_of, state_file_from_env
from libs.contracts import ids
from libs.contracts import subjects as s
from libs.contracts.common import now_ns
from libs.contracts.events import SessionEvent
from libs.contracts.records import ModelRecord, SessionRecord, TrainerStatus
from services.gateway.accounts.auth import Tenant
from services.gateway.config import GatewayConfig
from services.gateway.context import Gateway
from services.gateway.http.ownership import owned_session
from services.gateway.submit import unload
from services.gateway.wire import tinker_wire as w

CLIENT_CONFIG = w.ClientConfigResponse(
    # The flags are explicit so a client runs the same way whatever its version's defaults.
    pjwt_auth_enabled=False,  # `jwt_auth` turns it on (client_config_for)
    proto_compress_fwdbwd=False,
    parallel_fwdbwd_chunks=True,
    use_pyqwest_transport=False,  # `client_transport` turns it on (client_config_for)
    sample_use_retrieve_futures=False,
    custom_loss_server_side=False,  # server-side custom losses: not offered (forward_backward_custom works client-side)
    sample_join_sampling_session=False,
    proto_write_fwdbwd=False,
    fwd_via_fwdbwd=False,
    create_model_via_load_weights=False,
)


PROTO_OVERHEAD_PER_DATUM = 256
"""Protobuf framing the SDK's chunk-size estimate leaves out (tags, lengths, shapes, map keys)."""


def client_config_for(config: GatewayConfig) -> w.ClientConfigResponse:
    """The SDK chunks forward_backward by these, so every chunk it sends fits the gateway's limits."""
    framing = PROTO_OVERHEAD_PER_DATUM * config.max_datums_per_request
    return msgspec.structs.replace(
        CLIENT_CONFIG,
        fwdbwd_max_chunk_len=config.max_datums_per_request,
        fwdbwd_max_chunk_bytes_count=max(1, config.max_request_bytes - framing),
        sample_max_concurrent_requests=max(1, config.sampling_capacity),
        pjwt_auth_enabled=config.jwt_auth,
        use_pyqwest_transport=config.client_transport == "pyqwest",
    )


@post("/api/v1/client/config", status_code=200, operation_id="client_config")
async def client_config(gateway: Gateway, tenant: Tenant) -> w.ClientConfigResponse:
    return client_config_for(gateway.config)


@post("/api/v1/client/dynamic_config", status_code=200, operation_id="client_dynamic_config")
async def client_dynamic_config(tenant: Tenant) -> w.ClientDynamicConfigResponse:
    # the SDK cancels the samples it abandons: cancel_future stops their generation
    return w.ClientDynamicConfigResponse(refresh_interval_sec=300, sample_cancel_enabled=True)


@post("/api/v1/create_session", status_code=200, operation_id="create_session")
async def create_session(
    request: Request,  # type: ignore[type-arg]
    data: w.CreateSessionRequest,
    gateway: Gateway,
    tenant: Tenant,
) -> w.CreateSessionResponse:
    # Low-level HTTP retries keep the same idempotency key: they get the same session.
    key = request.headers.get("x-idempotency-key")
    seed = f"{tenant.id}|{key}" if key else uuid.uuid4().hex
    session_id = "s-" + hashlib.sha256(seed.encode()).hexdigest()[:20]
    record = SessionRecord(
        session_id=session_id,
        tenant=tenant.id,
        created_ns=now_ns(),
        tags=data.tags,
        user_metadata=data.user_metadata,
        sdk_version=data.sdk_version,
        project_id=data.project_id,
        display_name=data.display_name,
    )
    await gateway.store.create(s.KV_SESSIONS, session_id, record, SessionRecord)
    await gateway.bus.emit(
        SessionEvent(session_id=session_id, what="created", tenant=tenant.id, at_ns=now_ns())
    )
    return w.CreateSessionResponse(session_id=session_id)


@post("/api/v1/session_heartbeat", status_code=200, operation_id="session_heartbeat")
async def session_heartbeat(
    data: w.SessionHeartbeatRequest, gateway: Gateway, tenant: Tenant
) -> w.SessionHeartbeatResponse:
    record = await owned_session(gateway, tenant, data.session_id)
    if gateway.sessions is not None:
        await gateway.sessions.beat(record)  # 410 once the session is over: the SDK stops beating
    return w.SessionHeartbeatResponse()


@post("/api/v1/sessions/{session_id:str}/finish", status_code=200, operation_id="finish_session")
async def finish_session(
    session_id: str, data: w.SessionFinishRequest, gateway: Gateway, tenant: Tenant
) -> dict[str, str]:
    record = await owned_session(gateway, tenant, session_id)
    # The session's models give their adapter slots back once their queued work has run;
    # their checkpoints stay. (Repeated on a retried finish: unloading is idempotent.)
    for _, model in await gateway.store.scan(
        s.KV_MODELS, ModelRecord, prefix=ids.session_models_prefix(session_id)
    ):
        if model.tenant == tenant.id and model.copy_of is None:  # copies were never loaded
            await unload(gateway, model)
    if not record.finished:
        record.finished = True
        record.finish_reason = data.reason.type
        await gateway.store.put(s.KV_SESSIONS, ids.token(session_id), record)
        await gateway.bus.emit(
            SessionEvent(
                session_id=session_id, what=f"finished:{data.reason.type}", tenant=tenant.id, at_ns=now_ns()
            )
        )
    return {"status": "finished"}


@post("/api/v1/telemetry", status_code=200, operation_id="telemetry")
async def telemetry(data: w.TelemetrySendRequest, tenant: Tenant) -> w.TelemetryResponse:
    return w.TelemetryResponse(status="accepted")


@get("/api/v1/get_server_capabilities", operation_id="get_server_capabilities")
async def get_server_capabilities(gateway: Gateway, tenant: Tenant) -> w.GetServerCapabilitiesResponse:
    return w.GetServerCapabilitiesResponse(
        supported_models=[
            w.SupportedModel(
                model_name=model.name,
                max_context_length=model.max_context,
                trainable=True,
                sampleable=gateway.pool(model.name) is not None,  # it has sampling engines
            )
            for model in gateway.models
        ]
    )


async def trainers_ready(gateway: Gateway) -> list[TrainerStatus]:
    ready = []
    for key in await gateway.store.keys(s.KV_TRAINERS):
        status = await gateway.store.get(s.KV_TRAINERS, key, TrainerStatus)
        if status is not None and status.ready:
            ready.append(status)
    return ready


async def not_serving(gateway: Gateway) -> dict[str, str]:
    """What keeps the stack from serving, by service (empty: everything serves).

    Every service `tinkerd up` supervises that is not up (its stack state file; gateway replicas
    answer for themselves), no ready trainer, and every base model whose engines all fail their
    check (sampling/engines.py: not reachable, not a sampling engine, or another model)."""
    problems: dict[str, str] = {}
    state_file = state_file_from_env(os.environ)
    stack = read_state(state_file) if state_file is not None else None
    for name, service in (stack.services if stack else {}).items():
        if service.state != UP and service_of(name) != "gateway":
            problems[name] = describe(name, service)
    if not await trainers_ready(gateway):
        problems.setdefault("trainer", "no trainer is ready yet")
    for model in gateway.models:
        pool = gateway.pool(model.name)
        why = await pool.check() if pool is not None else None
        if why is not None:
            problems[f"engines of {model.name}"] = why
    return problems


@get("/api/v1/healthz", operation_id="healthz")
async def healthz(gateway: Gateway) -> Response[dict[str, object]]:
    """Readiness, not just liveness: 200 only when every service of the stack serves
    (`not_serving`); else 503 with each service that does not, and why."""
    problems = await not_serving(gateway)
    if not problems:
        return Response({"status": "ok"}, status_code=200)
    detail = "; ".join(problems.values())
    return Response({"status": "unavailable", "detail": detail, "services": problems}, status_code=503)


@get("/api/v1/auth/apikey/me", operation_id="apikey_me")
async def apikey_me(tenant: Tenant) -> dict[str, object]:
    return {
        "key_id": tenant.key_digest[:16],
        "name": tenant.key_name or tenant.id,
        "note": "",
        "details": {"org_details": {"name": tenant.id}, "user_details": {"email": ""}},
    }


ROUTES = [
    client_config,
    client_dynamic_config,
    create_session,
    session_heartbeat,
    finish_session,
    telemetry,
    get_server_capabilities,
    apikey_me,
]
PUBLIC_ROUTES = [healthz]
