"""Internal snapshots of every slot, so that recovery replays only the units after the newest one.

A snapshot captures, for each occupied slot, the model it serves, its full training state (adapter,
AdamW moments, step counter) and its accumulated gradients, plus the work-stream sequence of the
last unit it includes. Restoring it and re-executing the later units (those that have outcomes)
reproduces the trainer's state bit for bit. Snapshots are written atomically; the last two are kept.

    DATA/trainer/<group>/snapshots/<work_seq:012d>/slots.json
    DATA/trainer/<group>/snapshots/<work_seq:012d>/slot-<n>.safetensors
"""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
from safetensors.torch import load_file, save

from libs.checkpoints import layout
from services.trainer.engine import LoraConfig, TrainerEngine
from services.trainer.slot_state import SlotState

KEEP = 2


class SlotEntry(msgspec.Struct):
    slot: int
    model_id: str
    lora: LoraConfig
    step: int
    pending: bool


class SnapshotIndex(msgspec.Struct):
    work_seq: int
    slots: list[SlotEntry]


def root(data_dir: Path, group: str) -> Path:
    return data_dir / "trainer" / group / "snapshots"


def take(engine: TrainerEngine, slot_models: dict[int, str], data_dir: Path, group: str, work_seq: int) -> Path:
    """Write a snapshot covering every unit up to `work_seq`; returns its directory."""
    files: dict[str, bytes] = {}
    entries = []
    pending = engine.pending_slots
    for slot, model_id in sorted(slot_models.items()):
        state = engine.get_slot_state(slot)
        grads = engine.get_slot_grads(slot)
        tensors = {f"adapter.{k}": v for k, v in state.adapter.items()}
        tensors |= {f"exp_avg.{k}": v for k, v in state.exp_avg.items()}
        tensors |= {f"exp_avg_sq.{k}": v for k, v in state.exp_avg_sq.items()}
        tensors |= {f"grad.{k}": v for k, v in grads.items()}
        files[f"slot-{slot}.safetensors"] = save({k: v.contiguous() for k, v in tensors.items()})
        entries.append(SlotEntry(slot, model_id, state.config, state.step, slot in pending))
    files["slots.json"] = msgspec.json.encode(SnapshotIndex(work_seq, entries))
    directory = layout.write_dir_atomically(root(data_dir, group) / f"{work_seq:012d}", files)
    for old in sorted(p for p in root(data_dir, group).iterdir() if p.is_dir() and not p.name.startswith("."))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return directory


def latest(data_dir: Path, group: str) -> Path | None:
    base = root(data_dir, group)
    if not base.exists():
        return None
    done = sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / "slots.json").exists())
    return done[-1] if done else None


def restore(engine: TrainerEngine, directory: Path) -> tuple[int, dict[int, str]]:
    """Load a snapshot into the engine. Returns (work_seq it covers, slot -> model id)."""
    index = msgspec.json.decode((directory / "slots.json").read_bytes(), type=SnapshotIndex)
    slot_models: dict[int, str] = {}
    for entry in index.slots:
        tensors = load_file(str(directory / f"slot-{entry.slot}.safetensors"))

        def part(prefix: str, tensors: dict = tensors) -> dict:  # type: ignore[type-arg]
            return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}

        engine.init_slot(entry.slot, entry.lora)
        state = SlotState(entry.lora, entry.step, part("adapter."), part("exp_avg."), part("exp_avg_sq."))
        engine.set_slot_state(entry.slot, state, with_optimizer=True)
        engine.set_slot_grads(entry.slot, part("grad."), entry.pending)
        slot_models[entry.slot] = entry.model_id
    return index.work_seq, slot_models
