"""The engine contract: what the HTTP app asks of a sampling engine, as pure data + a Protocol.

``HFEngine`` (``engine.py``) is the CPU implementation; a test double or another engine
only needs to satisfy ``Engine``.  Requests and results are per sequence: the app
flattens SGLang's batches and ``n`` samples into ``SequenceRequest`` rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from services.sampler.wire import EngineCounters

TopK = list[tuple[float, int]]


class RequestError(ValueError):
    """The request cannot be served as asked (the HTTP layer answers 400)."""


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Static facts about the served model and the engine's limits."""

    model_path: str
    context_length: int
    vocab_size: int
    max_batch_size: int
    max_loaded_loras: int
    max_lora_rank: int
    lora_target_modules: list[str]
    eos_token_ids: list[int]
    dtype: str = "float32"
    device: str = "cpu"


class SequenceRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One sequence to generate (``n`` samples of a prompt are ``n`` of these)."""

    input_ids: list[int]
    max_new_tokens: int | None
    """``None`` generates up to the context length (SGLang's ``max_new_tokens: null``)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_strs: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    lora_name: str | None = None
    logprob_start_len: int | None = None
    """First prompt index to report logprobs for; ``None`` reports none."""
    top_logprobs_num: int = 0


class SequenceResult(msgspec.Struct, kw_only=True):
    """The generated sequence with raw-distribution logprobs."""

    text: str
    output_ids: list[int]
    finish_kind: str
    """``"stop"`` or ``"length"``."""
    finish_matched: int | str | None
    prompt_tokens: int
    output_logprobs: list[float]
    output_top_logprobs: list[TopK]
    input_logprobs: list[float | None]
    """Aligned with ``input_ids[logprob_start_len:]``; the first entry is ``None``."""
    input_top_logprobs: list[TopK | None]
    latency_s: float


class Engine(Protocol):
    """What the HTTP app needs from a sampling engine."""

    @property
    def info(self) -> EngineInfo: ...

    async def generate(self, requests: Sequence[SequenceRequest]) -> list[SequenceResult]:
        """Generate every request (batched with whatever else is running); results in order.

        Raises:
            RequestError: a request is invalid (context overflow, bad token id, unknown adapter).
        """
        ...

    async def load_adapter(self, name: str, path: str, *, pinned: bool = False) -> None:
        """Serve the PEFT LoRA directory ``path`` as ``name``; raises ``AdapterError``."""
        ...

    async def load_adapter_tensors(
        self, name: str, config: dict[str, Any], payload: str, *, pinned: bool = False
    ) -> None:
        """Serve a PEFT LoRA given as its config and one ``serialized_named_tensors`` entry
        (services/sampler/handover.py) as ``name``; raises ``AdapterError``."""
        ...

    async def unload_adapter(self, name: str) -> None:
        """Stop serving ``name``; raises ``AdapterError`` if it is unknown."""
        ...

    def adapters(self) -> dict[str, str]:
        """Servable adapter names and their directories."""
        ...

    def resident_adapters(self) -> list[str]:
        """Adapters currently in memory, least recently used first."""
        ...

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each token decoded on its own (for ``return_text_in_logprobs``)."""
        ...

    def counters(self) -> EngineCounters: ...

    def close(self) -> None: ...
