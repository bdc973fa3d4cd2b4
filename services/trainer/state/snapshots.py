"""Internal snapshots of the trainer's state, so that recovery replays only the units after one.

A snapshot captures, for each occupied slot, the model it serves and its complete training
state (a ``SlotState`` with its gradients, ``slots.capture``, one file each: ``files.py``), every
paged-out model's state the same way, and the work-stream sequence of the last unit it includes. Restoring it and
re-executing the later units (those that have outcomes) reproduces the trainer's state bit for
bit. Snapshots are written atomically; the last two are kept.

Taking one has three parts so that the trainer's unit path waits only for the first
(``services/trainer/service.py``): ``capture`` copies every slot's state to host memory between
two units (so it is exactly the state after `work_seq`) and makes the paged states durable;
``write`` encodes and writes the directory, on a background thread while later units run; and
``finish``, again between two units, points the page store at the snapshot's links and removes
the snapshots beyond the last two. A snapshot whose write has not finished is just absent:
recovery uses the newest complete one.

    DATA/trainer/<group>/snapshots/<work_seq:012d>/slots.json
    DATA/trainer/<group>/snapshots/<work_seq:012d>/slot-<n>.safetensors
    DATA/trainer/<group>/snapshots/<work_seq:012d>/paged-<model token>.safetensors

A slot whose state is unchanged since the newest complete snapshot (the engine's
``state_versions`` token for it is the one that snapshot recorded, and it serves the same model)
is not copied again: that snapshot's ``slot-<n>.safetensors`` is hard-linked into the new one at
capture (the bytes are the slot's state then, and nothing has changed it since), so the capture
copies only the slots that trained in between.

A paged state is written to disk once (the page store's file, `PageStore.durable`) and then
hard-linked into every snapshot that holds it; the page store reads it from the newest snapshot's
link from then on (the older link goes with its snapshot).

A snapshot records the training-state format of its adapters (``state_format.FORMAT_VERSION``);
one of another format is refused on restore (a ``msgspec.ValidationError``: recovery then
replays the whole work stream instead, see ``services/trainer/recovery.py``).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from libs.checkpoints import layout
from libs.checkpoints.state_format import FORMAT_VERSION
from services.trainer.engine import TrainerEngine
from services.trainer.slot_state import SlotState
from services.trainer.state import files, paging, slots

KEEP = 2
INDEX = "slots.json"
_HOLD = ".tmp-hold-"  # a capture's links to the paged files, until its write


class SnapshotIndex(msgspec.Struct):
    work_seq: int
    slots: dict[int, str] = {}  # slot -> model id
    paged: list[str] = []  # model ids
    format_version: int = 2  # of the adapters' layout; snapshots without the field held format 2
    versions: dict[int, str] = {}  # slot -> the engine's state token when captured (may be absent)


def root(data_dir: Path, group: str) -> Path:
    return layout.trainer_snapshots_dir(data_dir, group)


@dataclass(frozen=True)
class Captured:
    """A snapshot's contents, held in host memory until ``write`` puts them on disk."""

    index: SnapshotIndex
    slots: dict[int, SlotState]  # the slots copied to host memory
    links: dict[str, Path]  # paged model id -> a hard link to its file as captured, in `hold`
    hold: Path  # removed by ``write``
    # an unchanged slot -> a link to its file in an earlier snapshot, in `hold`
    reused: dict[int, Path] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.slots.values())


def capture(
    engine: TrainerEngine,
    slot_models: dict[int, str],
    store: paging.PageStore,
    data_dir: Path,
    group: str,
    work_seq: int,
) -> Captured:
    """The state after `work_seq` (call it between units): host copies of the occupied slots, and
    the paged states as files (each written at most once, ``PageStore.durable``), hard-linked at
    once into a holding directory: the page store may delete or rewrite its file under the same
    name before ``write`` runs. A slot unchanged since the newest snapshot is linked from it
    instead of copied (module docstring)."""
    base = root(data_dir, group)
    base.mkdir(parents=True, exist_ok=True)
    for stale in base.glob(f"{_HOLD}*"):  # of a trainer that died before writing (one at a time)
        shutil.rmtree(stale, ignore_errors=True)
    hold = base / f"{_HOLD}{work_seq:012d}"
    hold.mkdir()
    versions = engine.state_versions
    unchanged = _unchanged(data_dir, group, slot_models, versions)
    reused: dict[int, Path] = {}
    for slot, source in unchanged.items():
        reused[slot] = _hold_link(source, hold / f"slot-{slot}.safetensors")
    engine.snapshot_buffers.retain(set(slot_models))
    copies = {
        slot: slots.capture(engine, slot, for_snapshot=True) for slot in sorted(slot_models) if slot not in reused
    }
    links: dict[str, Path] = {}
    for model_id in store.models:
        links[model_id] = _hold_link(store.durable(model_id), hold / layout.snapshot_paged_name(model_id))
    index = SnapshotIndex(
        work_seq,
        dict(sorted(slot_models.items())),
        store.models,
        FORMAT_VERSION,
        {slot: versions[slot] for slot in sorted(slot_models) if slot in versions},
    )
    return Captured(index, copies, links, hold, reused)


def _hold_link(source: Path, held: Path) -> Path:
    try:
        os.link(source, held)
    except OSError:  # no hard links here: a copy
        shutil.copyfile(source, held)
    return held


def _unchanged(
    data_dir: Path, group: str, slot_models: dict[int, str], versions: dict[int, str]
) -> dict[int, Path]:
    """slot -> its file in the newest complete snapshot, for each slot that snapshot recorded with
    the same model and the same state token as the engine has now."""
    previous = latest(data_dir, group)
    if previous is None:
        return {}
    try:
        index = msgspec.json.decode((previous / INDEX).read_bytes(), type=SnapshotIndex)
    except (OSError, msgspec.DecodeError):
        return {}
    if index.format_version != FORMAT_VERSION:
        return {}
    out: dict[int, Path] = {}
    for slot, model_id in slot_models.items():
        token_now = versions.get(slot)
        path = previous / f"slot-{slot}.safetensors"
        if (
            token_now is not None
            and index.slots.get(slot) == model_id
            and index.versions.get(slot) == token_now
            and path.exists()
        ):
            out[slot] = path
    return out


def write(captured: Captured, data_dir: Path, group: str) -> Path:
    """Write the snapshot's directory atomically (any thread); returns it."""
    try:
        index = captured.index
        contents: dict[str, layout.FileData] = {
            f"slot-{slot}.safetensors": files.encode(state, index.slots[slot]) for slot, state in captured.slots.items()
        }
        contents[INDEX] = msgspec.json.encode(index)
        links = {layout.snapshot_paged_name(model_id): path for model_id, path in captured.links.items()}
        links |= {f"slot-{slot}.safetensors": path for slot, path in captured.reused.items()}
        final = layout.trainer_snapshot_dir(data_dir, group, index.work_seq)
        return layout.write_dir_atomically(final, contents, links=links)
    finally:
        shutil.rmtree(captured.hold, ignore_errors=True)


def finish(captured: Captured, directory: Path, store: paging.PageStore, data_dir: Path, group: str) -> None:
    """After ``write`` (call it between units): the page store reads each paged state that is still
    the captured one from the snapshot's link, then older snapshots beyond the last two go."""
    for model_id in captured.links:
        current, link = store.file_of(model_id), directory / layout.snapshot_paged_name(model_id)
        if current is not None and current.exists() and os.path.samefile(current, link):
            # still the captured state (not paged in, or out again, since): read it from the
            # snapshot's link, so that the old link may be collected
            store.adopt(model_id, link)
    for old in sorted(
        p for p in root(data_dir, group).iterdir() if p.is_dir() and not p.name.startswith(".")
    )[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)


def take(
    engine: TrainerEngine,
    slot_models: dict[int, str],
    store: paging.PageStore,
    data_dir: Path,
    group: str,
    work_seq: int,
) -> Path:
    """Write a snapshot covering every unit up to `work_seq` in one go; returns its directory."""
    captured = capture(engine, slot_models, store, data_dir, group, work_seq)
    directory = write(captured, data_dir, group)
    finish(captured, directory, store, data_dir, group)
    return directory


def latest(data_dir: Path, group: str) -> Path | None:
    base = root(data_dir, group)
    if not base.exists():
        return None
    done = sorted(
        p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / INDEX).exists()
    )
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
        slots.restore(engine, slot, files.read(directory / f"slot-{slot}.safetensors")[1])
    for model_id in index.paged:
        store.adopt(model_id, directory / layout.snapshot_paged_name(model_id))
    return index.work_seq, dict(index.slots)


def complete(data_dir: Path, group: str) -> list[Path]:
    """The group's complete snapshots, oldest first (read side: another group may read them)."""
    base = root(data_dir, group)
    if not base.exists():
        return []
    return sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / INDEX).exists())


def read_index(directory: Path) -> SnapshotIndex:
    """A snapshot's index (which model is in which slot file, which are paged)."""
    return msgspec.json.decode((directory / INDEX).read_bytes(), type=SnapshotIndex)


def model_state(directory: Path, model_id: str) -> tuple[SlotState | None, bool]:
    """One model's complete training state as the snapshot holds it (None if it holds none), and
    whether it was resident (in a slot) rather than paged out."""
    index = read_index(directory)
    if index.format_version != FORMAT_VERSION:
        raise msgspec.ValidationError(
            f"snapshot {directory.name} holds format-{index.format_version} adapters; this trainer "
            f"reads format {FORMAT_VERSION}"
        )
    for slot, held in index.slots.items():
        if held == model_id:
            return files.read(directory / f"slot-{slot}.safetensors")[1], True
    if model_id in index.paged:
        return files.read(directory / layout.snapshot_paged_name(model_id))[1], False
    return None, False
