"""Convert a slot's adapter into Hugging Face PEFT LoRA format (tensors + adapter_config.json).

PEFT adapts HF's separate projections, megatron fuses some of them, so the fused adapters are
split: ``linear_qkv`` becomes ``q_proj``/``k_proj``/``v_proj`` and ``linear_fc1`` becomes
``gate_proj``/``up_proj``.  A fused target already holds one ``A`` per projection
(``lora_A [parts, r, in]``, see ``services/trainer/lora.py``), and each output row of its ``B``
multiplies its own projection's ``A x`` only, so the split is a pure re-indexing: part ``p`` of
``A`` with the rows of ``B`` that belong to projection ``p`` (qkv rows are de-interleaved per GQA
group exactly like the base weights).  ``output_layer`` maps to ``lm_head``.

Invariant: a PEFT model built from the export computes the same function as the engine's slot
(same rank, ``lora_alpha = 32``, so the same ``alpha / r`` scaling).
"""

from __future__ import annotations

from typing import Any

import torch

from services.trainer.convert import ModelShape, split_glu, split_qkv
from services.trainer.lora import LORA_ALPHA
from services.trainer.slot_state import SlotState

_PREFIX = "base_model.model."

# megatron suffix under decoder.layers.{i}.  ->  HF module names under model.layers.{i}.
_LAYER_MODULES: dict[str, tuple[str, ...]] = {
    "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention.linear_proj": ("self_attn.o_proj",),
    "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.linear_fc2": ("mlp.down_proj",),
}


def _split_b(suffix: str, b: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, ...]:
    if suffix == "self_attention.linear_qkv":
        return split_qkv(b, shape)
    if suffix == "mlp.linear_fc1":
        return split_glu(b)
    return (b,)


def export_peft(
    state: SlotState, shape: ModelShape, base_model_name_or_path: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """PEFT tensors (``...lora_A.weight`` (r, in), ``...lora_B.weight`` (out, r)) and config.

    The tensors may share memory with ``state`` (a host copy made for this export): no clones."""
    tensors: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    for i in range(shape.num_layers):
        for suffix, hf_names in _LAYER_MODULES.items():
            key = f"decoder.layers.{i}.{suffix}"
            if f"{key}.lora_A" not in state.adapter:
                continue
            a = state.adapter[f"{key}.lora_A"]  # [parts, r, in] (fused) or [r, in]
            a_parts = a.unbind(0) if len(hf_names) > 1 else (a,)  # each [r, in]
            bs = _split_b(suffix, state.adapter[f"{key}.lora_B"], shape)  # each [out_part, r]
            for hf_name, a_part, b in zip(hf_names, a_parts, bs, strict=True):
                base = f"{_PREFIX}model.layers.{i}.{hf_name}"
                tensors[f"{base}.lora_A.weight"] = a_part.contiguous()
                tensors[f"{base}.lora_B.weight"] = b.contiguous()
                targets.add(hf_name.split(".")[-1])
    if "output_layer.lora_A" in state.adapter:
        tensors[f"{_PREFIX}lm_head.lora_A.weight"] = state.adapter["output_layer.lora_A"].contiguous()
        tensors[f"{_PREFIX}lm_head.lora_B.weight"] = state.adapter["output_layer.lora_B"].contiguous()
        targets.add("lm_head")
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": state.config.rank,
        "lora_alpha": int(LORA_ALPHA) if LORA_ALPHA.is_integer() else LORA_ALPHA,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(targets),
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    return tensors, config
