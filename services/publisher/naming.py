"""How sampling engines name sampler exports (the publisher records the name; it never calls an engine)."""

from __future__ import annotations

from libs.contracts.ids import token


def adapter_name(run_or_sampler: str, name: str, version: str) -> str:
    """The engine-side adapter name: unique per immutable version, so it never changes weights."""
    return f"{token(run_or_sampler)}.{name}.{version}"
