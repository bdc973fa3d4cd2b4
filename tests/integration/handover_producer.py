"""A process that hands a PEFT adapter over as Tinkerd's trainer does (services/trainer/handover.py;
from CPU memory or, given `cuda`, from device memory):
it prints the `AdapterHandover` as JSON, keeps the tensors until a line arrives on stdin, then
lets them go (as its `Shelf` releases them) and exits once a second line arrives (or at once
when stdin closes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import load_file

from libs.contracts import codec
from services.trainer.handover import Handover


def main(directory: str, device: str) -> None:
    root = Path(directory)
    tensors = load_file(str(root / "adapter_model.safetensors"), device=device)
    config = json.loads((root / "adapter_config.json").read_text())
    handover = Handover("request-1", tensors, config)
    sys.stdout.write(codec.to_json(handover.ref).decode() + "\n")
    sys.stdout.flush()
    sys.stdin.readline()
    handover.release()  # as the trainer's Shelf does: an engine that opens it now finds nothing
    sys.stdout.write("released\n")
    sys.stdout.flush()
    sys.stdin.readline()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu")
