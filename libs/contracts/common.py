"""Pieces every bus message shares: the envelope, tensors and datums in their bus form.

Conventions (msgspec's schema-evolution rules): new fields get defaults, field types never change,
tags are explicit strings so renaming a class never changes the wire. Units live in names
(`at_ns`, `ttl_s`).
"""

from __future__ import annotations

import time

import msgspec
import numpy as np

SCHEMA_VERSION = 1


def now_ns() -> int:
    return time.time_ns()


class Envelope(msgspec.Struct, kw_only=True, frozen=True):
    """Identity and provenance carried by every command, unit, outcome, result and event.

    Attributes:
        schema: schema version of the message family.
        tenant: owner of the model or session (a tenant id, never an API key).
        model_id: the model the message is about ("" when none, e.g. a session event).
        request_id: the future the message contributes to ("" when none).
        seq_id: the SDK's per-model sequence number (-1 when none).
        at_ns: wall-clock time the message was created.
        traceparent: W3C trace context, so one SDK call is one trace across services.
    """

    schema: int = SCHEMA_VERSION
    tenant: str = ""
    model_id: str = ""
    request_id: str = ""
    seq_id: int = -1
    at_ns: int = 0
    traceparent: str = ""


class BusTensor(msgspec.Struct, frozen=True, array_like=True):
    """A dense tensor as raw little-endian bytes: compact in msgpack, zero-copy into numpy."""

    dtype: str  # "int64" | "float32" | "int32"
    shape: list[int]
    data: bytes

    @staticmethod
    def of(array: np.ndarray) -> BusTensor:
        arr = np.ascontiguousarray(array)
        return BusTensor(
            dtype=str(arr.dtype),
            shape=list(arr.shape),
            data=arr.astype(arr.dtype.newbyteorder("<")).tobytes(),
        )

    def numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype).newbyteorder("<")).reshape(self.shape)


class BusDatum(msgspec.Struct, frozen=True, array_like=True):
    """One training example: its input tokens and the per-token inputs of the loss."""

    tokens: bytes  # int32 little-endian, the concatenated text chunks of the model input
    inputs: dict[str, BusTensor]

    def token_array(self) -> np.ndarray:
        return np.frombuffer(self.tokens, dtype="<i4")

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 4


class LoraConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A model's LoRA configuration: the SDK's ``LoraConfig``, carried unchanged from the wire
    to the planner, the trainer's slots and the checkpoint files. ``seed`` None: the trainer
    derives one from the model id."""

    rank: int
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def trains(self, group: str) -> bool:
        """Whether the adapter covers a module group: ``attn``, ``mlp`` or ``unembed``."""
        return {"attn": self.train_attn, "mlp": self.train_mlp, "unembed": self.train_unembed}[group]


class AdamParams(msgspec.Struct, frozen=True, kw_only=True):
    """AdamW hyper-parameters of one optim_step: the SDK's ``AdamParams``, from the wire to the
    trainer's optimizer (torch AdamW semantics, decoupled weight decay; grad_clip_norm 0 = off)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
