"""One span per HTTP request, continuing the caller's `traceparent` if it sent one."""

from __future__ import annotations

from litestar.types import ASGIApp, Receive, Scope, Send

from infra import tracing


def trace_requests(app: ASGIApp) -> ASGIApp:
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        name = f"{scope.get('method', 'GET')} {scope.get('path', '')}"
        with tracing.span(name, headers.get("traceparent", ""), service="gateway"):
            await app(scope, receive, send)

    return middleware
