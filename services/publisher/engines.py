"""Tells SGLang-compatible sampling engines about adapter snapshots (`/load_lora_adapter`)."""

from __future__ import annotations

import httpx
import msgspec


class LoadResult(msgspec.Struct):
    success: bool = False
    error_message: str | None = None


def adapter_name(run_or_sampler: str, name: str, version: str) -> str:
    """The engine-side adapter name: unique per immutable version, so it never changes weights."""
    return f"{run_or_sampler.replace(':', '=')}.{name}.{version}"


async def load_adapter(client: httpx.AsyncClient, engine_url: str, name: str, path: str) -> None:
    """Load `path` under `name`; loading a name that is already loaded counts as success."""
    response = await client.post(
        f"{engine_url}/load_lora_adapter", json={"lora_name": name, "lora_path": path}
    )
    result = msgspec.json.decode(response.content, type=LoadResult) if response.content else LoadResult()
    if response.status_code == 200 and result.success:
        return
    message = result.error_message or response.text
    if "already" in message.lower():
        return
    raise RuntimeError(f"engine {engine_url} could not load adapter {name}: {message}")
