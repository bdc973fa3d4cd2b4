"""SGLang's HTTP wire shapes, the subset Tinkerd uses, as msgspec Structs.

Field names and defaults follow SGLang's ``GenerateReqInput`` / ``SamplingParams``
(``srt/managers/io_struct.py``, ``srt/sampling/sampling_params.py``) and the JSON its
``/generate``, ``/load_lora_adapter``, ``/server_info`` and ``/get_model_info`` routes
return, so a client written against this service works unchanged against real SGLang.
Unknown request fields are ignored (SGLang accepts many we do not implement); fields
we declare but cannot honour are refused by the app with a 400.

Logprob entries are SGLang's triples ``[logprob, token_id, token_text | None]``.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

LogprobEntry = tuple[float | None, int, str | None]
"""``[logprob, token_id, text]``; ``text`` is ``None`` unless ``return_text_in_logprobs``."""
TopLogprobs = list[tuple[float, int, str | None]]
"""The ``top_logprobs_num`` most likely tokens of one position, most likely first."""


class SamplingParams(msgspec.Struct, kw_only=True):
    """SGLang's ``sampling_params`` object (defaults are SGLang's, not the model's)."""

    max_new_tokens: int | None = 128
    """``None`` generates up to the context length."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """``-1`` (or ``0``) disables top-k."""
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    """SGLang semantics: disables EOS *and* ``stop_token_ids``; stop strings still apply."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None
    # Accepted so that an explicit neutral value is not silently dropped; anything else is refused.
    min_new_tokens: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


class GenerateReqInput(msgspec.Struct, kw_only=True):
    """Body of ``POST /generate``.

    ``input_ids`` is one prompt (``list[int]``) or a batch (``list[list[int]]``); the
    per-item fields may be a scalar (shared) or a list with one value per prompt.
    """

    input_ids: list[Any] | None = None
    text: str | list[str] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    lora_path: str | list[str | None] | None = None


class FinishReason(msgspec.Struct, omit_defaults=True):
    """``{"type": "stop", "matched": id | str}`` or ``{"type": "length", "length": n}``."""

    type: Literal["stop", "length", "abort"]
    matched: int | str | UnsetType = UNSET
    length: int | UnsetType = UNSET
    message: str | UnsetType = UNSET


class MetaInfo(msgspec.Struct, omit_defaults=True):
    """``meta_info`` of one output; logprob fields appear only when requested."""

    id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    e2e_latency: float = 0.0
    input_token_logprobs: list[LogprobEntry] | UnsetType = UNSET
    output_token_logprobs: list[LogprobEntry] | UnsetType = UNSET
    input_top_logprobs: list[TopLogprobs | None] | UnsetType = UNSET
    output_top_logprobs: list[TopLogprobs] | UnsetType = UNSET


class GenerateOutput(msgspec.Struct):
    """One generated sequence; ``/generate`` returns a list of these for batches or ``n > 1``."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class ErrorBody(msgspec.Struct):
    message: str


class ErrorResponse(msgspec.Struct):
    """SGLang's error body: ``{"error": {"message": ...}}``."""

    error: ErrorBody


class LoadLoRAAdapterReqInput(msgspec.Struct, kw_only=True):
    """Body of ``POST /load_lora_adapter``."""

    lora_name: str
    lora_path: str
    pinned: bool = False


class LoadLoRAAdapterFromTensorsReqInput(msgspec.Struct, kw_only=True):
    """Body of ``POST /load_lora_adapter_from_tensors`` (SGLang's fields; Tinkerd sends the
    first three): ``serialized_named_tensors`` holds one entry per tensor-parallel rank
    (services/sampler/handover.py)."""

    lora_name: str
    config_dict: dict[str, Any]
    serialized_named_tensors: list[str]
    pinned: bool = False
    load_format: str | None = None
    added_tokens_config: dict[str, int] | None = None


class UnloadLoRAAdapterReqInput(msgspec.Struct, kw_only=True):
    """Body of ``POST /unload_lora_adapter``."""

    lora_name: str


class LoRAUpdateOutput(msgspec.Struct, kw_only=True):
    """Answer of both adapter routes: 200 on success, 400 (same body) on failure.

    ``loaded_adapters`` maps every servable adapter name to its directory, including
    adapters currently evicted from memory (they are reloaded on their next request).
    """

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] | None = None


class EngineCounters(msgspec.Struct, kw_only=True):
    """Cumulative engine counters (SGLang puts its own under ``internal_states``)."""

    decode_steps: int
    prefill_batches: int
    prefill_joins: int
    """Prefill batches merged into an already running batch (continuous batching)."""
    generated_tokens: int
    finished_sequences: int
    max_decode_batch: int
    max_prefill_batch: int
    adapter_loads: int
    adapter_evictions: int
    lookahead_steps: int = 0
    """Decode steps launched before the host had read the step before them (static engine)."""
    running_sequences: int = 0
    """Sequences in the batch or waiting to join it, now (not cumulative)."""


class ServerInfo(msgspec.Struct, kw_only=True):
    """``GET /server_info`` (and the deprecated ``/get_server_info``): server args plus scheduler info."""

    model_path: str
    tokenizer_path: str
    served_model_name: str
    context_length: int
    max_total_num_tokens: int
    max_req_input_len: int
    max_req_len: int
    max_running_requests: int
    enable_lora: bool
    max_lora_rank: int
    max_loaded_loras: int
    max_loras_per_batch: int
    lora_target_modules: list[str]
    lora_eviction_policy: str
    loaded_lora_adapters: dict[str, str]
    resident_lora_adapters: list[str]
    device: str
    dtype: str
    internal_states: list[EngineCounters]
    version: str


class ModelInfo(msgspec.Struct, kw_only=True):
    """``GET /get_model_info``."""

    model_path: str
    tokenizer_path: str
    is_generation: bool = True
