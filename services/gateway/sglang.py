"""A client for the SGLang HTTP subset Tinkerd samples through (`/generate`, `/load_lora_adapter`).

The CPU engine in services/sampler speaks the same API, so this code runs unchanged against real
SGLang on a GPU stack. Only the fields Tinkerd reads are declared; the rest are ignored.
"""

from __future__ import annotations

import math
from typing import Any

import httpx
import msgspec
import numpy as np

from libs.contracts.results import SampledSequence, SampleResult, TopK

Entry = tuple[float | None, int, Any]
PAD_LOGPROB = -99999.0


class Finish(msgspec.Struct):
    type: str


class Meta(msgspec.Struct):
    finish_reason: Finish | None = None
    input_token_logprobs: list[Entry] | None = None
    output_token_logprobs: list[Entry] | None = None
    input_top_logprobs: list[list[Entry] | None] | None = None
    output_top_logprobs: list[list[Entry] | None] | None = None


class Output(msgspec.Struct):
    output_ids: list[int]
    meta_info: Meta


class EngineError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


_outputs = msgspec.json.Decoder(list[Output] | Output)


async def generate(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[Output]:
    response = await client.post(
        f"{url}/generate", content=msgspec.json.encode(body), headers={"content-type": "application/json"}
    )
    if response.status_code != 200:
        raise EngineError(response.status_code, response.text[:500])
    decoded = _outputs.decode(response.content)
    return decoded if isinstance(decoded, list) else [decoded]


async def load_adapter(client: httpx.AsyncClient, url: str, name: str, path: str) -> None:
    response = await client.post(f"{url}/load_lora_adapter", json={"lora_name": name, "lora_path": path})
    if response.status_code != 200 and "already" not in response.text.lower():
        raise EngineError(response.status_code, response.text[:500])


def _topk(rows: list[list[Entry] | None], k: int) -> TopK:
    ids = np.zeros((len(rows), k), dtype="<i4")
    lps = np.full((len(rows), k), PAD_LOGPROB, dtype="<f4")
    for i, row in enumerate(rows):
        for j, (lp, token, _text) in enumerate((row or [])[:k]):
            if lp is not None:
                ids[i, j], lps[i, j] = token, lp
    return TopK(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(rows))


def to_sample_result(
    outputs: list[Output],
    prompt_len: int,
    want_prompt: bool,
    topk_prompt: int,
    topk_sample: int,
    last_n: int | None,
) -> SampleResult:
    sequences = []
    for out in outputs:
        entries = out.meta_info.output_token_logprobs or []
        logprobs = np.asarray([e[0] if e[0] is not None else math.nan for e in entries], dtype="<f4")
        reason = (
            "length"
            if out.meta_info.finish_reason and out.meta_info.finish_reason.type == "length"
            else "stop"
        )
        topk = _topk(out.meta_info.output_top_logprobs or [], topk_sample) if topk_sample else None
        sequences.append(
            SampledSequence(
                stop_reason=reason,
                tokens=np.asarray(out.output_ids, dtype="<i4").tobytes(),
                logprobs=logprobs.tobytes(),
                topk=topk,
            )
        )
    prompt_lp: bytes | None = None
    topk_prompt_result: TopK | None = None
    if want_prompt and outputs:
        entries = outputs[0].meta_info.input_token_logprobs or []
        values = np.full(prompt_len, np.nan, dtype="<f4")
        for i, entry in enumerate(entries[:prompt_len]):
            if i > 0 and entry[0] is not None:
                values[i] = entry[0]
        if last_n is not None:
            values[: max(0, prompt_len - last_n)] = np.nan
        prompt_lp = values.tobytes()
        if topk_prompt:
            rows = list(outputs[0].meta_info.input_top_logprobs or [])
            rows = (rows + [None] * prompt_len)[:prompt_len]
            rows[0] = None
            topk_prompt_result = _topk(rows, topk_prompt)
    return SampleResult(sequences=sequences, prompt_logprobs=prompt_lp, topk_prompt=topk_prompt_result)
