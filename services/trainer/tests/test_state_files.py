"""One ``SlotState`` file (services/trainer/state/files.py): written streamed, it is the same
safetensors file the trainer has always written for paged states, snapshot slots and adopted
states, so files already on disk load unchanged."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from services.trainer.engine import AdamParams, LoraConfig, SlotState, TrainerEngine
from services.trainer.state import files, slots
from services.trainer.tests.helpers import ce_datum


def _trained(engine: TrainerEngine) -> None:
    engine.init_slot(0, LoraConfig(rank=4, seed=5))
    rng = np.random.default_rng(3)
    engine.forward_backward([ce_datum(rng, 0, 6)], "cross_entropy")
    engine.optim_step({0: AdamParams(learning_rate=1e-2)})
    engine.forward_backward([ce_datum(rng, 0, 5)], "cross_entropy")  # pending


def _flat(state: SlotState) -> dict[str, torch.Tensor]:
    tables = {"adapter": state.adapter, "exp_avg": state.exp_avg, "exp_avg_sq": state.exp_avg_sq, "grad": state.grads}
    return {f"{t}.{k}": v for t, table in tables.items() for k, v in table.items()}


def test_a_state_file_round_trips_and_is_the_safetensors_file_earlier_trainers_wrote(
    engine: TrainerEngine, tmp_path: Path
) -> None:
    """The streamed file holds every tensor of the captured state (adapter, moments, gradients)
    under its prefixed name and the meta under ``tinkerd``; reading it gives the state back; and a
    file built the way earlier trainers built it (``safetensors.torch.save`` of the same tensors
    and metadata) reads back to the same state."""
    _trained(engine)
    state = slots.capture(engine, 0)
    assert state.pending and state.step == 1 and state.grads
    path = files.write(tmp_path / "m.safetensors", state, "tenant:m")
    on_disk = load_file(str(path))
    assert set(on_disk) == set(_flat(state))
    assert all(torch.equal(on_disk[k], v) for k, v in _flat(state).items())
    with safe_open(str(path), framework="pt") as f:
        meta = msgspec.json.decode(f.metadata()["tinkerd"])
    assert meta == {"model_id": "tenant:m", "lora": msgspec.to_builtins(state.config), "step": 1, "pending": True}

    old = tmp_path / "old.safetensors"
    old.write_bytes(save({k: v.contiguous() for k, v in _flat(state).items()}, metadata={"tinkerd": msgspec.json.encode(meta).decode()}))
    for written in (path, old):
        model_id, back = files.read(written)
        assert model_id == "tenant:m"
        assert (back.config, back.step, back.pending) == (state.config, state.step, state.pending)
        assert set(_flat(back)) == set(_flat(state))
        assert all(torch.equal(_flat(back)[k], v) for k, v in _flat(state).items())
