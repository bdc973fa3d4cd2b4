"""What each Tinker loss reads, and the validator the gateway and the trainer both run.

Pure Python (no torch, no numpy import) so the gateway can check a ``forward_backward``
request before it is queued.  The math lives in the trainer (``services/trainer/losses.py``); this module only declares each
loss's per-token inputs (required / optional) and its config keys with defaults.

Invariant: a request that passes ``validate_loss_request`` can be computed by the trainer
without further checks: every required input is present, every input has exactly the datum's
token count, no input or config key is one the loss does not read, and every config value is a
finite number.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LossSpec:
    """The inputs and config one loss function reads."""

    name: str
    required_inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    config_defaults: Mapping[str, float] = field(default_factory=dict)

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.required_inputs + self.optional_inputs


_POLICY = ("target_tokens", "logprobs", "advantages")

LOSS_SPECS: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec("cross_entropy", ("target_tokens",), ("weights",)),
        LossSpec("importance_sampling", _POLICY),
        LossSpec("ppo", _POLICY, (), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
        LossSpec("cispo", _POLICY, (), {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
        LossSpec("dro", _POLICY, (), {"beta": 0.05}),
        # GSPO paper clip ranges (eps_low 3e-4, eps_high 4e-4) as absolute thresholds.
        LossSpec(
            "gspo",
            _POLICY,
            ("sequence_ratio_mask",),
            {"clip_low_threshold": 1.0 - 3e-4, "clip_high_threshold": 1.0 + 4e-4},
        ),
    )
}


def resolve_config(loss_fn: str, config: Mapping[str, float] | None) -> dict[str, float]:
    """The loss's config with defaults filled in (assumes a validated request)."""
    merged = dict(LOSS_SPECS[loss_fn].config_defaults)
    merged.update({k: float(v) for k, v in (config or {}).items()})
    return merged


def validate_config(loss_fn: str, config: Mapping[str, object] | None) -> str | None:
    """An error message naming the offending field, or None when the config is acceptable."""
    spec = LOSS_SPECS.get(loss_fn)
    if spec is None:
        return f"loss_fn {loss_fn!r} is not supported; supported: {', '.join(sorted(LOSS_SPECS))}"
    for key, value in (config or {}).items():
        if key not in spec.config_defaults:
            known = ", ".join(sorted(spec.config_defaults)) or "none"
            return f"loss_fn_config.{key} is not read by {loss_fn} (it reads: {known})"
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return f"loss_fn_config.{key} must be a finite number, got {value!r}"
    merged = resolve_config(loss_fn, config)  # type: ignore[arg-type]
    low, high = merged.get("clip_low_threshold"), merged.get("clip_high_threshold")
    if low is not None and high is not None and low > high:
        return f"loss_fn_config.clip_low_threshold ({low}) exceeds clip_high_threshold ({high})"
    return None


def validate_datum_inputs(
    loss_fn: str, index: int, num_tokens: int, input_lengths: Mapping[str, int]
) -> str | None:
    """Check one datum's ``loss_fn_inputs`` (given as name -> length) against the loss."""
    spec = LOSS_SPECS[loss_fn]
    where = f"data[{index}].loss_fn_inputs"
    if num_tokens < 1:
        return f"data[{index}].model_input has no tokens"
    for name in spec.required_inputs:
        if name not in input_lengths:
            return f"{where}.{name} is required by {loss_fn}"
    for name, length in input_lengths.items():
        if name not in spec.inputs:
            return f"{where}.{name} is not read by {loss_fn} (it reads: {', '.join(spec.inputs)})"
        if length != num_tokens:
            return f"{where}.{name} has length {length}, expected {num_tokens} (the datum's token count)"
    return None


def validate_loss_request(
    loss_fn: str,
    config: Mapping[str, object] | None,
    token_counts: Sequence[int],
    input_lengths: Sequence[Mapping[str, int]],
) -> str | None:
    """Validate a whole ``forward_backward`` request; returns the first error or None.

    Args:
        loss_fn: The loss name.
        config: ``loss_fn_config`` (may be None).
        token_counts: Each datum's model-input token count.
        input_lengths: Each datum's ``loss_fn_inputs`` as name -> number of elements.
    """
    error = validate_config(loss_fn, config)
    if error is not None:
        return error
    if len(token_counts) != len(input_lengths):
        return "token_counts and input_lengths differ in length"
    for i, (count, lengths) in enumerate(zip(token_counts, input_lengths, strict=True)):
        error = validate_datum_inputs(loss_fn, i, count, lengths)
        if error is not None:
            return error
    return None
