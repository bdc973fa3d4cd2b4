"""Pure translation between SGLang's ``/generate`` wire shapes and engine sequences.

``to_sequences`` flattens one ``GenerateReqInput`` (a prompt or a batch, each with ``n``
samples) into ``SequenceRequest`` rows, in SGLang's output order: prompt-major, so
output ``i * n + j`` is sample ``j`` of prompt ``i``.  ``to_output`` turns a finished
sequence back into SGLang's ``{"text", "output_ids", "meta_info"}``.

Sample ``j`` of a seeded request uses ``sampling_seed + j``, so ``n`` samples differ
and sample 0 equals a separate ``n = 1`` request with the same seed.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec

from services.sampler.interface import RequestError, SequenceRequest, SequenceResult
from services.sampler.wire import (
    FinishReason,
    GenerateOutput,
    GenerateReqInput,
    MetaInfo,
    SamplingParams,
    TopLogprobs,
)

T = TypeVar("T")


class Planned(msgspec.Struct, frozen=True, kw_only=True):
    """One output slot of a ``/generate`` call: the sequence and how to report it."""

    sequence: SequenceRequest
    rid: str
    return_logprob: bool
    top_logprobs_num: int


def _per_item(value: T | list[T], count: int, name: str) -> list[T]:
    if isinstance(value, list):
        if len(value) != count:
            raise RequestError(f"{name} has {len(value)} entries for a batch of {count} prompts")
        return value
    return [value] * count


def _prompts(input_ids: list[Any] | None, text: object) -> tuple[list[list[int]], bool]:
    """The prompts and whether the request was a batch."""
    if input_ids is None:
        if text is not None:
            raise RequestError("text input is not supported by this sampler; send input_ids")
        raise RequestError("input_ids is required")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
        return [list(input_ids)], False
    try:
        return msgspec.convert(input_ids, list[list[int]]), True
    except msgspec.ValidationError as exc:
        raise RequestError(f"input_ids must be a list of token ids or a list of such lists ({exc})") from exc


def _check_supported(params: SamplingParams) -> None:
    unsupported = {
        "min_new_tokens": params.min_new_tokens != 0,
        "frequency_penalty": params.frequency_penalty != 0.0,
        "presence_penalty": params.presence_penalty != 0.0,
        "repetition_penalty": params.repetition_penalty != 1.0,
        "json_schema": params.json_schema is not None,
        "regex": params.regex is not None,
        "ebnf": params.ebnf is not None,
    }
    named = [name for name, used in unsupported.items() if used]
    if named:
        raise RequestError(f"sampling_params not supported by the CPU sampler: {', '.join(named)}")
    if params.n < 1:
        raise RequestError(f"n must be >= 1, got {params.n}")
    if params.top_k == 0 or params.top_k < -1:
        raise RequestError(f"top_k must be -1 (disabled) or at least 1, got {params.top_k}")


def to_sequences(req: GenerateReqInput) -> tuple[list[Planned], bool]:
    """Flatten ``req`` into planned sequences; the flag says whether to answer with a list.

    Raises:
        RequestError: streaming, text input, malformed batches or unsupported parameters.
    """
    if req.stream:
        raise RequestError("stream=true is not supported by this sampler")
    prompts, batched = _prompts(req.input_ids, req.text)
    count = len(prompts)
    params_list = _per_item(req.sampling_params or SamplingParams(), count, "sampling_params")
    loras = _per_item(req.lora_path, count, "lora_path")
    want_logprobs = _per_item(req.return_logprob, count, "return_logprob")
    starts = _per_item(req.logprob_start_len, count, "logprob_start_len")
    tops = _per_item(req.top_logprobs_num, count, "top_logprobs_num")
    rids = _per_item(req.rid, count, "rid") if req.rid is not None else [None] * count

    planned: list[Planned] = []
    for i, prompt in enumerate(prompts):
        params = params_list[i]
        _check_supported(params)
        stop = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        start: int | None = None
        if want_logprobs[i]:
            start = len(prompt) - 1 if starts[i] == -1 else starts[i]
        for j in range(params.n):
            seed = None if params.sampling_seed is None else params.sampling_seed + j
            rid = rids[i]
            planned.append(
                Planned(
                    sequence=SequenceRequest(
                        input_ids=prompt,
                        max_new_tokens=params.max_new_tokens,
                        temperature=params.temperature,
                        top_p=params.top_p,
                        top_k=params.top_k,
                        min_p=params.min_p,
                        stop_strs=stop,
                        stop_token_ids=list(params.stop_token_ids or []),
                        ignore_eos=params.ignore_eos,
                        skip_special_tokens=params.skip_special_tokens,
                        no_stop_trim=params.no_stop_trim,
                        seed=seed,
                        lora_name=loras[i],
                        logprob_start_len=start,
                        top_logprobs_num=tops[i] if want_logprobs[i] else 0,
                    ),
                    rid=(rid if params.n == 1 else f"{rid}-{j}") if rid else uuid.uuid4().hex,
                    return_logprob=want_logprobs[i],
                    top_logprobs_num=tops[i] if want_logprobs[i] else 0,
                )
            )
    return planned, batched or len(planned) > 1


def to_output(
    plan: Planned,
    result: SequenceResult,
    token_texts: Callable[[Sequence[int]], list[str]] | None,
) -> GenerateOutput:
    """SGLang's output object for one finished sequence.

    Args:
        token_texts: decodes token ids one by one when ``return_text_in_logprobs`` was
            asked; ``None`` leaves the text slot of every logprob entry ``None``.
    """
    if result.finish_kind == "length":
        finish = FinishReason(type="length", length=len(result.output_ids))  # == max_new_tokens
    else:
        assert result.finish_matched is not None
        finish = FinishReason(type="stop", matched=result.finish_matched)
    meta = MetaInfo(
        id=plan.rid,
        finish_reason=finish,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=len(result.output_ids),
        e2e_latency=result.latency_s,
    )
    if plan.return_logprob:

        def texts(ids: Sequence[int]) -> list[str | None]:
            return list(token_texts(ids)) if token_texts is not None else [None] * len(ids)

        start = plan.sequence.logprob_start_len or 0
        input_ids = plan.sequence.input_ids[start:]
        meta.input_token_logprobs = [
            (lp, tok, txt)
            for lp, tok, txt in zip(result.input_logprobs, input_ids, texts(input_ids), strict=True)
        ]
        meta.output_token_logprobs = [
            (lp, tok, txt)
            for lp, tok, txt in zip(
                result.output_logprobs, result.output_ids, texts(result.output_ids), strict=True
            )
        ]
        if plan.top_logprobs_num > 0:

            def entries(top: list[tuple[float, int]]) -> TopLogprobs:
                ids = [tok for _, tok in top]
                return [(lp, tok, txt) for (lp, tok), txt in zip(top, texts(ids), strict=True)]

            meta.input_top_logprobs = [
                None if top is None else entries(top) for top in result.input_top_logprobs
            ]
            meta.output_top_logprobs = [entries(top) for top in result.output_top_logprobs]
    return GenerateOutput(text=result.text, output_ids=result.output_ids, meta_info=meta)
