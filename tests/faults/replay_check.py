"""`python -m tests.faults.replay_check DATA NATS_URL`: the recorded plan, executed once in a fresh trainer.

Prints one JSON line {model_id: {tensor: sha256, "step": n}} with each model's state after its last
unit — what an uninterrupted trainer would hold. The fault tests compare it with the checkpoints
written by the trainer that was killed and recovered.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from pathlib import Path

from nats.aio.msg import Msg

from infra.bus import Bus, last_seq, replay
from libs.contracts import codec
from libs.contracts import subjects as s
from libs.contracts.work import Unit
from libs.models.registry import resolve_base_model
from services.trainer.config import TrainerConfig
from services.trainer.engine import EngineConfig, TrainerEngine
from services.trainer.service import TrainerService


async def main(data_dir: Path, nats_url: str) -> None:
    bus = await Bus.connect(nats_url, "replay-check")
    units: list[Unit] = []

    seen: set[str] = set()

    def on_unit(msg: Msg) -> None:
        unit = codec.unit_decoder.decode(msg.data)
        if unit.unit_id not in seen:  # a redelivered copy is not part of the plan
            seen.add(unit.unit_id)
            units.append(unit)

    await replay(bus, s.STREAM_WORK, s.WORK_ALL, await last_seq(bus, s.STREAM_WORK), on_unit)
    await bus.close()
    model = resolve_base_model("tiny-qwen3", data_dir)
    engine = TrainerEngine(EngineConfig(base_model_dir=str(model.path), num_slots=8))
    service = TrainerService(bus, TrainerConfig(data_dir=str(data_dir)), engine, model.name)
    for unit in units:
        service.execute(unit, True)
    out: dict[str, dict[str, str]] = {}
    for slot, model_id in service.slot_models.items():
        state = engine.get_slot_state(slot)
        digests = {"step": str(state.step)}
        for key, tensor in state.adapter.items():
            digests[f"adapter.safetensors:{key}"] = hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
        for key, tensor in state.exp_avg.items():
            digests[f"optimizer.safetensors:exp_avg.{key}"] = hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
        for key, tensor in state.exp_avg_sq.items():
            digests[f"optimizer.safetensors:exp_avg_sq.{key}"] = hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
        out[model_id] = digests
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))
