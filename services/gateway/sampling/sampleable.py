"""Which base models can be sampled here: those with sampling engines (`Gateway.pool`). Every base
model served is trainable; one without engines is refused by each path that would sample it
(create_sampling_session, asample, save_weights_for_sampler's ephemeral sampler)."""

from __future__ import annotations

from services.gateway.context import Gateway
from services.gateway.http.errors import BadRequest


def check_sampleable(gateway: Gateway, base: str) -> None:
    """A 400 unless base model `base` has sampling engines here."""
    if gateway.pool(base) is None:
        sampleable = ", ".join(repr(m.name) for m in gateway.models if gateway.pool(m.name) is not None)
        raise BadRequest(
            f"base_model {base!r} is trained here but has no sampling engine in this deployment; "
            f"sampleable base models: {sampleable}"
        )
