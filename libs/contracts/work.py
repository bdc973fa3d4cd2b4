"""Units the planner emits for trainers (`tinker.work.<group>`).

A `WorkUnit` packs datums of many models that share (kind, loss_fn, canonical loss config) under a
token budget; a `BarrierUnit` carries slot operations (optimizer steps of many models merged into
one call, or one save/load/create/release, with the page-out and page-in that give it a slot).
Units are executed in the order they were emitted.
"""

from __future__ import annotations

import msgspec

from libs.contracts.common import AdamParams, BusDatum, Envelope, LoraConfig
from libs.contracts.requests import CheckpointRef


class UnitItem(msgspec.Struct, frozen=True, array_like=True):
    """One datum of one request, placed in an adapter slot."""

    model_id: str
    request_id: str
    index: int  # position of the datum inside its request
    slot: int
    datum: BusDatum


class WorkUnit(Envelope, tag="work", kw_only=True, frozen=True):
    unit_id: str
    group: str = ""
    """The trainer group that runs it (its work subject); every item's model is placed there. ""
    only in units written before groups existed: the planner reads them as its `trainer_group`'s."""
    forward_only: bool
    loss_fn: str
    loss_config: dict[str, float | str] = {}
    items: list[UnitItem] = []

    @property
    def num_tokens(self) -> int:
        return sum(item.datum.num_tokens for item in self.items)


class InitSlot(msgspec.Struct, tag="init_slot", kw_only=True, frozen=True):
    model_id: str
    request_id: str
    slot: int
    lora: LoraConfig
    restore: CheckpointRef | None = None


class StepSlot(msgspec.Struct, tag="step_slot", kw_only=True, frozen=True):
    model_id: str
    request_id: str
    slot: int
    adam: AdamParams


class DiscardSlot(msgspec.Struct, tag="discard_slot", kw_only=True, frozen=True):
    """The window was poisoned: drop the slot's accumulated gradients, apply nothing."""

    model_id: str
    request_id: str
    slot: int
    reason: str


class SaveSlot(msgspec.Struct, tag="save_slot", kw_only=True, frozen=True):
    """Write the slot's training state (adapter + optimizer) for a checkpoint."""

    model_id: str
    request_id: str
    slot: int
    tinker_path: str
    tenant: str = ""
    ttl_s: int | None = None
    user_metadata: dict[str, str] | None = None


class ExportSlot(msgspec.Struct, tag="export_slot", kw_only=True, frozen=True):
    """Export the slot's adapter in PEFT format for sampling."""

    model_id: str
    request_id: str
    slot: int
    tinker_path: str | None = None
    sampling_session_id: str | None = None
    tenant: str = ""
    ttl_s: int | None = None
    age_recipients: list[str] | None = None  # an encrypted external export (the publisher encrypts)


class LoadSlot(msgspec.Struct, tag="load_slot", kw_only=True, frozen=True):
    model_id: str
    request_id: str
    slot: int
    restore: CheckpointRef


class ReleaseSlot(msgspec.Struct, tag="release_slot", kw_only=True, frozen=True):
    model_id: str
    request_id: str
    slot: int


class PageOut(msgspec.Struct, tag="page_out", kw_only=True, frozen=True):
    """Move the slot's complete training state (adapter, optimizer moments and step, accumulated
    gradients) to the trainer's page store and free the slot. `request_id` is `ids.page_request_id`:
    residency ops answer no request. `export` (a path relative to the data directory, "" for
    none): also write the state there, durably, so another trainer group can page it in."""

    model_id: str
    request_id: str
    slot: int
    export: str = ""


class PageIn(msgspec.Struct, tag="page_in", kw_only=True, frozen=True):
    """Put a paged-out model's training state back into `slot`, exactly as it left. `source` (a
    path relative to the data directory, "" for none): read the state from that file (a page-out
    of another group exported it) instead of this group's page store."""

    model_id: str
    request_id: str
    slot: int
    source: str = ""


class AdoptSlot(msgspec.Struct, tag="adopt_slot", kw_only=True, frozen=True):
    """Take over a model of the lost trainer group `from_group`: rebuild its training state in
    `slot` from that group's durable data alone (its newest complete snapshot, then a
    re-execution of the model's part of every later unit of that group that has an outcome and
    is not in `abandoned`). `abandoned` lists every unit of `from_group` the planner had emitted
    without folding its outcome when it decided the takeover: none of them counts (their work
    is planned again); the lost group skips them when it comes back. `fresh`: the model's create
    had not completed, so it may have no state there (the slot then stays empty for the create
    that follows in the same unit). `request_id` is `ids.page_request_id`."""

    model_id: str
    request_id: str
    slot: int
    from_group: str
    abandoned: list[str] = []
    fresh: bool = False


class DropPaged(msgspec.Struct, tag="drop_paged", kw_only=True, frozen=True):
    """Forget a paged-out model's state (its unload, while it holds no slot)."""

    model_id: str
    request_id: str


class FailRequest(msgspec.Struct, tag="fail_request", kw_only=True, frozen=True):
    """Nothing to execute: the planner decided the request fails (e.g. a poisoned window's sealed gap)."""

    model_id: str
    request_id: str
    error: str
    category: str = "user"


SlotOp = (
    InitSlot
    | StepSlot
    | DiscardSlot
    | SaveSlot
    | ExportSlot
    | LoadSlot
    | ReleaseSlot
    | PageOut
    | PageIn
    | AdoptSlot
    | DropPaged
    | FailRequest
)


class BarrierUnit(Envelope, tag="barrier", kw_only=True, frozen=True):
    unit_id: str
    group: str = ""
    """The trainer group that runs it; a create or page-in here places its model on that group
    ("" as in `WorkUnit`)."""
    ops: list[SlotOp] = []


Unit = WorkUnit | BarrierUnit
