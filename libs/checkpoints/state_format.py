"""The training-state checkpoint format (save_state / load_state), readable without the trainer.

    adapter.safetensors     LoRA tensors at the adapter's rank, full (TP=1) megatron layout:
                            `<module>.lora_A` [r, in] ([3, r, in] for linear_qkv: q, k, v;
                            [2, r, in] for linear_fc1: gate, up), `<module>.lora_B` [out, r]
    optimizer.safetensors   AdamW moments: `exp_avg.<name>` and `exp_avg_sq.<name>`
    state.json              TrainingStateMeta below

Sampler exports are plain PEFT directories (`adapter_model.safetensors`, `adapter_config.json`)
plus `tinkerd.json` (SamplerExportMeta), so SGLang, vLLM and PEFT load them unmodified.
"""

from __future__ import annotations

import msgspec

from libs.contracts.common import LoraConfig

FORMAT_VERSION = 3
"""3: one LoRA ``A`` per projection (Tinker's LoRA shape). 2: the LoRA config as one ``lora``
object, one ``A`` shared by q/k/v and one by gate/up. 1: as 2, the config spelled flat."""
OLDEST_READABLE = 3  # formats 1 and 2 hold adapters of another shape: not resumable
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
    """Read ``state.json`` of any format version (version 1 spelled the LoRA config flat); the
    result keeps the file's ``format_version``, for the reader to decide what it can load."""
    doc = msgspec.json.decode(raw)
    if isinstance(doc, dict) and doc.get("format_version") == 1:
        lora = {k: doc.pop(k) for k in ("rank", "seed", "train_attn", "train_mlp", "train_unembed") if k in doc}
        doc |= {"lora": lora}
    return msgspec.convert(doc, TrainingStateMeta)


def unreadable_reason(meta: TrainingStateMeta) -> str | None:
    """Why a training state of this format cannot be resumed here, or None when it can."""
    version = meta.format_version
    if version < OLDEST_READABLE:
        return (
            f"checkpoint format {version} predates format {FORMAT_VERSION}: it was saved by a Tinkerd "
            "whose LoRA shared one A across q/k/v and one across gate/up, and this server trains one A "
            "per projection (Tinker's LoRA shape), so its weights and optimizer state cannot be resumed; "
            "train from a new checkpoint (its sampler export still loads in any PEFT engine)"
        )
    if version > FORMAT_VERSION:
        return f"checkpoint format {version} is newer than this server's format {FORMAT_VERSION}"
    if meta.layout != "megatron-tp1":
        return f"checkpoint layout {meta.layout!r} is not supported (expected 'megatron-tp1')"
    return None


class SamplerExportMeta(msgspec.Struct, kw_only=True):
    format_version: int = FORMAT_VERSION
    kind: str = "sampler"
    base_model: str
    model_id: str
    tenant: str
    lora: LoraConfig
    step: int
