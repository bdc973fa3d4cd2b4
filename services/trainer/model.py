"""Build a frozen megatron-core ``GPTModel`` from a Hugging Face Qwen3 / Llama-3 directory.

Supported families: Qwen3 dense (qk RMSNorm, GQA, no bias) and Llama-3 dense (GQA, no bias,
optional ``llama3`` RoPE scaling).  On CPU the layer spec uses megatron's local modules
(torch RMSNorm, ``ColumnParallelLinear``/``RowParallelLinear``) and fp32; on GPU it uses the
Transformer Engine linears and norms when ``transformer_engine`` imports, in bf16.  Core
attention is always one of ``attention.ATTENTION_BACKENDS`` (packed, per-document causal), the
MLP's activation ``swiglu.SwiGLU`` and, without transformer-engine, every norm
``rmsnorm.RMSNorm`` (each one Triton kernel per direction on CUDA).

Invariant: every base parameter is frozen (``requires_grad=False``) and holds this rank's
shard of the HF weights; the module tree and parameter names are exactly megatron's (the
LoRA adapters attach by hooks and live outside the model, see ``lora.py``).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from services.trainer import packed_rope
from services.trainer.attention import ATTENTION_BACKENDS
from services.trainer.convert import (
    ModelShape,
    hf_to_megatron,
    megatron_to_hf,
    shard,
    unshard,
    weight_shard_kind,
)
from services.trainer.parallel import tp_all_gather, tp_rank, tp_size
from services.trainer.rmsnorm import RMSNorm
from services.trainer.shims import apply_cpu_shims
from services.trainer.swiglu import SwiGLU


@dataclass(frozen=True)
class RopeSettings:
    theta: float
    llama3_factor: float | None  # None: plain RoPE


def load_hf_config(model_dir: str | os.PathLike[str]) -> Any:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir))
    if cfg.model_type not in ("qwen3", "llama"):
        raise ValueError(f"unsupported model_type {cfg.model_type!r}: only qwen3 and llama dense models")
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise ValueError("models with linear biases are not supported")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}")
    return cfg


def rope_settings(cfg: Any) -> RopeSettings:
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return RopeSettings(theta, None)
    if rope_type == "llama3":
        # megatron hard-codes these three llama3 constants in RotaryEmbedding._apply_scaling.
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, want in expected.items():
            if float(params.get(key, want)) != want:
                raise ValueError(f"llama3 rope scaling with {key}={params[key]} is not supported")
        return RopeSettings(theta, float(params["factor"]))
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def transformer_config(cfg: Any, shape: ModelShape, *, tp: int, dtype: torch.dtype, device: str) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    if shape.num_groups % tp or shape.num_heads % tp or shape.vocab_size % tp or shape.ffn_hidden_size % tp:
        raise ValueError(
            f"tp={tp} must divide kv heads ({shape.num_groups}), heads ({shape.num_heads}), "
            f"vocab ({shape.vocab_size}) and ffn size ({shape.ffn_hidden_size})"
        )
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_groups,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        tensor_model_parallel_size=tp,
        normalization="RMSNorm",
        layernorm_epsilon=float(cfg.rms_norm_eps),
        qk_layernorm=shape.qk_norm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=device == "cpu",
        perform_initialization=False,  # every weight is overwritten from the HF checkpoint
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        # The MLP builds its activation from the layer spec's module (swiglu.SwiGLU): megatron
        # gates that on this flag, which does not itself need transformer-engine.
        use_te_activation_func=True,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
        attention_softmax_in_fp32=True,
    )


def block_spec(attention_backend: str, qk_norm: bool, use_te: bool, num_layers: int) -> Any:
    """The decoder's spec: ``num_layers`` of ``layer_spec`` and the final norm (without
    transformer-engine, ``rmsnorm.RMSNorm`` as in the layers)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = layer_spec(attention_backend, qk_norm, use_te)
    final_norm = layer.submodules.pre_mlp_layernorm
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=final_norm)


def layer_spec(attention_backend: str, qk_norm: bool, use_te: bool) -> Any:
    """A dense transformer-layer spec with unfused norms (so LoRA hooks see the normed input):
    transformer-engine's linears and norms where it imports, else megatron's local linears and
    ``rmsnorm.RMSNorm`` (``torch.nn.RMSNorm``, one Triton kernel per direction on CUDA)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    norm: Any
    if use_te:
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelLinear,
            TENorm,
            TERowParallelLinear,
        )

        column, row, norm = TEColumnParallelLinear, TERowParallelLinear, TENorm
    else:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        column, row, norm = ColumnParallelLinear, RowParallelLinear, RMSNorm
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=column,
                    core_attention=ATTENTION_BACKENDS[attention_backend],
                    linear_proj=row,
                    q_layernorm=norm if qk_norm else IdentityOp,
                    k_layernorm=norm if qk_norm else IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row, activation_func=SwiGLU),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def _transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def build_model(
    model_dir: str | os.PathLike[str], *, dtype: torch.dtype, device: str, attention_backend: str
) -> tuple[Any, ModelShape]:
    """Build the frozen ``GPTModel`` for this TP rank and load its HF weights.

    Requires ``parallel.ensure_model_parallel`` to have run.  Returns the model (in eval mode:
    no dropout exists, but it keeps megatron off training-only paths) and its shape.
    """
    from megatron.core.models.gpt.gpt_model import GPTModel

    apply_cpu_shims()
    packed_rope.install()
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {attention_backend!r}; known: {sorted(ATTENTION_BACKENDS)}"
        )
    cfg = load_hf_config(model_dir)
    shape = ModelShape.from_hf_config(cfg)
    rope = rope_settings(cfg)
    config = transformer_config(cfg, shape, tp=tp_size(), dtype=dtype, device=device)
    use_te = device == "cuda" and _transformer_engine_available()
    spec = block_spec(attention_backend, qk_norm=shape.qk_norm, use_te=use_te, num_layers=shape.num_layers)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shape.vocab_size,
        max_sequence_length=int(cfg.max_position_embeddings),
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=rope.theta,  # type: ignore[arg-type]
        rope_scaling=rope.llama3_factor is not None,
        rope_scaling_factor=rope.llama3_factor or 8.0,
    )
    # torch.nn.RMSNorm ignores params_dtype (its weights are made fp32).
    model = model.to(dtype=dtype, device=torch.device(device))
    load_hf_weights(model, model_dir, shape)
    for param in model.parameters():
        param.requires_grad_(False)
    model.eval()
    return model, shape


def read_hf_state_dict(model_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(glob.glob(str(Path(model_dir) / "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(path))
    return state


def load_hf_weights(model: Any, model_dir: str | os.PathLike[str], shape: ModelShape) -> None:
    """Copy this rank's shard of every HF weight into ``model`` (strict: names must match)."""
    full = hf_to_megatron(read_hf_state_dict(model_dir), shape)
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
    missing = sorted(set(own) - set(full))
    unexpected = sorted(set(full) - set(own))
    if missing or unexpected:
        raise KeyError(f"weight names differ: missing {missing[:5]}, unexpected {unexpected[:5]}")
    rank, size = tp_rank(), tp_size()
    with torch.no_grad():
        for name, target in own.items():
            piece = shard(full[name], weight_shard_kind(name), rank, size)
            if piece.shape != target.shape:
                raise ValueError(
                    f"{name}: shard shape {tuple(piece.shape)} != param shape {tuple(target.shape)}"
                )
            target.copy_(piece.to(dtype=target.dtype, device=target.device))


def export_hf_state_dict(model: Any, shape: ModelShape) -> dict[str, torch.Tensor]:
    """The HF state dict of ``model``'s base weights, gathered over TP (every rank gets it)."""
    full: dict[str, torch.Tensor] = {}
    for name, local in model.state_dict().items():
        if name.endswith("._extra_state"):
            continue
        full[name] = unshard(tp_all_gather(local.detach()), weight_shard_kind(name)).cpu()
    return megatron_to_hf(full, shape)
