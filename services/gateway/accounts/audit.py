"""The audit log's entries: each change a tenant makes (checkpoints deleted, published, copied or
read for download, TTLs set, sessions assigned to projects) recorded as an `Audited` event.

`GET /api/v1/audit` answers them folded from the events stream (`catalog.metering.audit_entries`).
"""

from __future__ import annotations

from libs.contracts import ids
from libs.contracts.common import now_ns
from libs.contracts.events import Audited
from services.gateway.accounts.auth import Tenant
from services.gateway.context import Gateway


async def audit(
    gateway: Gateway, tenant: Tenant, resource: str, action: str, subject: str, **details: str
) -> None:
    """Record who did what; awaited, so the audit log shows a change once its call has returned
    (an event-log outage costs the entry, never the operation: `Bus.emit` only logs)."""
    model_id, _ = ids.split_path(subject)
    await gateway.bus.emit(
        Audited(
            resource=resource,
            action=action,
            subject=subject,
            actor=tenant.key_digest[:16],
            details=details,
            tenant=tenant.id,
            model_id=model_id,
            at_ns=now_ns(),
        )
    )
