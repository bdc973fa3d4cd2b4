"""Resolve a base-model name to a local Hugging Face model directory.

A name is one of:

* a short name from ``SHORT_NAMES`` (``"tiny-qwen3"``, ``"tiny-llama"``) or its
  Hub-style alias (``"tinkerd/tiny-qwen3"``, ``"tinkerd/tiny-llama"``), looked up
  as ``layout.models_root(data_dir) / <short name>`` (built there on demand);
* the name of any directory under ``layout.models_root(data_dir)`` holding a
  ``config.json``;
* a path (absolute, ``~``-prefixed or relative to the working directory) to a
  directory holding a ``config.json``.

Protocol pitfall: the Tinker SDK rewrites base-model strings that contain
exactly two ``/`` (``"/models/tiny"`` looks like ``org/name`` with a leading
slash and gets mangled).  Paths that clients send as ``base_model`` must
therefore contain three or more slashes (``/srv/models/tiny``) or be referred to
by a short name / ``tinkerd/...`` alias instead.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from libs.checkpoints import layout
from libs.models.tiny import PRESETS, build_tiny

# Short name -> Hub-style alias.  The short name is the canonical id and the
# directory name under ``layout.models_root``.
SHORT_NAMES: dict[str, str] = {
    "tiny-qwen3": "tinkerd/tiny-qwen3",
    "tiny-llama": "tinkerd/tiny-llama",
    "tiny-qwen3-narrow": "tinkerd/tiny-qwen3-narrow",
}
ALIASES: dict[str, str] = {alias: short for short, alias in SHORT_NAMES.items()}
SUPPORTED_ARCHS: frozenset[str] = frozenset({"qwen3", "llama"})


class UnknownBaseModel(ValueError):
    """A base-model name that is neither a known name nor a model directory."""

    def __init__(self, name: str, known: list[str] | None = None, reason: str = "") -> None:
        self.name = name
        self.known = sorted(set(known if known is not None else [*SHORT_NAMES, *ALIASES]))
        detail = f" ({reason})" if reason else ""
        super().__init__(
            f"unknown base model {name!r}{detail}; known names: {', '.join(self.known)}, "
            "or a path to a directory containing config.json"
        )


class UnsupportedArchitecture(ValueError):
    """A model directory whose ``model_type`` the trainer cannot handle."""


@dataclass(frozen=True)
class ResolvedModel:
    """A base model resolved to a local directory."""

    name: str  # canonical id: short name, or the resolved absolute directory path
    path: Path
    arch: str  # "qwen3" | "llama"
    vocab_size: int
    max_context: int


def _is_complete(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file()


def ensure_tiny(data_dir: Path, preset: str = "tiny-qwen3") -> Path:
    """Return ``layout.models_root(data_dir) / preset``, building it first if missing.

    The build goes into a temporary directory beside the target and is moved in
    with ``os.replace``, so readers never see a partial model.  If two processes
    race, the loser's ``os.replace`` fails on the now non-empty target and its
    temporary directory is discarded.
    """
    if preset not in PRESETS:
        raise UnknownBaseModel(preset, known=list(PRESETS), reason="not a tiny preset")
    root = layout.models_root(data_dir)
    target = root / preset
    if _is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{preset}.", suffix=".tmp", dir=root))
    try:
        build_tiny(tmp, preset)
        os.chmod(tmp, 0o755)
        try:
            os.replace(tmp, target)
        except OSError:
            # Lost a race (target now exists and is non-empty): keep the winner's.
            if not _is_complete(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _installed(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".") and _is_complete(p))


def _describe(name: str, model_dir: Path) -> ResolvedModel:
    config = json.loads((model_dir / "config.json").read_text())
    arch = str(config.get("model_type", ""))
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedArchitecture(
            f"base model {name!r} at {model_dir} has model_type {arch!r}; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHS))}"
        )
    return ResolvedModel(
        name=name,
        path=model_dir,
        arch=arch,
        vocab_size=int(config["vocab_size"]),
        max_context=int(config["max_position_embeddings"]),
    )


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "~", ".")) or os.sep in name or "/" in name


def resolve_base_model(name: str, data_dir: Path, *, build_missing: bool = True) -> ResolvedModel:
    """Resolve ``name`` (short name, ``tinkerd/...`` alias or directory path).

    Short names and aliases resolve to ``layout.models_root(data_dir) / <short name>``;
    with ``build_missing`` (the default) a missing tiny model is built there via
    ``ensure_tiny``.  Raises ``UnknownBaseModel`` for anything else, and
    ``UnsupportedArchitecture`` when a directory holds a model that is neither
    Qwen3 nor Llama.
    """
    root = layout.models_root(data_dir)
    short = ALIASES.get(name, name)
    if short in SHORT_NAMES:
        target = root / short
        if not _is_complete(target):
            if not build_missing:
                raise UnknownBaseModel(name, reason=f"not built under {root}")
            target = ensure_tiny(data_dir, short)
        return _describe(short, target)

    if name and not _looks_like_path(name) and _is_complete(root / name):
        return _describe(name, root / name)

    if name and _looks_like_path(name):
        candidate = Path(name).expanduser().resolve()
        if _is_complete(candidate):
            return _describe(str(candidate), candidate)
        raise UnknownBaseModel(
            name, known=[*SHORT_NAMES, *ALIASES, *_installed(root)], reason="no config.json at that path"
        )
    raise UnknownBaseModel(name, known=[*SHORT_NAMES, *ALIASES, *_installed(root)])
