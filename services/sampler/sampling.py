"""Token selection and stop conditions for one sequence, as pure functions.

``choose_token`` turns one row of logits into the next token with SGLang's order of
operations (temperature, then top-k, top-p, min-p) and an explicit ``torch.Generator``,
so a seeded request draws the same tokens whatever else shares its batch.  Logprobs
reported to clients are never taken from here: they are the raw (temperature 1)
log-softmax of the logits, the same quantity a trainer forward computes.

``finish_reason`` applies SGLang's ``Req.check_finished`` rules in SGLang's order:
length first, then EOS / ``stop_token_ids`` (both disabled by ``ignore_eos``), then
stop strings found in the decoded tail.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

GREEDY_EPS = 1e-6
"""Temperatures at or below this are greedy (SGLang treats them as ``top_k = 1``)."""


@dataclass(frozen=True, slots=True)
class Finish:
    """Why a sequence stopped: ``kind`` is ``"stop"`` or ``"length"``.

    ``matched`` is the stop token id or stop string (``None`` for ``"length"``).
    """

    kind: str
    matched: int | str | None = None


def choose_token(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    generator: torch.Generator | None,
) -> int:
    """Pick the next token from ``logits`` (V,), fp32.

    Args:
        temperature: ``<= GREEDY_EPS`` selects the argmax.
        top_k: keep the ``top_k`` most likely tokens; ``<= 0`` keeps all.
        top_p: keep the smallest most-likely set whose mass reaches ``top_p``.
        min_p: drop tokens less likely than ``min_p`` times the most likely one.
        generator: the sequence's own RNG (seeded for reproducible sampling).
    """
    return int(
        choose_token_tensor(
            logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, generator=generator
        )
    )


def is_greedy(temperature: float, top_k: int) -> bool:
    return temperature <= GREEDY_EPS or top_k == 1


def choose_token_tensor(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """``choose_token`` as a 0-d long tensor on ``logits``' device (no host sync)."""
    if is_greedy(temperature, top_k):
        return torch.argmax(logits)
    probs = torch.softmax(logits / temperature, dim=-1)  # (V,)
    vocab = probs.shape[-1]
    if (top_k <= 0 or top_k >= vocab) and top_p >= 1.0 and min_p <= 0.0:
        return torch.multinomial(probs, 1, generator=generator)[0]
    if 0 < top_k < vocab:
        kept, index = torch.topk(probs, top_k)  # sorted, most likely first
    else:
        kept, index = torch.sort(probs, descending=True)
    if top_p < 1.0:
        mass_before = torch.cumsum(kept, dim=-1) - kept
        kept = torch.where(mass_before < top_p, kept, torch.zeros_like(kept))  # always keeps the first
    if min_p > 0.0:
        kept = torch.where(kept >= min_p * kept[0], kept, torch.zeros_like(kept))
    choice = torch.multinomial(kept, 1, generator=generator)
    return index[choice][0]


def stop_tail_tokens(stop_strs: Sequence[str]) -> int:
    """How many trailing tokens can hold a stop string: each token decodes to >= 1 byte."""
    return max((len(s.encode()) for s in stop_strs), default=0) + 1


def finish_reason(
    output_ids: Sequence[int],
    *,
    max_new_tokens: int,
    ignore_eos: bool,
    stop_token_ids: frozenset[int],
    stop_strs: Sequence[str],
    decode: Callable[[Sequence[int]], str],
) -> Finish | None:
    """SGLang's finish check after each new token; ``None`` means keep going.

    Args:
        stop_token_ids: the request's ``stop_token_ids`` plus the model's EOS ids.
        decode: detokenizes a tail of ``output_ids`` (special tokens kept).
    """
    if len(output_ids) >= max_new_tokens:
        return Finish("length")
    last = output_ids[-1]
    if not ignore_eos and last in stop_token_ids:
        return Finish("stop", last)
    if stop_strs:
        tail = decode(output_ids[-stop_tail_tokens(stop_strs) :])
        for stop in stop_strs:
            if stop in tail:
                return Finish("stop", stop)
    return None


def trim_text(text: str, finish: Finish, no_stop_trim: bool) -> str:
    """Cut the output text before the matched stop string (SGLang's ``trim_matched_stop``)."""
    if no_stop_trim or not isinstance(finish.matched, str):
        return text
    pos = text.find(finish.matched)
    return text[:pos] if pos != -1 else text
