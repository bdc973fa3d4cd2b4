"""Log-probabilities of K target columns from vocab-sharded logits (top-K cross-entropy).

The model's fused path returns ``-log p(target)`` for one target per position. Top-K targets
(``target_tokens`` of shape [N, K]) need K log-probabilities per position, so the engine takes
the logits instead and computes, per TP rank holding vocabulary rows [start, start + V/tp):

    m      = max over the full vocabulary (all-reduce MAX; no gradient needed: lse is exact)
    lse    = m + log(sum_ranks sum_v exp(x_v - m))          (all-reduce SUM, identity backward)
    lp_k   = sum_ranks [x_{t_k} if t_k in this shard else 0] - lse

Memory: one [T, V/tp] fp32 temporary (the exponentials), as the fused cross-entropy has, not
K of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from services.trainer.parallel import tp_rank, tp_size


def _all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group whose backward is the identity: every rank goes on to compute the
    same loss from the (replicated) sum, so each shard's gradient is the sum's gradient as is
    (an all-reducing backward would count it tp times). The identity at TP=1."""
    if tp_size() == 1:
        return value
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(value)


def target_logprobs(local_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log p(targets[t, k])`` for every position and column.

    Args:
        local_logits: [T, V/tp] this rank's vocabulary shard of the logits.
        targets: [T, K] int64 token ids over the full vocabulary.

    Returns:
        [T, K] fp32 log-probabilities, differentiable in ``local_logits``.
    """
    logits = local_logits.float()  # [T, Vl]
    shard = logits.shape[-1]
    start = tp_rank() * shard
    peak = logits.detach().max(dim=-1).values  # [T]
    if tp_size() > 1:
        from megatron.core import parallel_state

        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    total = _all_reduce_sum(torch.exp(logits - peak[:, None]).sum(dim=-1))  # [T]
    lse = peak + torch.log(total)  # [T]
    local = targets - start  # [T, K]
    inside = (local >= 0) & (local < shard)
    picked = logits.gather(-1, local.clamp(0, shard - 1)) * inside  # [T, K]
    return _all_reduce_sum(picked) - lse[:, None]  # [T, K]
