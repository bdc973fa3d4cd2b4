"""Slot state <-> checkpoint directories (training state) and PEFT snapshot files."""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch
from safetensors.torch import load_file

from libs.checkpoints import state_format as fmt
from libs.checkpoints.layout import FileData
from libs.checkpoints.tensor_file import TensorFile
from services.trainer.slot_state import SlotState


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
