"""Tiny deterministic base models and the base-model name registry.

``build_tiny`` writes an offline, byte-reproducible Hugging Face causal LM
(Qwen3 or Llama layout) for tests and local runs; ``resolve_base_model`` maps a
short name, ``tinkerd/...`` alias or directory path to a local model directory.
"""

from libs.models.registry import (
    ALIASES,
    SHORT_NAMES,
    ResolvedModel,
    UnknownBaseModel,
    UnsupportedArchitecture,
    ensure_tiny,
    resolve_base_model,
)
from libs.models.tiny import PRESETS, build_tiny

__all__ = [
    "ALIASES",
    "PRESETS",
    "SHORT_NAMES",
    "ResolvedModel",
    "UnknownBaseModel",
    "UnsupportedArchitecture",
    "build_tiny",
    "ensure_tiny",
    "resolve_base_model",
]
