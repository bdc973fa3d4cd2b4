"""The records a handler may act on only for their owner, shared by the routes that take their id.

`owned_session`: a `session_id` resolved to its record in KV `tinker_sessions`, or a 404 when it is
unknown or another tenant's (`Store.owned`: existence is never leaked). Models are resolved the same
way by `submit.owned_model`, which also refuses training on a copy.
"""

from __future__ import annotations

from libs.contracts import subjects as s
from libs.contracts.records import SessionRecord
from services.gateway.accounts.auth import Tenant
from services.gateway.context import Gateway


async def owned_session(gateway: Gateway, tenant: Tenant, session_id: str) -> SessionRecord:
    return await gateway.store.owned(s.KV_SESSIONS, session_id, SessionRecord, tenant.id, "session")
