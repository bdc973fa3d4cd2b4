"""Rounding-error bounds for the suite's numerical comparisons.

A comparison of two numbers that should be equal in exact arithmetic needs a bound, and a bound
that was tuned on one CPU fails on the next (MKL picks other GEMM kernels, blockings and summation
orders per processor). Every bound here follows one error model instead of one machine.

**The model.** A value computed in fp32 by a chain of dot products and sums whose reduction lengths
add up to ``depth`` (the longest dependent chain: every layer's projections, attention, MLP, the
unembedding and the log-softmax) carries a rounding error of at most

    |computed - exact| <= gamma(depth) * magnitude,    gamma(n) = LAMBDA * sqrt(n) * u,

where ``u = 2**-24`` is fp32's unit roundoff and ``magnitude`` is the sum of the absolute values of
the terms that formed the value (for ``y = sum_i a_i b_i`` it is ``sum_i |a_i| |b_i|``), not the
value itself: terms that cancel leave their rounding behind. This is the probabilistic rounding
error bound of Higham and Mary ("A new approach to probabilistic rounding error analysis", SIAM J.
Sci. Comput. 2019): errors of independent roundings grow like ``sqrt(n)``, and the bound holds
with probability at least ``1 - 2 n exp(-LAMBDA**2 / 2)`` for every one of the values compared.
The worst-case bound ``n * u`` would also hold, but it is so loose (0.05 % for the tiny model)
that it hides real bugs.

References are computed in float64 (their own error is about 2**-29 times smaller than fp32's,
so a comparison measures the fp32 side alone). Where two fp32 computations of the same math are
compared (TP=2 against TP=1, a packed batch against the same datums alone), both sides carry the
error and the bound doubles. Bit-identity (same code, same inputs, same machine: resume, replay,
packed = alone through the same kernels) is checked with ``torch.equal``, never with a bound.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

U32 = 2.0**-24
"""fp32 unit roundoff (round to nearest)."""

U64 = 2.0**-53
"""float64 unit roundoff."""

LAMBDA = 8.0
"""Confidence constant of the probabilistic bound: with 8 the chance that a single value exceeds
its bound is below 1e-13 per compared value."""


def gamma(depth: int, u: float = U32) -> float:
    """Relative error bound of a computation whose reductions add up to ``depth`` terms."""
    return LAMBDA * math.sqrt(max(depth, 1)) * u


@dataclass(frozen=True)
class ChainShape:
    """The reduction lengths of one transformer forward (what ``forward_depth`` adds up)."""

    layers: int
    hidden: int
    q_width: int  # num_heads * head_dim: the reduction of the attention output projection
    head_dim: int
    ffn: int
    vocab: int

    @classmethod
    def of_hf_config(cls, config: Any) -> ChainShape:
        heads, head_dim = config.num_attention_heads, getattr(config, "head_dim", None)
        hidden = config.hidden_size
        head_dim = head_dim or hidden // heads
        return cls(
            layers=config.num_hidden_layers,
            hidden=hidden,
            q_width=heads * head_dim,
            head_dim=head_dim,
            ffn=config.intermediate_size,
            vocab=config.vocab_size,
        )

    def forward_depth(self, tokens: int) -> int:
        """Per layer: RMSNorm (hidden), q/k/v (hidden), scores (head_dim), the weighted sum over
        positions (tokens), o_proj (q_width), RMSNorm, gate/up (hidden), down (ffn); then the final
        norm, the unembedding (hidden) and the log-softmax (vocab)."""
        per_layer = 4 * self.hidden + self.head_dim + tokens + self.q_width + self.ffn
        return self.layers * per_layer + 2 * self.hidden + self.vocab

    def backward_depth(self, tokens: int) -> int:
        """A gradient goes forward and back through the same chain."""
        return 2 * self.forward_depth(tokens)


Values = torch.Tensor | np.ndarray | float | Sequence[float]


def assert_within(actual: Values, expected: Values, bound: Values, what: str = "") -> None:
    """``|actual - expected| <= bound`` elementwise (``bound`` is a tensor of the same shape or a
    scalar); the message names the worst element and how far over its bound it is."""
    a = torch.as_tensor(np.asarray(actual) if not isinstance(actual, torch.Tensor) else actual).double()
    e = torch.as_tensor(np.asarray(expected) if not isinstance(expected, torch.Tensor) else expected).double()
    b = torch.as_tensor(np.asarray(bound) if not isinstance(bound, torch.Tensor) else bound).double()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    diff = (a - e).abs()
    over = diff / b.clamp_min(torch.finfo(torch.float64).tiny)
    worst = int(over.argmax()) if over.numel() else 0
    _log_margin(what, float(over.flatten()[worst]) if over.numel() else 0.0)
    if over.numel() and float(over.flatten()[worst]) > 1.0:
        d = float(diff.flatten()[worst])
        lim = float(b.expand_as(diff).flatten()[worst])
        raise AssertionError(f"{what}: |diff| {d:.3g} > bound {lim:.3g} at flat index {worst}")


def _log_margin(what: str, used: float) -> None:
    """With ``TINKERD_NUMERICS_LOG`` set, append the fraction of its bound each comparison used
    (how the margins in docs/semantics.md are measured)."""
    path = os.environ.get("TINKERD_NUMERICS_LOG")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "what": what, "used": used}) + "\n")


def logit_magnitude(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``sum_j |x_j| |W_vj|`` for every position and row of ``y = x W^T``: the magnitude of the terms
    of each logit (or of any linear layer's output)."""
    return x.detach().abs().double() @ weight.detach().abs().double().t()


def logprob_magnitude(logit_mag: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
    """The magnitude behind ``log p(v) = z_v - logsumexp(z)``: the logit's own terms plus the largest
    logit's terms (logsumexp is a softmax-weighted average of logits, so its error is at most the
    largest logit error). ``[N]`` at ``targets``, else ``[N, V]`` for every entry."""
    full = logit_mag + logit_mag.max(dim=-1, keepdim=True).values
    return full if targets is None else full.gather(-1, targets[:, None])[:, 0]


def attention_bound(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, u: float = U32
) -> torch.Tensor:
    """Error bound of packed per-document causal attention ``[T, heads * d]`` computed at unit
    roundoff ``u`` from ``q [T, heads, d]``, ``k, v [T, groups, d]``.

    Each output ``o_t = sum_s p_ts v_s`` is a softmax-weighted average: its rounding is
    ``gamma(n) * sum_s p_ts |v_s|`` (n: the document's positions, the softmax's sum included), and a
    score error ``ds`` moves the weights by up to ``2 |ds|`` relative, where
    ``|ds_ts| <= gamma(d) * scale * sum_j |q_tj| |k_sj|``.
    """
    q64, k64, v64 = (x.detach().double() for x in (q, k, v))
    heads, groups, d = q64.shape[1], k64.shape[1], q64.shape[2]
    rep, scale = heads // groups, d**-0.5
    out = torch.zeros(q64.shape[0], heads, d, dtype=torch.float64)
    bounds = cu_seqlens.tolist()
    for start, end in itertools.pairwise(bounds):
        n = end - start
        qd = q64[start:end].transpose(0, 1)  # [heads, n, d]
        kd = k64[start:end].transpose(0, 1).repeat_interleave(rep, dim=0)
        vd = v64[start:end].transpose(0, 1).repeat_interleave(rep, dim=0)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        p = torch.softmax((scale * qd @ kd.transpose(1, 2)).masked_fill(~causal, -math.inf), dim=-1)
        score_mag = scale * qd.abs() @ kd.abs().transpose(1, 2)  # [heads, n, n]
        ds = gamma(d, u) * score_mag.masked_fill(~causal, 0).amax(dim=-1, keepdim=True)  # [heads, n, 1]
        weighted = p @ vd.abs()  # [heads, n, d]
        out[start:end] = ((gamma(n + 1, u) + 2 * ds) * weighted).transpose(0, 1)
    return out.reshape(q64.shape[0], heads * d)


def loss_bound(
    terms: Callable[[torch.Tensor], torch.Tensor], logprobs: torch.Tensor, logprob_bound: torch.Tensor
) -> float:
    """Error bound of a loss ``sum(terms(logprobs))`` computed in fp32 from logprobs that are each
    within ``logprob_bound``: the logprobs' errors carried through the loss's sensitivity to each of
    them (first order), plus the rounding of the sum of its terms. ``terms`` must give the loss's
    per-token values as a differentiable function of the logprobs (no stop-gradients)."""
    lp = logprobs.detach().double().requires_grad_()
    values = terms(lp)
    (sensitivity,) = torch.autograd.grad(values.sum(), lp)
    propagated = float((sensitivity.abs() * logprob_bound.double()).sum())
    return propagated + gamma(values.numel()) * float(values.detach().abs().sum())
