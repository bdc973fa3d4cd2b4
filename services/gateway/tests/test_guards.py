"""The operator policy (``guards.operator_only``), on its own: who passes and who gets 403."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from services.gateway.config import GatewayConfig
from services.gateway.http import guards
from services.gateway.http.errors import Forbidden


def connection(host: str, key: str | None = None) -> Any:
    gateway = SimpleNamespace(config=GatewayConfig(admin_key="sesame"))
    return SimpleNamespace(
        client=SimpleNamespace(host=host),
        headers={"x-admin-key": key} if key else {},
        app=SimpleNamespace(state=SimpleNamespace(gateway=gateway)),
    )


async def test_operator_routes_refuse_remote_clients_without_the_admin_key() -> None:
    await guards.operator_only(connection("127.0.0.1"), None)  # type: ignore[arg-type]
    await guards.operator_only(connection("10.1.2.3", "sesame"), None)  # type: ignore[arg-type]
    for refused in (connection("10.1.2.3"), connection("10.1.2.3", "wrong")):
        with pytest.raises(Forbidden):
            await guards.operator_only(refused, None)  # type: ignore[arg-type]
