"""What each Tinker loss reads, and the validator the gateway and the trainer both run.

Pure Python (no torch, no numpy import) so the gateway can check a ``forward_backward``
request before it is queued.  The math lives in the trainer (``services/trainer/losses.py``); this module only declares each
loss's per-token inputs (required / optional) and its config keys with defaults.

Invariant: a request that passes ``validate_loss_request`` can be computed by the trainer
without further checks: every required input is present, every input's first dimension is the
datum's token count, no input or config key is one the loss neither reads nor is known to be sent
beside it, and every config value is a finite number.

Input rules (docs/semantics.md §4 lists them per loss):
- ``required_inputs`` must be present; ``optional_inputs`` may be.
- ``ignored_inputs`` are keys the vendor's examples or the cookbook send beside a loss that does
  not read them (``weights`` beside the policy losses): accepted, checked for shape, never read.
- ``resolved_inputs`` are filled in by the gateway from the sampling records a datum's
  provenance names (``stable_reinforce``: the recorded sampler logprobs); a client that sends
  one gets a 400, and the trainer requires them.
- Any other key is a 400 naming it.
- Every input is 1-D ``[N]``, except that ``cross_entropy`` takes top-K targets: ``target_tokens``
  ``[N, K]`` with ``weights`` of the same shape (or absent: every column weight 1).
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
    ignored_inputs: tuple[str, ...] = ()
    top_k: bool = False  # target_tokens (and weights) may be [N, K]
    resolved_inputs: tuple[str, ...] = ()
    """Required inputs the gateway resolves from provenance; never sent by a client."""

    @property
    def inputs(self) -> tuple[str, ...]:
        """The inputs the loss reads."""
        return self.required_inputs + self.resolved_inputs + self.optional_inputs

    @property
    def accepted(self) -> tuple[str, ...]:
        """Every key a request may carry: what the loss reads plus what it ignores."""
        return self.inputs + self.ignored_inputs


CUSTOM_LOSS_ERROR = (
    "loss_fn 'custom' is not supported: this server does not offer server-side custom losses "
    "(create_custom_loss); use TrainingClient.forward_backward_custom, which computes the loss on "
    "the client and works here"
)


_POLICY = ("target_tokens", "logprobs", "advantages")
# The policy losses weight tokens through their advantages; ``weights`` rides along in the
# vendor's examples and in hand-written RL loops that reuse supervised datums.
_POLICY_IGNORED = ("weights",)

LOSS_SPECS: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec("cross_entropy", ("target_tokens",), ("weights",), top_k=True),
        LossSpec("importance_sampling", _POLICY, ignored_inputs=_POLICY_IGNORED),
        LossSpec(
            "ppo",
            _POLICY,
            (),
            {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
            ignored_inputs=_POLICY_IGNORED,
        ),
        LossSpec(
            "cispo",
            _POLICY,
            (),
            {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
            ignored_inputs=_POLICY_IGNORED,
        ),
        LossSpec("dro", _POLICY, (), {"beta": 0.05}, ignored_inputs=_POLICY_IGNORED),
        # GSPO paper clip ranges (eps_low 3e-4, eps_high 4e-4) as absolute thresholds.
        LossSpec(
            "gspo",
            _POLICY,
            ("sequence_ratio_mask",),
            {"clip_low_threshold": 1.0 - 3e-4, "clip_high_threshold": 1.0 + 4e-4},
            ignored_inputs=_POLICY_IGNORED,
        ),
        # Tinkerd's own objective under the SDK's name (docs/semantics.md, "stable_reinforce").
        LossSpec(
            "stable_reinforce",
            ("target_tokens", "advantages"),
            (),
            {"kl_coeff": 0.0, "ratio_cap": 2.0, "sequence_ratio_bound": 2.0},
            ignored_inputs=("logprobs", "weights"),
            resolved_inputs=("sampler_logprobs", "sampled_sequence"),
        ),
    )
}

NEEDS_PROVENANCE = frozenset(name for name, spec in LOSS_SPECS.items() if spec.resolved_inputs)
"""Losses whose datums must carry provenance (the gateway resolves their ``resolved_inputs``)."""


def resolve_config(loss_fn: str, config: Mapping[str, float] | None) -> dict[str, float]:
    """The loss's config with defaults filled in (assumes a validated request)."""
    merged = dict(LOSS_SPECS[loss_fn].config_defaults)
    merged.update({k: float(v) for k, v in (config or {}).items()})
    return merged


def validate_config(loss_fn: str, config: Mapping[str, object] | None) -> str | None:
    """An error message naming the offending field, or None when the config is acceptable."""
    spec = LOSS_SPECS.get(loss_fn)
    if spec is None:
        return unsupported_loss_error(loss_fn)
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
    if merged.get("ratio_cap", 1.0) <= 0:
        return f"loss_fn_config.ratio_cap must be > 0, got {merged['ratio_cap']}"
    if merged.get("sequence_ratio_bound", 1.0) < 1:
        return f"loss_fn_config.sequence_ratio_bound must be >= 1, got {merged['sequence_ratio_bound']}"
    if merged.get("kl_coeff", 0.0) < 0:
        return f"loss_fn_config.kl_coeff must be >= 0, got {merged['kl_coeff']}"
    return None


def unsupported_loss_error(loss_fn: str) -> str:
    """The 400 message for a ``loss_fn`` this server does not compute."""
    if loss_fn == "custom":
        return CUSTOM_LOSS_ERROR
    return f"loss_fn {loss_fn!r} is not supported; supported: {', '.join(sorted(LOSS_SPECS))}"


Shape = int | tuple[int, ...]  # an int is a 1-D length


def _dims(shape: Shape) -> tuple[int, ...]:
    return (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)


def validate_datum_inputs(
    loss_fn: str, index: int, num_tokens: int, input_shapes: Mapping[str, Shape], resolved: bool = True
) -> str | None:
    """Check one datum's ``loss_fn_inputs`` (given as name -> shape, or -> length for 1-D).

    ``resolved``: the datum already carries the spec's ``resolved_inputs`` (the trainer's view);
    False checks what a client sent, where they must be absent."""
    spec = LOSS_SPECS[loss_fn]
    where = f"data[{index}].loss_fn_inputs"
    if num_tokens < 1:
        return f"data[{index}].model_input has no tokens"
    for name in spec.required_inputs + (spec.resolved_inputs if resolved else ()):
        if name not in input_shapes:
            return f"{where}.{name} is required by {loss_fn}"
    if not resolved:
        for name in spec.resolved_inputs:
            if name in input_shapes:
                return (
                    f"{where}.{name} is filled in by the server from the datum's provenance; do not send it"
                )
    target_dims = _dims(input_shapes["target_tokens"])
    for name, shape in input_shapes.items():
        if name not in spec.accepted:
            reads = spec.required_inputs + spec.optional_inputs if not resolved else spec.inputs
            return f"{where}.{name} is not read by {loss_fn} (it reads: {', '.join(reads)})"
        dims = _dims(shape)
        if len(dims) == 0 or dims[0] != num_tokens:
            got = dims[0] if dims else "a scalar"
            return f"{where}.{name} has length {got}, expected {num_tokens} (the datum's token count)"
        if len(dims) == 1:
            if name == "weights" and len(target_dims) == 2 and name in spec.inputs:
                return f"{where}.weights has shape {list(dims)}, expected {list(target_dims)} (target_tokens' shape)"
            continue
        if not spec.top_k or len(dims) != 2 or name not in ("target_tokens", "weights"):
            allowed = "[N] or [N, K]" if spec.top_k and name in ("target_tokens", "weights") else "[N]"
            return f"{where}.{name} has shape {list(dims)}, expected {allowed} for {loss_fn}"
        if dims[1] < 1:
            return f"{where}.{name} has shape {list(dims)}: K must be at least 1"
        if name == "weights" and dims != target_dims:
            return f"{where}.weights has shape {list(dims)}, expected {list(target_dims)} (target_tokens' shape)"
    return None


def validate_loss_request(
    loss_fn: str,
    config: Mapping[str, object] | None,
    token_counts: Sequence[int],
    input_lengths: Sequence[Mapping[str, Shape]],
    resolved: bool = True,
) -> str | None:
    """Validate a whole ``forward_backward`` request; returns the first error or None.

    Args:
        loss_fn: The loss name.
        config: ``loss_fn_config`` (may be None).
        token_counts: Each datum's model-input token count.
        input_lengths: Each datum's ``loss_fn_inputs`` as name -> shape (an int: a 1-D length).
        resolved: Whether the datums carry the loss's ``resolved_inputs`` already (the trainer);
            False for what a client sent (the gateway, before it resolves provenance).
    """
    error = validate_config(loss_fn, config)
    if error is not None:
        return error
    if len(token_counts) != len(input_lengths):
        return "token_counts and input_lengths differ in length"
    for i, (count, lengths) in enumerate(zip(token_counts, input_lengths, strict=True)):
        error = validate_datum_inputs(loss_fn, i, count, lengths, resolved)
        if error is not None:
            return error
    return None
