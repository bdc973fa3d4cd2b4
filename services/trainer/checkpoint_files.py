"""Builds the files of a save: a training state (save_state) or a sampler export (PEFT).

The trainer writes them into a staging directory, atomically, and hands the directory to the
publisher with a ``PublishCommand``; the publisher makes it an immutable, named version.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from libs.checkpoints import layout
from libs.checkpoints import state_format as fmt
from libs.contracts.common import now_ns
from libs.contracts.publish import PublishCommand
from libs.contracts.work import ExportSlot, SaveSlot
from services.trainer.engine import TrainerEngine
from services.trainer.state_io import peft_files, training_state_files

log = logging.getLogger("tinkerd.trainer")


class StorageError(Exception):
    """The data directory refused a write (a full disk, ...): a server error with a clear text."""


def write_checkpoint(
    engine: TrainerEngine, base_model: str, data_dir: Path, unit_id: str, op: SaveSlot | ExportSlot
) -> PublishCommand:
    """Write the slot's files into a fresh staging directory; the command that publishes them."""
    started = time.perf_counter()
    state = engine.get_slot_state(op.slot, with_optimizer=isinstance(op, SaveSlot))  # one host copy
    copied = time.perf_counter()
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
        files = peft_files(tensors, adapter_config, export_meta)
        kind, sampler_id, metadata = "sampler", op.sampling_session_id, None
    encoded = time.perf_counter()
    staging = layout.staging_dir(data_dir, unit_id, op.request_id)
    try:
        layout.write_dir_atomically(staging, files)
        written = time.perf_counter()
        log.info(
            "%s of %s (%.0f MB): host copy %.0f ms, files built %.0f ms, written and fsynced %.0f ms",
            kind,
            op.model_id,
            sum(len(data) for data in files.values()) / 1e6,
            (copied - started) * 1e3,
            (encoded - copied) * 1e3,
            (written - encoded) * 1e3,
        )
    except OSError as exc:
        what = "save_state" if isinstance(op, SaveSlot) else "save_weights_for_sampler"
        kept = f"; {op.tinker_path} still holds its previous version" if op.tinker_path else ""
        raise StorageError(
            f"{what} failed: the server could not write the checkpoint files "
            f"({exc.strerror or exc}); nothing was saved{kept}. Free disk space on the server, "
            "then save again"
        ) from exc
    return PublishCommand(
        kind=kind,
        staging_dir=str(staging),
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
