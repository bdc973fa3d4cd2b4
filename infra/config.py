"""Settings shared by every service, read once at start from the environment.

`from_env` tries `TINKERD_<SERVICE>_<KEY>` before `TINKERD_<KEY>`, so one env file can configure a
whole stack and still override a single service. Bad values fail at start and name the variable.

A setting that several services must agree on is declared once below, as a `Shared` (its field
name, variable, default and meaning); every service's config takes that setting's default from
here, and none spells a second one (`tests/infra/test_vocabulary.py` checks it). Set it with the
unprefixed variable, which every service reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T", bound=msgspec.Struct)
V = TypeVar("V")

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_DATA_DIR = "var"


@dataclass(frozen=True)
class Shared(Generic[V]):
    """A setting that must have one value across services, declared once."""

    name: str
    """The config field of every service that reads it."""
    default: V
    doc: str
    """What it means, and which services read it."""

    @property
    def env(self) -> str:
        """The variable that sets it for every service at once."""
        return f"TINKERD_{self.name.upper()}"


MAX_LORA_RANK = Shared(
    "max_lora_rank",
    64,
    "Highest LoRA rank: the gateway refuses larger ranks, the trainer sizes its adapter slots by it "
    "and the sampler refuses larger adapters (keep real SGLang's --max-lora-rank at least this).",
)
NUM_SLOTS = Shared(
    "num_slots",
    8,
    "Adapter slots of a trainer group, the models it trains at once: the trainer's pool; the "
    "planner's count for a group until the group reports its own (the trainer's count wins).",
)
TOKEN_BUDGET = Shared(
    "token_budget",
    16_384,
    "Tokens per work unit the planner packs (a single datum over it ships alone).",
)
SHARED: tuple[Shared[Any], ...] = (MAX_LORA_RANK, NUM_SLOTS, TOKEN_BUDGET)
"""Every setting declared here."""


def from_env(cls: type[T], service: str, env: Mapping[str, str], **overrides: Any) -> T:
    """Build the frozen config Struct `cls` from `TINKERD_*` variables (plus explicit overrides)."""
    values: dict[str, Any] = {}
    for name in cls.__struct_fields__:
        for key in (f"TINKERD_{service.upper()}_{name.upper()}", f"TINKERD_{name.upper()}"):
            if key in env:
                values[name] = env[key]
                break
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return msgspec.convert(values, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise SystemExit(f"invalid {service} configuration: {exc} (set via TINKERD_* variables)") from exc


def data_path(data_dir: str) -> Path:
    return Path(data_dir).expanduser().resolve()
