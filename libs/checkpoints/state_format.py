"""The training-state checkpoint format (save_state / load_state), readable without the trainer.

    adapter.safetensors     LoRA tensors at the adapter's rank, full (TP=1) megatron layout
    optimizer.safetensors   AdamW moments: `exp_avg.<name>` and `exp_avg_sq.<name>`
    state.json              TrainingStateMeta below

Sampler snapshots are plain PEFT directories (`adapter_model.safetensors`, `adapter_config.json`)
plus `tinkerd.json` (SnapshotMeta), so SGLang, vLLM and PEFT load them unmodified.
"""

from __future__ import annotations

import msgspec

FORMAT_VERSION = 1
STATE_FILE = "state.json"
ADAPTER_FILE = "adapter.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
SNAPSHOT_META = "tinkerd.json"


class TrainingStateMeta(msgspec.Struct, kw_only=True):
    format_version: int = FORMAT_VERSION
    kind: str = "training"
    base_model: str
    model_id: str
    tenant: str
    rank: int
    seed: int
    train_attn: bool
    train_mlp: bool
    train_unembed: bool
    step: int
    layout: str = "megatron-tp1"
    has_optimizer: bool = True


class SnapshotMeta(msgspec.Struct, kw_only=True):
    format_version: int = FORMAT_VERSION
    kind: str = "sampler"
    base_model: str
    model_id: str
    tenant: str
    rank: int
    step: int
