"""Commands on the per-model request subjects (`tinker.req.<model>`), written only by the gateway.

A model's subject is its ordered command log: the planner executes it strictly in `seq_id` order.
Every seq_id the gateway accepts appears exactly once, even when its content was refused
(`Rejected`), so a spent seq_id never leaves a gap.
"""

from __future__ import annotations

import msgspec

from libs.contracts.common import AdamParams, BusDatum, Envelope, LoraConfig


class CheckpointRef(msgspec.Struct, frozen=True, kw_only=True):
    """A training checkpoint to restore from, already resolved and authorised by the gateway."""

    tinker_path: str
    directory: str
    with_optimizer: bool


class CreateModel(Envelope, tag="create_model", kw_only=True, frozen=True):
    """seq 0 of a model: allocate an adapter slot, initialise it (or restore it from a checkpoint)."""

    session_id: str
    base_model: str
    lora: LoraConfig
    optimizer: str = "adamw"
    user_metadata: dict[str, str] | None = None
    restore: CheckpointRef | None = None


class ForwardBackward(Envelope, tag="forward_backward", kw_only=True, frozen=True):
    loss_fn: str
    loss_config: dict[str, float | str] = {}
    forward_only: bool = False
    data: list[BusDatum] = []


class OptimStep(Envelope, tag="optim_step", kw_only=True, frozen=True):
    adam: AdamParams


class SaveWeights(Envelope, tag="save_weights", kw_only=True, frozen=True):
    """save_state: adapter + optimizer state as an immutable checkpoint version."""

    name: str
    ttl_s: int | None = None
    user_metadata: dict[str, str] | None = None


class SaveForSampler(Envelope, tag="save_weights_for_sampler", kw_only=True, frozen=True):
    """A PEFT export for sampling: named (`name`) or ephemeral (`sampling_session_id`).

    `external`: the same PEFT files, saved as `tinker://RUN/external_weights/NAME` for download
    (save_weights_external) rather than for sampling. `age_recipients`: an encrypted external
    export, every file encrypted to these age recipients (`libs/checkpoints/age.py`).
    """

    name: str | None = None
    sampling_session_id: str | None = None
    ttl_s: int | None = None
    external: bool = False
    age_recipients: list[str] | None = None


class LoadWeights(Envelope, tag="load_weights", kw_only=True, frozen=True):
    """Legacy-mode load_state into an existing model."""

    restore: CheckpointRef


class UnloadModel(Envelope, tag="unload_model", kw_only=True, frozen=True):
    reason: str = ""


class Rejected(Envelope, tag="rejected", kw_only=True, frozen=True):
    """A seq_id whose content the gateway refused: it is consumed, in order, as a terminal failure."""

    kind: str
    error: str
    category: str = "user"


ModelCommand = (
    CreateModel
    | ForwardBackward
    | OptimStep
    | SaveWeights
    | SaveForSampler
    | LoadWeights
    | UnloadModel
    | Rejected
)

WINDOW_KINDS = frozenset({"forward_backward"})
"""Commands that may be split, packed and interleaved inside a window; everything else is a barrier."""
