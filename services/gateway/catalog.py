"""Checkpoint names, `tinker://` paths and their catalogue records (KV `tinker_checkpoints`).

Names match a strict pattern and every resolved directory must stay under the data root, so a
name can never point outside it. Another tenant's checkpoint is a 404 unless it was published.
"""

from __future__ import annotations

import re
from pathlib import Path

from libs.contracts import subjects as s
from libs.contracts.records import CheckpointRecord
from services.gateway.auth import Tenant
from services.gateway.context import Gateway
from services.gateway.errors import BadRequest, NotFound

NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")
SEGMENTS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


def check_name(name: str | None, field: str) -> str:
    if not name or not NAME.match(name) or ".." in name:
        raise BadRequest(
            f"{field} {name!r} is not a valid checkpoint name: use 1-128 characters from [A-Za-z0-9_.-], "
            "not starting with '.' and without '..'"
        )
    return name


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """`tinker://{run}/{segment}/{name}` -> (run id, checkpoint type, name)."""
    if not path.startswith("tinker://"):
        raise BadRequest(f"path {path!r} must start with tinker://")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in SEGMENTS:
        raise BadRequest(f"path {path!r} must look like tinker://RUN/(weights|sampler_weights)/NAME")
    run, segment, name = parts
    if not s.is_valid_id(run):
        raise NotFound(f"checkpoint {path!r} not found")
    check_name(name, "checkpoint name")
    return run, SEGMENTS[segment], name


def checkpoint_key(run: str, kind: str, name: str) -> str:
    return f"{s.token(run)}.{kind}.{name}"


def within(root: Path, candidate: Path) -> bool:
    try:
        candidate.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


async def resolve_checkpoint(
    gateway: Gateway, tenant: Tenant, path: str, kind: str | None = None
) -> CheckpointRecord:
    """The checkpoint record for `path`, if the caller may read it (owner, or published)."""
    run, ckpt_kind, name = parse_tinker_path(path)
    record = await gateway.store.get(s.KV_CHECKPOINTS, checkpoint_key(run, ckpt_kind, name), CheckpointRecord)
    if record is None or (record.tenant != tenant.id and not record.public):
        raise NotFound(f"checkpoint {path!r} not found")
    if kind is not None and record.kind != kind:
        if kind == "training" and record.kind == "sampler":
            raise BadRequest(
                f"{path} is a sampler snapshot (weights only, PEFT format); training state is restored from "
                "a save_state checkpoint (tinker://RUN/weights/NAME)"
            )
        raise BadRequest(f"{path} is a {record.kind} checkpoint, expected {kind}")
    if not within(gateway.data_dir, Path(record.directory)):
        raise NotFound(f"checkpoint {path!r} not found")
    if record.base_model != gateway.model.name:
        raise BadRequest(
            f"checkpoint {path} was trained on base model {record.base_model!r}; this deployment serves {gateway.model.name!r}"
        )
    return record
