"""A client for the SGLang HTTP subset Tinkerd samples through.

Routes: `/generate`, `/load_lora_adapter`, `/unload_lora_adapter`, `/health` and `/get_model_info`
(whose `model_path` and `is_generation` tell what an address serves: `check_engine`). The CPU
engine in services/sampler speaks the same API, so this code runs unchanged against real SGLang on
a GPU stack. Only the fields Tinkerd reads are declared; the rest are ignored.

Two kinds of failure are told apart: `EngineUnavailable` (the engine cannot be reached, or answers
502/503/504: it is down, restarting or overloaded; the caller waits and tries again) and
`EngineError` (the engine answered and refused the request).
"""

from __future__ import annotations

import math
from typing import Any

import httpx
import msgspec
import numpy as np

from libs.contracts.publish import AdapterHandover
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
    """The engine answered and refused (status and the start of its body)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class EngineUnavailable(Exception):
    """The engine at `url` could not serve the call at all: refused, reset, or 502/503/504."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason


class LoRAUpdate(msgspec.Struct):
    """SGLang's answer to `/load_lora_adapter` and `/unload_lora_adapter` (`LoRAUpdateOutput`)."""

    success: bool = False
    error_message: str | None = None
    loaded_adapters: dict[str, Any] | None = None


UNAVAILABLE_STATUS = frozenset({502, 503, 504})
HEALTH_TIMEOUT_S = 5.0
_outputs = msgspec.json.Decoder(list[Output] | Output)
_lora_update = msgspec.json.Decoder(LoRAUpdate)


SOCKET_GONE = (httpx.TransportError, AttributeError)
"""What a call to an engine raises when the engine cannot be reached: httpx's transport errors
(refused, reset mid-answer, timed out connecting), and the ``AttributeError`` anyio's socket
stream raises for a connection reset as it opened (the engine killed at that moment: the stream
holds no socket, and httpcore's first look at it reads ``None.getpeername``). Only the HTTP
client's own code runs inside these calls, so an ``AttributeError`` there is that case."""


async def _post(client: httpx.AsyncClient, url: str, route: str, body: dict[str, Any]) -> httpx.Response:
    content = msgspec.json.encode(body)
    try:
        response = await client.post(f"{url}{route}", content=content, headers={"content-type": "application/json"})
    except SOCKET_GONE as exc:
        raise EngineUnavailable(url, f"{type(exc).__name__}: {exc}") from exc
    if response.status_code in UNAVAILABLE_STATUS:
        raise EngineUnavailable(url, f"HTTP {response.status_code} from {route}: {response.text[:200]}")
    return response


async def generate(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[Output]:
    response = await _post(client, url, "/generate", body)
    if response.status_code != 200:
        raise EngineError(response.status_code, response.text[:500])
    decoded = _outputs.decode(response.content)
    return decoded if isinstance(decoded, list) else [decoded]


def adapter_missing(exc: EngineError) -> bool:
    """A `/generate` named an adapter the engine does not hold (it restarted, or evicted it).

    SGLang answers 400 `{"error": {"message": "The following requested LoRA adapters are not
    loaded: <name> ..."}}`; the CPU sampler uses the same words.
    """
    return exc.status == 400 and "not loaded" in str(exc).lower()


def _update(response: httpx.Response) -> LoRAUpdate:
    try:
        return _lora_update.decode(response.content) if response.content else LoRAUpdate()
    except msgspec.DecodeError:
        return LoRAUpdate(error_message=response.text[:500])


def _adapter_path(ref: Any) -> str | None:
    """The directory of one `loaded_adapters` entry: a path (the CPU sampler, some SGLang versions)
    or SGLang's `LoRARef` (an object with `lora_path`, or its array form `[id, name, path, ...]`)."""
    if isinstance(ref, str):
        return ref
    if isinstance(ref, dict) and isinstance(ref.get("lora_path"), str):
        return str(ref["lora_path"])
    if isinstance(ref, list) and len(ref) >= 3 and isinstance(ref[2], str):
        return ref[2]
    return None


def reported_adapters(update: LoRAUpdate) -> dict[str, str] | None:
    """{name: directory} of every adapter the engine says it holds; None when it says nothing usable."""
    if update.loaded_adapters is None:
        return None
    out = {name: _adapter_path(ref) for name, ref in update.loaded_adapters.items()}
    if any(path is None for path in out.values()):
        return None  # a shape we do not know: better no reconciliation than a wrong one
    return {name: path for name, path in out.items() if path is not None}


async def load_adapter(client: httpx.AsyncClient, url: str, name: str, path: str) -> dict[str, str] | None:
    """Load `path` under `name` ("already loaded" counts as success).

    Returns the engine's adapters after the call ({name: directory}) when it reports them.
    """
    response = await _post(client, url, "/load_lora_adapter", {"lora_name": name, "lora_path": path})
    update = _update(response)
    if response.status_code == 200 and update.success:
        return reported_adapters(update)
    message = update.error_message or response.text[:500]
    if "already" in message.lower():  # SGLang: "... already exists"; the CPU sampler: "already loaded"
        return reported_adapters(update)
    raise EngineError(response.status_code, message)


class HandoverUnreadable(Exception):
    """The engine could not load an adapter from a trainer's memory (the trainer let it go or is
    gone, the engine is on another host, or it has no such route): its files must serve."""


async def load_adapter_from_tensors(
    client: httpx.AsyncClient, url: str, name: str, handover: AdapterHandover
) -> dict[str, str] | None:
    """Load a handed-over adapter under `name` (SGLang's `/load_lora_adapter_from_tensors`; the
    trainer serialized its tensors as that route reads them). "Already loaded" counts as success.

    Raises:
        HandoverUnreadable: the engine refused it (the reason is the message).
    """
    body = {
        "lora_name": name,
        "config_dict": handover.config,
        "serialized_named_tensors": [handover.tensors],
        "pinned": False,
    }
    response = await _post(client, url, "/load_lora_adapter_from_tensors", body)
    update = _update(response)
    if response.status_code == 200 and update.success:
        return reported_adapters(update)
    message = update.error_message or response.text[:500]
    if "already" in message.lower():
        return reported_adapters(update)
    raise HandoverUnreadable(f"HTTP {response.status_code}: {message}")


async def unload_adapter(client: httpx.AsyncClient, url: str, name: str) -> None:
    """Unload `name`; an adapter the engine does not hold counts as unloaded."""
    response = await _post(client, url, "/unload_lora_adapter", {"lora_name": name})
    update = _update(response)
    if response.status_code == 200 and update.success:
        return
    message = update.error_message or response.text[:500]
    if "not loaded" in message.lower() or "does not exist" in message.lower():
        return
    raise EngineError(response.status_code, message)


class ModelInfo(msgspec.Struct):
    """SGLang's `/get_model_info` answer (the fields Tinkerd checks)."""

    model_path: str
    is_generation: bool = True


_model_info = msgspec.json.Decoder(ModelInfo)


def serves(model_path: str, names: tuple[str, ...]) -> bool:
    """Whether an engine's `model_path` is one of `names` (a base model's name, alias and
    directory), compared as written and by its last path component."""
    last = model_path.rstrip("/").rsplit("/", 1)[-1]
    return model_path in names or last in {n.rstrip("/").rsplit("/", 1)[-1] for n in names}


async def check_engine(
    client: httpx.AsyncClient, url: str, names: tuple[str, ...], timeout_s: float = HEALTH_TIMEOUT_S
) -> None:
    """Make sure `url` answers as a sampling engine of the base model `names` describe (any
    generation model when empty): `GET /health` is 200 and `GET /get_model_info` names it.

    Raises:
        EngineUnavailable: anything else, with what was found (an address that does not answer,
            answers 503 while it starts, is no sampling engine, or serves another model).
    """
    try:
        health = await client.get(f"{url}/health", timeout=timeout_s)
        if health.status_code != 200:
            raise EngineUnavailable(url, f"GET /health answered {health.status_code} (starting or unhealthy)")
        response = await client.get(f"{url}/get_model_info", timeout=timeout_s)
    except (httpx.HTTPError, *SOCKET_GONE) as exc:  # refused, reset, timed out, or does not speak HTTP
        raise EngineUnavailable(url, f"does not answer HTTP: {type(exc).__name__}: {exc}".rstrip(": ")) from exc
    try:
        if response.status_code != 200:
            raise msgspec.ValidationError(f"GET /get_model_info answered {response.status_code}")
        info = _model_info.decode(response.content)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise EngineUnavailable(url, f"is not a sampling engine ({exc})") from exc
    if not info.is_generation:
        raise EngineUnavailable(url, f"serves {info.model_path!r}, which is not a generation model")
    if names and not serves(info.model_path, names):
        raise EngineUnavailable(url, f"serves model {info.model_path!r}, not the base model {names[0]!r}")


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
