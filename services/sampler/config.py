"""Sampler service configuration: one frozen Struct, built once from the environment.

Every key ``<key>`` is read from ``TINKERD_SAMPLER_<KEY>`` first and ``TINKERD_<KEY>``
second (so a deployment can share ``TINKERD_MODEL_PATH`` between services and still
override one for the sampler).  Bad values fail at startup and name the variable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from infra.config import MAX_LORA_RANK

ENV_PREFIXES: tuple[str, ...] = ("TINKERD_SAMPLER_", "TINKERD_")


class SamplerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Settings of the CPU sampling engine and its HTTP server."""

    model_path: str
    """Local Hugging Face model directory (config, safetensors, tokenizer). Never downloaded."""
    host: str = "127.0.0.1"
    """Interface the HTTP server binds to."""
    port: int = 30000
    """HTTP port (SGLang's default); 0: a port the kernel picks when the server binds."""
    max_batch_size: int = 16
    """Most sequences decoded together in one step (SGLang's ``max_running_requests``)."""
    max_loaded_loras: int = 16
    """Most adapters resident in memory; the least recently used unpinned one is evicted."""
    max_lora_rank: int = MAX_LORA_RANK.default
    """Adapters with a larger rank are refused at load time."""
    context_length: int | None = None
    """Prompt + generated tokens limit; ``None`` takes the model's ``max_position_embeddings``."""
    torch_threads: int | None = None
    """``torch.set_num_threads`` for the engine; ``None`` keeps torch's default."""
    attn_implementation: str = "sdpa"
    """Transformers attention backend (``sdpa`` or ``eager``) of the ``hf`` engine."""
    device: str = "cpu"
    """``cpu``, ``cuda`` (bf16, the static-cache engine) or ``auto`` (cuda when available)."""
    engine: str = "auto"
    """``hf`` (transformers' forward and cache, fp32 CPU), ``static`` (``static_engine.py``: a
    preallocated KV cache, pooled LoRA slots, CUDA graphs on CUDA) or ``auto`` (``static`` on
    CUDA, ``hf`` on the CPU)."""
    cuda_graphs: bool = True
    """Replay decode steps as CUDA graphs (one per batch-size and cache-length bucket)."""
    decode_lookahead: bool = True
    """Launch each decode step of the static engine before the host has read the one before it
    (inputs from the device), so the device does not wait for the host's part of a step."""
    prefill_tokens: int = 16384
    """Most prompt tokens (padded) one prefill pass of the static engine admits."""

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_loaded_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {self.context_length}")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"device must be cpu, cuda or auto, got {self.device!r}")
        if self.engine not in ("auto", "hf", "static"):
            raise ValueError(f"engine must be auto, hf or static, got {self.engine!r}")
        if self.device == "cuda" and self.engine == "hf":  # "auto" + hf stays on the CPU
            raise ValueError("the hf engine runs on the CPU only; use engine=static (or auto) on cuda")
        if self.prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be >= 1, got {self.prefill_tokens}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads}")

    @property
    def torch_device(self) -> str:
        """``cpu`` or ``cuda``: ``auto`` resolved (and ``hf`` always on the CPU)."""
        if self.engine == "hf" or self.device == "cpu":
            return "cpu"
        if self.device == "cuda":
            return "cuda"
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def static(self) -> bool:
        """Whether this configuration selects the static-cache engine."""
        return self.engine == "static" or (self.engine == "auto" and self.torch_device == "cuda")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SamplerConfig:
        """Build the config from ``env`` (pass ``os.environ`` in production, a dict in tests).

        Raises:
            ValueError: a required key is missing or a value does not parse; the message
                names the environment variable.
        """
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for field in msgspec.structs.fields(cls):
            for prefix in ENV_PREFIXES:
                var = prefix + field.name.upper()
                if var in env:
                    values[field.name] = env[var]
                    sources[field.name] = var
                    break
        if "model_path" not in values:
            raise ValueError("TINKERD_SAMPLER_MODEL_PATH (or TINKERD_MODEL_PATH) is required")
        for name in list(values):
            if values[name] == "" and name != "model_path":
                del values[name]  # an empty variable means "use the default"
        try:
            return msgspec.convert(values, cls, strict=False)
        except (msgspec.ValidationError, ValueError) as exc:
            hint = ", ".join(f"{sources[n]}={values[n]!r}" for n in values)
            raise ValueError(f"invalid sampler configuration ({hint}): {exc}") from exc
