"""Internal snapshots of the trainer's state, so that recovery replays only the units after one.

A snapshot captures, for each occupied slot, the model it serves and its complete training
state (adapter, AdamW moments and step counter, accumulated gradients), every paged-out model's
state the same way, and the work-stream sequence of the last unit it includes. Restoring it and
re-executing the later units (those that have outcomes) reproduces the trainer's state bit for
bit. Snapshots are written atomically; the last two are kept.

    DATA/trainer/<group>/snapshots/<work_seq:012d>/slots.json
    DATA/trainer/<group>/snapshots/<work_seq:012d>/slot-<n>.safetensors
    DATA/trainer/<group>/snapshots/<work_seq:012d>/paged-<model token>.safetensors

A paged state is written to disk once (the page store's file, `PageStore.durable`) and then
hard-linked into every snapshot that holds it; the page store reads it from the newest snapshot's
link from then on (the older link goes with its snapshot).

A snapshot records the training-state format of its adapters (``state_format.FORMAT_VERSION``);
one of another format is refused on restore (a ``msgspec.ValidationError``: recovery then
replays the whole work stream instead, see ``services/trainer/recovery.py``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec

from libs.checkpoints import layout
from libs.checkpoints.state_format import FORMAT_VERSION
from libs.contracts.ids import token
from services.trainer import paging
from services.trainer.engine import TrainerEngine

KEEP = 2
INDEX = "slots.json"


class SnapshotIndex(msgspec.Struct):
    work_seq: int
    slots: dict[int, str] = {}  # slot -> model id
    paged: list[str] = []  # model ids
    format_version: int = 2  # of the adapters' layout; snapshots without the field held format 2


def root(data_dir: Path, group: str) -> Path:
    return data_dir / "trainer" / group / "snapshots"


def _paged_file(model_id: str) -> str:
    return f"paged-{token(model_id)}.safetensors"


def take(
    engine: TrainerEngine,
    slot_models: dict[int, str],
    store: paging.PageStore,
    data_dir: Path,
    group: str,
    work_seq: int,
) -> Path:
    """Write a snapshot covering every unit up to `work_seq`; returns its directory."""
    files: dict[str, bytes] = {}
    links: dict[str, Path] = {}
    for slot, model_id in sorted(slot_models.items()):
        files[f"slot-{slot}.safetensors"] = paging.encode(paging.capture(engine, slot, model_id))
    for model_id in store.models:  # written to disk once per page-out, then only linked
        links[_paged_file(model_id)] = store.durable(model_id)
    index = SnapshotIndex(work_seq, dict(sorted(slot_models.items())), store.models, FORMAT_VERSION)
    files[INDEX] = msgspec.json.encode(index)
    directory = layout.write_dir_atomically(root(data_dir, group) / f"{work_seq:012d}", files, links=links)
    for model_id in index.paged:
        store.adopt(model_id, directory / _paged_file(model_id))  # the old link may be collected
    for old in sorted(p for p in root(data_dir, group).iterdir() if p.is_dir() and not p.name.startswith("."))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return directory


def latest(data_dir: Path, group: str) -> Path | None:
    base = root(data_dir, group)
    if not base.exists():
        return None
    done = sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / INDEX).exists())
    return done[-1] if done else None


def restore(engine: TrainerEngine, store: paging.PageStore, directory: Path) -> tuple[int, dict[int, str]]:
    """Load a snapshot into the engine and the page store. Returns (work_seq, slot -> model id)."""
    index = msgspec.json.decode((directory / INDEX).read_bytes(), type=SnapshotIndex)
    if index.format_version != FORMAT_VERSION:
        raise msgspec.ValidationError(
            f"snapshot {directory.name} holds format-{index.format_version} adapters; this trainer "
            f"reads format {FORMAT_VERSION}"
        )
    for slot in index.slots:
        paging.restore(engine, slot, paging.decode(directory / f"slot-{slot}.safetensors"))
    for model_id in index.paged:
        store.adopt(model_id, directory / _paged_file(model_id))
    return index.work_seq, dict(index.slots)
