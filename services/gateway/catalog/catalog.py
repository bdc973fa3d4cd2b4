"""Checkpoint names, `tinker://` paths and their catalogue records (KV `tinker_checkpoints`).

Names match a strict pattern and every resolved directory must stay under the data root, so a
name can never point outside it. Another tenant's checkpoint is a 404 unless it was published.
"""

from __future__ import annotations

import datetime as dt
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import msgspec
import nats.errors

from libs.checkpoints import layout
from libs.contracts import ids
from libs.contracts import subjects as s
from libs.contracts.ids import TinkerPath, checkpoint_key
from libs.contracts.records import CheckpointRecord, ModelRecord
from services.gateway.accounts.auth import Tenant
from services.gateway.context import Gateway
from services.gateway.http.errors import BadRequest, NotFound
from services.gateway.wire import tinker_wire as w

NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")


def check_name(name: str | None, field: str) -> str:
    if not name or not NAME.match(name) or ".." in name:
        raise BadRequest(
            f"{field} {name!r} is not a valid checkpoint name: use 1-128 characters from [A-Za-z0-9_.-], "
            "not starting with '.' and without '..'"
        )
    return name


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """`tinker://{run}/{segment}/{name}` -> (run id, checkpoint type, name), or a 400/404."""
    try:
        parsed = TinkerPath.parse(path)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    if not ids.is_valid_id(parsed.run):
        raise NotFound(f"checkpoint {path!r} not found")
    check_name(parsed.name, "checkpoint name")
    return parsed.run, parsed.kind, parsed.name


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
                f"{path} is a sampler export (weights only, PEFT format); training state is restored from "
                f"a save_state checkpoint ({ids.path_shape('training')})"
            )
        raise BadRequest(f"{path} is not a {kind} checkpoint (it is {record.kind})")
    if not within(gateway.data_dir, Path(record.directory)):
        raise NotFound(f"checkpoint {path!r} not found")
    if all(record.base_model != model.name for model in gateway.models):
        names = ", ".join(repr(m.name) for m in gateway.models)
        raise BadRequest(
            f"checkpoint {path} was trained on base model {record.base_model!r}; this deployment serves {names}"
        )
    return record


# --- catalogue views (what RestClient and the CLI read) -----------------------------------------

def at(ns: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ns / 1e9, tz=dt.UTC)


def str_metadata(metadata: dict[str, object] | None) -> dict[str, str] | None:
    """The SDK's TrainingRun/Checkpoint carry `dict[str, str]` metadata."""
    if metadata is None:
        return None
    return {k: v if isinstance(v, str) else msgspec.json.encode(v).decode() for k, v in metadata.items()}


EXTERNAL_KIND_SINCE = (0, 28)
"""SDKs before 0.28 know only "training" and "sampler" checkpoints (their pydantic Literal rejects
"external"), so a listing for them shows an external export, a PEFT adapter like a sampler
snapshot, as "sampler" (its checkpoint_id and tinker_path still say external_weights)."""


def sdk_version(headers: Mapping[str, str]) -> tuple[int, ...] | None:
    """The calling SDK's version from its `X-Stainless-Package-Version` header (None if absent)."""
    raw = headers.get("x-stainless-package-version") or ""
    parts = re.findall(r"\d+", raw)[:3]
    return tuple(int(p) for p in parts) if parts else None


def knows_external(headers: Mapping[str, str]) -> bool:
    version = sdk_version(headers)
    return version is None or version >= EXTERNAL_KIND_SINCE


def checkpoint_view(record: CheckpointRecord, external: bool = True) -> w.Checkpoint:
    kind = record.kind if external or record.kind != "external" else "sampler"
    return w.Checkpoint(
        checkpoint_id=ids.checkpoint_id(record.kind, record.name),
        checkpoint_type=kind,  # type: ignore[arg-type]
        time=at(record.created_ns),
        tinker_path=record.tinker_path,
        size_bytes=record.size_bytes,
        public=record.public,
        user_metadata=str_metadata(record.user_metadata),
        expires_at=at(record.expires_ns) if record.expires_ns else None,
    )


def run_view(model: ModelRecord, checkpoints: list[CheckpointRecord], last_ns: int) -> w.TrainingRun:
    def newest(kind: str) -> w.Checkpoint | None:
        mine = [c for c in checkpoints if c.kind == kind]
        return checkpoint_view(max(mine, key=lambda c: c.created_ns)) if mine else None

    return w.TrainingRun(
        training_run_id=model.model_id,
        base_model=model.base_model,
        model_owner=model.tenant,
        is_lora=True,
        lora_rank=model.lora.rank,
        last_request_time=at(max([last_ns, model.created_ns, *(c.created_ns for c in checkpoints)])),
        last_checkpoint=newest("training"),
        last_sampler_checkpoint=newest("sampler"),
        user_metadata=str_metadata(model.user_metadata),
    )


def readable(record: CheckpointRecord, tenant: Tenant) -> bool:
    return record.tenant == tenant.id or record.public


async def run_checkpoints(gateway: Gateway, run_id: str) -> list[CheckpointRecord]:
    """Every checkpoint of one training run, newest first."""
    found = await gateway.store.scan(s.KV_CHECKPOINTS, CheckpointRecord, prefix=ids.run_checkpoints_prefix(run_id))
    return sorted((r for _, r in found), key=lambda r: r.created_ns, reverse=True)


async def last_request_ns(gateway: Gateway, model_id: str) -> int:
    """When the run's newest command was accepted (0 when its log holds none any more)."""
    try:
        msg = await gateway.bus.js.get_last_msg(s.STREAM_REQUESTS, s.request_subject(model_id))
    except nats.errors.Error:
        return 0
    return int(msg.time.timestamp() * 1e9) if msg.time else 0


async def owned_checkpoint(
    gateway: Gateway, tenant: Tenant, run_id: str, checkpoint_id: str
) -> tuple[str, CheckpointRecord | None]:
    """(KV key, record) of the caller's own checkpoint `segment/name` of `run_id`; 404 if not theirs.

    A missing record of a run the caller owns is (key, None), so deletes stay idempotent.
    """
    path = ids.unchecked_path(run_id, checkpoint_id)
    run, kind, name = parse_tinker_path(path)
    key = checkpoint_key(run, kind, name)
    record = await gateway.store.get(s.KV_CHECKPOINTS, key, CheckpointRecord)
    if record is not None:
        if record.tenant != tenant.id:
            raise NotFound(f"checkpoint {path!r} not found")
        return key, record
    model = await gateway.store.get(s.KV_MODELS, ids.token(run), ModelRecord)
    if model is None or model.tenant != tenant.id:
        raise NotFound(f"checkpoint {path!r} not found")
    return key, None


async def readable_checkpoint(gateway: Gateway, tenant: Tenant, path: str) -> CheckpointRecord:
    """The checkpoint at `path` if the caller owns it or it is published; 404 otherwise."""
    run, kind, name = parse_tinker_path(path)
    record = await gateway.store.get(s.KV_CHECKPOINTS, checkpoint_key(run, kind, name), CheckpointRecord)
    if record is None or not readable(record, tenant) or not within(gateway.data_dir, Path(record.directory)):
        raise NotFound(f"checkpoint {path!r} not found")
    return record


def delete_files(data_dir: Path, record: CheckpointRecord) -> None:
    """Remove the public name and every version directory of one checkpoint (idempotent)."""
    public = layout.public_path(data_dir, record.training_run_id, record.kind, record.name)
    versions = layout.versions_dir(data_dir, record.training_run_id, record.kind)
    if not within(data_dir, public.parent):
        return
    if public.is_symlink():
        public.unlink(missing_ok=True)
    for version in versions.glob(f"{record.name}@*") if versions.is_dir() else []:
        if within(data_dir, version):
            shutil.rmtree(version, ignore_errors=True)


async def runs_visible(
    gateway: Gateway, tenant: Tenant, accessible: bool
) -> list[tuple[ModelRecord, list[CheckpointRecord]]]:
    """The caller's runs (plus, when `accessible`, others' runs with published checkpoints), newest
    first, each with the checkpoints the caller may see."""
    checkpoints: dict[str, list[CheckpointRecord]] = {}
    for _, record in await gateway.store.scan(s.KV_CHECKPOINTS, CheckpointRecord):
        if readable(record, tenant):
            checkpoints.setdefault(record.training_run_id, []).append(record)
    visible = []
    for _, model in await gateway.store.scan(s.KV_MODELS, ModelRecord):
        mine = checkpoints.get(model.model_id, [])
        if model.tenant == tenant.id or (accessible and mine):
            visible.append((model, mine))
    return sorted(visible, key=lambda pair: pair[0].created_ns, reverse=True)


async def visible_run(gateway: Gateway, tenant: Tenant, run_id: str, accessible: bool) -> w.TrainingRun:
    """One run as the caller may see it; 404 for a run that is unknown or not theirs (unless
    `accessible` and it has published checkpoints)."""
    model = (
        await gateway.store.get(s.KV_MODELS, ids.token(run_id), ModelRecord) if ids.is_valid_id(run_id) else None
    )
    if model is None:
        raise NotFound(f"training run {run_id!r} not found")
    checkpoints = [c for c in await run_checkpoints(gateway, run_id) if readable(c, tenant)]
    if model.tenant != tenant.id and not (accessible and checkpoints):
        raise NotFound(f"training run {run_id!r} not found")
    return run_view(model, checkpoints, await last_request_ns(gateway, run_id))


def check_page(limit: int, offset: int) -> None:
    if not 1 <= limit <= 1000 or offset < 0:
        raise BadRequest(f"limit must be in [1, 1000] and offset >= 0, got limit={limit} offset={offset}")
