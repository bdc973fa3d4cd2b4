"""`TINKERD_GATEWAY_BASE_SAMPLER_URLS`: the engines of each extra base model, checked at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.models.registry import ResolvedModel
from services.gateway.config import GatewayConfig
from services.gateway.context import engine_urls_by_base

PRIMARY = ResolvedModel("tiny-qwen3", Path("/m/tiny-qwen3"), "qwen3", 2048, 2048)
NARROW = ResolvedModel("tiny-qwen3-narrow", Path("/m/tiny-qwen3-narrow"), "qwen3", 1024, 1024)
ALIASES = {"tiny-qwen3": PRIMARY, "tiny-qwen3-narrow": NARROW, "tinkerd/tiny-qwen3-narrow": NARROW}


def urls(spec: str, sampler_urls: str = "") -> dict[str, list[str]]:
    config = GatewayConfig(base_sampler_urls=spec, sampler_urls=sampler_urls)
    return engine_urls_by_base(config, PRIMARY, ALIASES.get)


def test_entries_group_by_the_served_base_s_name_in_order_without_repeats() -> None:
    spec = "tiny-qwen3-narrow=http://a:1/, tinkerd/tiny-qwen3-narrow=http://b:2,tiny-qwen3-narrow=http://a:1"
    assert urls(spec) == {"tiny-qwen3-narrow": ["http://a:1", "http://b:2"]}
    assert urls("") == {}


@pytest.mark.parametrize(
    ("spec", "sampler_urls", "message"),
    [
        ("http://a:1", "", "is not base=url"),
        ("tiny-qwen3-narrow=", "", "is not base=url"),
        ("no-such-model=http://a:1", "", "does not serve"),
        ("tiny-qwen3=http://a:1", "", "primary base model"),
        ("tiny-qwen3-narrow=http://a:1", "http://a:1", "an engine serves one"),
    ],
)
def test_a_malformed_unknown_primary_or_shared_entry_is_refused_naming_it(
    spec: str, sampler_urls: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        urls(spec, sampler_urls)
