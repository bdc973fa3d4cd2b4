"""A stack whose trainer's first checkpoint file stops half written until the test lets it go.

`libs/faults.py`'s `hold` action at `trainer.checkpoint_write@1` makes "while a save's files are
being written" a fact of the run rather than a race; the save tests and the handover tests use it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import tinker
from tinker import types

from tests.harness import Stack
from tests.sdk import tenant_datum

HOLD = "trainer.checkpoint_write@1:hold"  # the first file the trainer writes
WAIT_S = 120.0


def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Wait until ``condition`` holds (checked every 50 ms, for at most WAIT_S)."""
    done = threading.Event()
    for _ in range(int(WAIT_S / 0.05)):
        if condition():
            return
        done.wait(0.05)
    raise AssertionError(f"{what} never happened")


def held_stack(tmp_path: Path) -> Stack:
    env = {"TINKERD_FAULT_POINTS": HOLD, "TINKERD_FAULT_DIR": str(tmp_path / "faults")}
    return Stack(tmp_path / "stack", env_overrides=env).start()


def train(trainer: tinker.TrainingClient, tenant: int, step: int) -> None:
    trainer.forward_backward([tenant_datum(tenant, step, 0)], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()


