"""One ``SlotState`` as one file: paged-out states, a snapshot's slots and adopted states.

    <name>.safetensors   tensors  adapter.<name>, exp_avg.<name>, exp_avg_sq.<name>, grad.<name>
                                  (the full TP=1 layout of services/trainer/slot_state.py)
                         metadata "tinkerd": the JSON of ``FileMeta`` (model id, LoRA config,
                                  step, whether the gradients are pending)

The file is streamed from the tensors' own memory (``TensorFile``: no bytes object of the whole
file is built first) through the one atomic file writer, ``layout.write_file_atomically``, and
read with safetensors' ``safe_open``. Files written by earlier versions of the trainer have this
same format and load unchanged.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch
from safetensors import safe_open

from libs.checkpoints import layout
from libs.checkpoints.tensor_file import TensorFile
from libs.contracts.common import LoraConfig
from services.trainer.slot_state import SlotState

METADATA_KEY = "tinkerd"


class FileMeta(msgspec.Struct, frozen=True):
    """What the tensors of a state file do not say themselves."""

    model_id: str
    lora: LoraConfig
    step: int
    pending: bool  # gradients accumulated since the last optim_step


def _tables(state: SlotState) -> dict[str, dict[str, torch.Tensor]]:
    return {"adapter": state.adapter, "exp_avg": state.exp_avg, "exp_avg_sq": state.exp_avg_sq, "grad": state.grads}


def encode(state: SlotState, model_id: str) -> TensorFile:
    """The file's contents, written when the ``TensorFile`` is (the tensors are not copied)."""
    tensors = {f"{table}.{name}": t for table, values in _tables(state).items() for name, t in values.items()}
    meta = FileMeta(model_id, state.config, state.step, state.pending)
    return TensorFile(tensors, metadata={METADATA_KEY: msgspec.json.encode(meta).decode()})


def write(path: Path, state: SlotState, model_id: str, sync: bool = True) -> Path:
    """Write the file whole or not at all (fsynced with ``sync``: another group, or this one after
    a crash, reads it; a cache file that nothing needs after a crash passes ``sync=False``)."""
    return layout.write_file_atomically(path, encode(state, model_id), sync=sync)


def read(path: Path) -> tuple[str, SlotState]:
    """The model id and the state a file holds."""
    tables: dict[str, dict[str, torch.Tensor]] = {"adapter": {}, "exp_avg": {}, "exp_avg_sq": {}, "grad": {}}
    with safe_open(str(path), framework="pt") as f:
        meta = msgspec.json.decode(f.metadata()[METADATA_KEY], type=FileMeta)
        for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
            table, name = key.split(".", 1)
            tables[table][name] = f.get_tensor(key)
    state = SlotState(
        meta.lora, meta.step, tables["adapter"], tables["exp_avg"], tables["exp_avg_sq"], tables["grad"], meta.pending
    )
    return meta.model_id, state
