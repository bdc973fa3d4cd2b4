"""How sampling engines name sampler exports (adapters) (the publisher records the name; it never calls an engine)."""

from __future__ import annotations


def adapter_name(run_or_sampler: str, name: str, version: str) -> str:
    """The engine-side adapter name: unique per immutable version, so it never changes weights."""
    return f"{run_or_sampler.replace(':', '=')}.{name}.{version}"
