"""The training-state checkpoint format (save_state / load_state), readable without the trainer.

    adapter.safetensors     LoRA tensors at the adapter's rank, full (TP=1) megatron layout
    optimizer.safetensors   AdamW moments: `exp_avg.<name>` and `exp_avg_sq.<name>`
    state.json              TrainingStateMeta below

Sampler exports are plain PEFT directories (`adapter_model.safetensors`, `adapter_config.json`)
plus `tinkerd.json` (SamplerExportMeta), so SGLang, vLLM and PEFT load them unmodified.
"""

from __future__ import annotations

import msgspec

from libs.contracts.common import LoraConfig

FORMAT_VERSION = 2  # 2: the LoRA config as one `lora` object (1: flat fields)
STATE_FILE = "state.json"
ADAPTER_FILE = "adapter.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
EXPORT_META = "tinkerd.json"


class TrainingStateMeta(msgspec.Struct, kw_only=True):
    format_version: int = FORMAT_VERSION
    kind: str = "training"
    base_model: str
    model_id: str
    tenant: str
    lora: LoraConfig  # with its seed resolved
    step: int
    layout: str = "megatron-tp1"
    has_optimizer: bool = True


def decode_training_meta(raw: bytes) -> TrainingStateMeta:
    """Read ``state.json`` of any format version (version 1 spelled the LoRA config flat)."""
    doc = msgspec.json.decode(raw)
    if isinstance(doc, dict) and doc.get("format_version") == 1:
        lora = {k: doc.pop(k) for k in ("rank", "seed", "train_attn", "train_mlp", "train_unembed") if k in doc}
        doc |= {"lora": lora, "format_version": FORMAT_VERSION}
    return msgspec.convert(doc, TrainingStateMeta)


class SamplerExportMeta(msgspec.Struct, kw_only=True):
    format_version: int = FORMAT_VERSION
    kind: str = "sampler"
    base_model: str
    model_id: str
    tenant: str
    lora: LoraConfig
    step: int
