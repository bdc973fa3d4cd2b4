"""The files of a save (save_state: a training state; save_weights_for_sampler: a PEFT export),
and reading a training state back (load_state, create from a state).

A save has two halves, so that no unit waits for a file write:

- ``prepare`` runs on the unit path, between two units: one host copy of the slot (a
  device-to-host copy on a GPU), the files' contents built over that copy, and the
  ``PublishCommand`` that will hand them to the publisher. Later units may change the slot at
  once: the copy is the save's own.
- ``write`` runs on a background writer (``services/trainer/saves.py``): it writes the staging
  directory atomically and fsyncs it, and returns the command to publish, or, when the data
  directory refused the write, the same command carrying the error for the publisher to answer.

An ephemeral sampler export with ``handover`` copies the slot into a ``Handover`` instead
(services/trainer/handover.py: device memory on CUDA, no host copy on the unit path); its files
are built from that copy by ``write``.

The publisher makes the staged directory an immutable, named version (services/publisher/).
The file formats are libs/checkpoints/state_format.py's.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from libs.checkpoints import layout
from libs.checkpoints import state_format as fmt
from libs.checkpoints.layout import FileData
from libs.checkpoints.tensor_file import TensorFile
from libs.contracts.common import now_ns
from libs.contracts.publish import PublishCommand
from libs.contracts.work import ExportSlot, SaveSlot
from services.trainer import slot_state
from services.trainer.engine import TrainerEngine
from services.trainer.handover import Handover
from services.trainer.slot_state import SlotState

log = logging.getLogger("tinkerd.trainer")


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class PendingSave:
    """A save whose slot is copied: the files to write, where, and the command that publishes them
    (with a ``handover``, the files are built from it when they are written)."""

    files: dict[str, FileData]
    staging: Path
    command: PublishCommand
    copy_ms: float  # the unit path's stall for this save
    handover: Handover | None = None
    export_meta: fmt.SamplerExportMeta | None = None  # a handover's export: its files' metadata
    release: Callable[[], None] = _nothing  # once written: gives the copy's pinned buffer back

    def contents(self) -> dict[str, FileData]:
        if self.handover is None:
            return self.files
        assert self.export_meta is not None
        return peft_files(self.handover.host_tensors(), self.handover.ref.config, self.export_meta)

    @property
    def model_id(self) -> str:
        return self.command.model_id


def prepare(
    engine: TrainerEngine,
    base_model: str,
    data_dir: Path,
    unit_id: str,
    op: SaveSlot | ExportSlot,
    handover: bool = False,
) -> PendingSave:
    """Copy the slot's state to the host and build the save's files over the copy (no write);
    with ``handover``, an ephemeral export is copied into a ``Handover`` instead."""
    started = time.perf_counter()
    shared: Handover | None = None
    export_meta: fmt.SamplerExportMeta | None = None
    files: dict[str, FileData] = {}
    handing_over = handover and isinstance(op, ExportSlot) and op.sampling_session_id is not None
    release: Callable[[], None] = _nothing
    pinned = engine.save_buffers
    # views of the slot on its device: copied into the handover, or into a pinned buffer on CUDA;
    # else (CPU) one host copy
    state = engine.get_slot_state(
        op.slot, with_optimizer=isinstance(op, SaveSlot), on_device=handing_over or pinned is not None
    )
    if pinned is not None and not handing_over:
        state, buffer = slot_state.to_pinned(state, pinned)
        release = functools.partial(pinned.give, buffer)
    if isinstance(op, SaveSlot):
        meta = fmt.TrainingStateMeta(
            base_model=base_model, model_id=op.model_id, tenant=op.tenant, lora=state.config, step=state.step
        )
        files = training_state_files(state, meta)
        kind, sampler_id, metadata = "training", None, op.user_metadata
    else:
        tensors, adapter_config = engine.export_peft(op.slot, state)
        adapter_config["base_model_name_or_path"] = base_model
        export_meta = fmt.SamplerExportMeta(
            base_model=base_model, model_id=op.model_id, tenant=op.tenant, lora=state.config, step=state.step
        )
        if handing_over:
            shared = _handover(op.request_id, tensors, adapter_config)  # the save's own copy
            if shared is None:  # no room for it: the files alone, from a host copy
                host = engine.get_slot_state(op.slot, with_optimizer=False)
                tensors, adapter_config = engine.export_peft(op.slot, host)
                adapter_config["base_model_name_or_path"] = base_model
        if shared is None:
            files = peft_files(tensors, adapter_config, export_meta)
        kind, sampler_id, metadata = "sampler", op.sampling_session_id, None
    command = PublishCommand(
        kind=kind,
        staging_dir=str(layout.staging_dir(data_dir, unit_id, op.request_id)),
        base_model=base_model,
        lora=state.config,
        step=state.step,
        tinker_path=op.tinker_path,
        sampling_session_id=sampler_id,
        ttl_s=op.ttl_s,
        user_metadata=metadata,
        version=unit_id,
        age_recipients=op.age_recipients if isinstance(op, ExportSlot) else None,
        model_id=op.model_id,
        request_id=op.request_id,
        tenant=op.tenant,
        at_ns=now_ns(),
    )
    copy_ms = (time.perf_counter() - started) * 1e3
    return PendingSave(files, Path(command.staging_dir), command, copy_ms, shared, export_meta, release)


def _handover(request_id: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Handover | None:
    """The export's handover, or None when the memory for it cannot be had (a full /dev/shm, no
    device memory left): the save is then answered once its files are written, as a named one."""
    try:
        return Handover(request_id, tensors, config)
    except (OSError, SafetensorError, torch.OutOfMemoryError) as exc:
        log.warning("%s: no handover (%s); answered once its files are written", request_id, exc)
        return None


def write(save: PendingSave) -> PublishCommand:
    """Write and fsync the staging directory (any thread); the command to publish next. A write
    the data directory refuses leaves nothing behind and yields the command with its ``error``."""
    started = time.perf_counter()
    command = save.command
    files = save.contents()
    try:
        layout.write_dir_atomically(save.staging, files)
    except OSError as exc:
        log.warning("%s of %s: the staging write failed (%s)", command.kind, command.model_id, exc)
        return msgspec.structs.replace(command, error=storage_error(command, exc), at_ns=now_ns())
    log.info(
        "%s of %s (%.0f MB): host copy %.0f ms on the unit path, written and fsynced %.0f ms in the background",
        command.kind,
        command.model_id,
        sum(len(data) for data in files.values()) / 1e6,
        save.copy_ms,
        (time.perf_counter() - started) * 1e3,
    )
    return msgspec.structs.replace(command, at_ns=now_ns())


def storage_error(command: PublishCommand, exc: OSError) -> str:
    """The caller's text for a save whose files the data directory refused (a full disk, ...)."""
    what = "save_state" if command.kind == "training" else "save_weights_for_sampler"
    kept = f"; {command.tinker_path} still holds its previous version" if command.tinker_path else ""
    return (
        f"{what} failed: the server could not write the checkpoint files ({exc.strerror or exc}); "
        f"nothing was saved{kept}. Free disk space on the server, then save again"
    )


def training_state_files(state: SlotState, meta: fmt.TrainingStateMeta) -> dict[str, FileData]:
    optimizer: dict[str, torch.Tensor] = {}
    for name, tensor in state.exp_avg.items():
        optimizer[f"exp_avg.{name}"] = tensor
    for name, tensor in state.exp_avg_sq.items():
        optimizer[f"exp_avg_sq.{name}"] = tensor
    return {
        fmt.ADAPTER_FILE: TensorFile(state.adapter),
        fmt.OPTIMIZER_FILE: TensorFile(optimizer),
        fmt.STATE_FILE: msgspec.json.encode(meta),
    }


def read_training_state(directory: Path) -> tuple[SlotState, fmt.TrainingStateMeta]:
    """Load a save_state checkpoint. Raises ValueError naming what is wrong with it."""
    meta_path = directory / fmt.STATE_FILE
    if not meta_path.exists():
        if (directory / fmt.EXPORT_META).exists() or (directory / "adapter_config.json").exists():
            raise ValueError(
                "this is a sampler export (weights only); restore from a save_state checkpoint"
            )
        raise ValueError(f"{directory.name} is not a training checkpoint (no {fmt.STATE_FILE})")
    meta = fmt.decode_training_meta(meta_path.read_bytes())
    if meta.kind != "training":
        raise ValueError(f"checkpoint kind is {meta.kind!r}, expected a training state")
    reason = fmt.unreadable_reason(meta)
    if reason is not None:
        raise ValueError(reason)
    adapter = load_file(str(directory / fmt.ADAPTER_FILE))
    moments = load_file(str(directory / fmt.OPTIMIZER_FILE))
    exp_avg = {k.removeprefix("exp_avg."): v for k, v in moments.items() if k.startswith("exp_avg.")}
    exp_avg_sq = {k.removeprefix("exp_avg_sq."): v for k, v in moments.items() if k.startswith("exp_avg_sq.")}
    return SlotState(meta.lora, meta.step, adapter, exp_avg, exp_avg_sq), meta


def peft_files(
    tensors: dict[str, torch.Tensor], adapter_config: dict[str, object], meta: fmt.SamplerExportMeta
) -> dict[str, FileData]:
    return {
        "adapter_model.safetensors": TensorFile(tensors),
        "adapter_config.json": msgspec.json.format(msgspec.json.encode(adapter_config), indent=2),
        fmt.EXPORT_META: msgspec.json.encode(meta),
    }
