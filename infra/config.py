"""Settings shared by every service, read once at start from the environment.

`from_env` tries `TINKERD_<SERVICE>_<KEY>` before `TINKERD_<KEY>`, so one env file can configure a
whole stack and still override a single service. Bad values fail at start and name the variable.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec

T = TypeVar("T", bound=msgspec.Struct)

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_DATA_DIR = "var"


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
