"""A slot's complete training state out of the engine (``capture``) and into a slot (``restore``).

"Complete" is what resuming exactly needs: the ``SlotState`` with its gradients and whether they
are pending. On CPU fp32, training after ``restore(capture(...))`` is bit-identical to training
that never left its slot.
"""

from __future__ import annotations

import dataclasses

from services.trainer.engine import TrainerEngine
from services.trainer.slot_state import SlotState


def capture(engine: TrainerEngine, slot: int, for_snapshot: bool = False) -> SlotState:
    """The slot's state with its gradients (CPU tensors, copies). ``for_snapshot``: the copies
    are in the engine's ``snapshot_buffers``, valid until the next snapshot's capture of the slot."""
    state = engine.get_slot_state(slot, for_snapshot=for_snapshot)
    grads = engine.get_slot_grads(slot, for_snapshot=for_snapshot)
    return dataclasses.replace(state, grads=grads, pending=engine.has_pending_grads(slot))


def restore(engine: TrainerEngine, slot: int, state: SlotState) -> None:
    """Put a captured state into ``slot``, replacing whatever it held (no fresh init needed first)."""
    engine.set_slot_state(slot, state, with_optimizer=True)
    engine.set_slot_grads(slot, state.grads, state.pending)
