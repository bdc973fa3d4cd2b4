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
    stable_reinforce     Tinkerd's own objective (docs/semantics.md). Over the positions P that
                         sampled spans cover (``sampled_sequence`` >= 0: which sampled sequence of
                         the datum), with mu the *recorded* sampler logprobs (``sampler_logprobs``,
                         filled in by the gateway from the sampling record):
                         r = lp - mu, rho = exp(r)
                         m_s = 1 if mean_{p in s} r lies in [-log tau, log tau] else 0
                         sum_{p in P} m_s(p) * [-sg(min(rho, C))*A*lp + kl*(rho - 1 - r)]
                         C ratio_cap 2.0, tau sequence_ratio_bound 2.0, kl kl_coeff 0.0;
                         metrics (sums): tokens whose rho exceeds C in kept sequences, sequences
                         masked out, and the k3 estimate sum(rho - 1 - r) over P

Invariant: no normalisation of any kind (not by token count, datum count or weight sum), so
K chunked calls accumulate exactly the gradients of one call; normalising is the client's job.
Inputs are assumed validated by ``libs.contracts.loss_specs.validate_loss_request``, and hold
only what the loss reads (the engine drops a spec's ``ignored_inputs``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from libs.contracts.loss_specs import LOSS_SPECS

LossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor]
MetricsFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], dict[str, torch.Tensor]]


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


def _stable_reinforce_terms(
    lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(covered [N] bool, r [N], kept [N] bool: position in a sequence inside the bound,
    masked sequences []).

    The per-sequence sums have N entries, one per possible index (the engine checks that every
    ``sampled_sequence`` lies in [-1, N)), so no size is read back from the device."""
    seq = inputs["sampled_sequence"]  # [N]: index of the sampled sequence, -1 outside
    covered = seq >= 0
    r = torch.where(covered, lp - inputs["sampler_logprobs"], torch.zeros_like(lp))  # [N]
    index = seq.clamp(min=0).long()  # [N]
    count = lp.shape[0]
    weight = covered.to(lp.dtype)
    sums = torch.zeros(count, dtype=lp.dtype, device=lp.device).index_add_(0, index, r.detach() * weight)
    sizes = torch.zeros(count, dtype=lp.dtype, device=lp.device).index_add_(0, index, weight)
    present = sizes > 0  # [S]
    bound = math.log(cfg["sequence_ratio_bound"])
    mean = sums / sizes.clamp(min=1.0)
    inside = (mean >= -bound) & (mean <= bound)  # [S]
    kept = covered & inside[index]
    return covered, r, kept, (present & ~inside).sum()


def stable_reinforce(
    lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]
) -> torch.Tensor:
    _, r, kept, _ = _stable_reinforce_terms(lp, inputs, cfg)
    rho = torch.exp(r)  # [N]
    weight = rho.clamp(max=cfg["ratio_cap"]).detach()
    terms = -weight * inputs["advantages"] * lp + cfg["kl_coeff"] * (rho - 1.0 - r)  # [N]
    return torch.where(kept, terms, torch.zeros_like(terms)).sum()


def stable_reinforce_metrics(
    lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]
) -> dict[str, torch.Tensor]:
    covered, r, kept, masked = _stable_reinforce_terms(lp.detach(), inputs, cfg)
    rho = torch.exp(r)
    kl = torch.where(covered, rho - 1.0 - r, torch.zeros_like(r)).sum()
    return {
        "stable_reinforce/capped_tokens:sum": (kept & (rho > cfg["ratio_cap"])).sum(),
        "stable_reinforce/masked_sequences:sum": masked,
        "stable_reinforce/kl_sampler:sum": kl,
    }


LOSS_FNS: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
    "stable_reinforce": stable_reinforce,
}
LOSS_METRICS: dict[str, MetricsFn] = {"stable_reinforce": stable_reinforce_metrics}
"""Per-datum metrics beside the loss, each named ``name:sum`` (so datums and chunks add up), as
0-dim tensors: the engine reads every datum's in one copy once the backward is queued."""
assert set(LOSS_FNS) == set(LOSS_SPECS), "every declared loss needs an implementation"
