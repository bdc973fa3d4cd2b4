"""The Tinker SDK's built-in losses, as plain per-datum sums over tokens.

Notation (per datum, tensors of length N): ``lp`` current log-probability of ``target_tokens``,
``q`` the ``logprobs`` input (sampler log-probabilities), ``A`` the ``advantages``, ``w`` the
``weights``, ``r = exp(lp - q)``, ``sg`` stop-gradient.

    cross_entropy        -sum w*lp                       (w defaults to ones; any finite sign)
                         top-K: lp, w are [N, K] (lp of each of the K target columns), so the
                         loss is the sum of the K one-column losses
    importance_sampling  -sum r*A
    ppo                  -sum min(r*A, clip(r, lo, hi)*A)      lo 0.8, hi 1.2
    cispo                -sum sg(clip(r, lo, hi))*lp*A         lo 0.0, hi 4.0
    dro                  -sum [lp*A - 0.5*beta*(lp - q)^2]     beta 0.05
    gspo (GSPO-token)    m = sequence_ratio_mask (default: A != 0, which leaves out the prompt
                         positions, whose advantages the cookbook and the docs pad with 0)
                         M = max(sum m, 1)
                         log_s = sum m*(sg(lp) - q) / M        (0 when the mask is empty)
                         s_t = exp(log_s + lp_t - sg(lp_t))    (value s, gradient d lp_t)
                         -sum_t min(s_t*A_t, clip(s_t, lo, hi)*A_t)

Invariant: no normalisation of any kind (not by token count, datum count or weight sum), so
K chunked calls accumulate exactly the gradients of one call; normalising is the client's job.
Inputs are assumed validated by ``libs.contracts.loss_specs.validate_loss_request``, and hold
only what the loss reads (the engine drops a spec's ``ignored_inputs``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from libs.contracts.loss_specs import LOSS_SPECS

LossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor]


def _ratio(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(lp - inputs["logprobs"])  # [N]


def cross_entropy(
    lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]
) -> torch.Tensor:
    weights = inputs.get("weights")
    if weights is None:
        return -lp.sum()
    return -(weights * lp).sum()


def importance_sampling(
    lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]
) -> torch.Tensor:
    return -(_ratio(lp, inputs) * inputs["advantages"]).sum()


def ppo(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    adv = inputs["advantages"]  # [N]
    ratio = _ratio(lp, inputs)  # [N]
    clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])  # [N]
    return -torch.minimum(ratio * adv, clipped * adv).sum()


def cispo(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    weight = _ratio(lp, inputs).clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"]).detach()  # [N]
    return -(weight * lp * inputs["advantages"]).sum()


def dro(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    diff = lp - inputs["logprobs"]  # [N]
    return -(lp * inputs["advantages"] - 0.5 * cfg["beta"] * diff * diff).sum()


def gspo(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    mask = inputs.get("sequence_ratio_mask")
    if mask is None:  # prompt positions carry advantage 0: they never enter the ratio
        mask = inputs["advantages"]
    mask = (mask != 0).to(lp.dtype)  # [N]
    count = mask.sum().clamp(min=1.0)
    log_s = (mask * (lp.detach() - inputs["logprobs"])).sum() / count  # []
    ratio = torch.exp(log_s + lp - lp.detach())  # [N]
    adv = inputs["advantages"]  # [N]
    clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])  # [N]
    return -torch.minimum(ratio * adv, clipped * adv).sum()


LOSS_FNS: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
}
assert set(LOSS_FNS) == set(LOSS_SPECS), "every declared loss needs an implementation"
