"""Publication commands (`tinker.publish.<model>`): trainer -> publisher.

The trainer writes a complete staging directory (atomically, fsynced) and only then hands it
over; the publisher materializes the immutable version, registers it in the catalogue, and
answers the request's future. A command with an `error` says the trainer could not write the
files: the publisher answers the future with that error and publishes nothing.
"""

from __future__ import annotations

from libs.contracts.common import Envelope, LoraConfig


class PublishCommand(Envelope, tag="publish", kw_only=True, frozen=True):
    kind: str  # "training" (save_state) | "sampler" (save_weights_for_sampler)
    staging_dir: str
    base_model: str
    lora: LoraConfig
    step: int = 0
    tinker_path: str | None = None  # named saves
    sampling_session_id: str | None = None  # ephemeral sampler exports
    ttl_s: int | None = None
    user_metadata: dict[str, str] | None = None
    version: str = ""  # unique per save: the unit that produced it
    age_recipients: list[str] | None = None  # encrypt every file to these age recipients
    error: str | None = None  # the staging write failed (a server error, for the caller)
