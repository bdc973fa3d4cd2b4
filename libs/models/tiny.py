"""Deterministic tiny base models for tests and local development.

``build_tiny`` writes a small, randomly initialised causal LM in Hugging Face
format (fp32 ``model.safetensors``, ``config.json``, ``generation_config.json``,
tokenizer files and a ChatML chat template) without touching the network.
Every build of a preset yields byte-identical files: the tokenizer is a
byte-level BPE trained on a fixed, sorted slice of the Python standard
library, each weight tensor is drawn from its own generator seeded by
``(preset, tensor name)``, and no file carries timestamps, absolute paths or
library version strings.  (The bytes therefore depend only on the Python
stdlib sources, the ``tokenizers`` trainer and torch's CPU RNG.)
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch/transformers are imported lazily: resolving names must stay cheap.
    import torch

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# The BPE trainer assigns ids to special tokens first, in the order given.
BOS_TOKEN_ID = SPECIAL_TOKENS.index(BOS_TOKEN)
EOS_TOKEN_ID = SPECIAL_TOKENS.index(EOS_TOKEN)
PAD_TOKEN_ID = SPECIAL_TOKENS.index(PAD_TOKEN)

VOCAB_SIZE = 2048
# Bytes of stdlib source fed to the BPE trainer (well under a second to train).
TOKENIZER_CORPUS_BYTES = 2_000_000

# Std of every embedding and hidden matrix.  HF's usual 0.02 makes a random
# 128-wide model near-constant (greedy decoding collapses onto one token within
# a few steps, Llama without qk-norm worst); 0.1 (~1.1/sqrt(fan_in)) keeps
# greedy output varied for both presets.
INIT_STD = 0.1
# Std of the unembedding: logits get std ~ LM_HEAD_STD * sqrt(hidden) ~ 2.8,
# peaked enough that sampling at temperature 1 is not uniform noise.
LM_HEAD_STD = 0.25
FILE_MODE = 0o644

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- else %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


@dataclass(frozen=True)
class TinyPreset:
    """Architecture and sizes of one tiny model preset."""

    name: str
    arch: str  # "qwen3" | "llama"
    architecture: str  # HF model class name
    rope_theta: float
    vocab_size: int = VOCAB_SIZE
    hidden_size: int = 192
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 48
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6


PRESETS: dict[str, TinyPreset] = {
    "tiny-qwen3": TinyPreset("tiny-qwen3", "qwen3", "Qwen3ForCausalLM", rope_theta=1_000_000.0),
    "tiny-llama": TinyPreset("tiny-llama", "llama", "LlamaForCausalLM", rope_theta=500_000.0),
    # a second shape (narrower, shallower, other head layout, a smaller vocabulary and context):
    # two base models at once in tests, each with its own request limits
    "tiny-qwen3-narrow": TinyPreset(
        "tiny-qwen3-narrow",
        "qwen3",
        "Qwen3ForCausalLM",
        rope_theta=1_000_000.0,
        vocab_size=1024,
        max_position_embeddings=1024,
        hidden_size=128,
        intermediate_size=320,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
    ),
}


def model_config(preset: TinyPreset) -> dict[str, Any]:
    """The ``config.json`` contents for ``preset``.

    Written by hand (not via ``PretrainedConfig.save_pretrained``) so that it is
    independent of the installed transformers version and readable by both 4.x
    (``rope_theta``) and 5.x (``rope_parameters``).
    """
    cfg: dict[str, Any] = {
        "architectures": [preset.architecture],
        "model_type": preset.arch,
        "vocab_size": preset.vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads,
        "head_dim": preset.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": preset.max_position_embeddings,
        "rms_norm_eps": preset.rms_norm_eps,
        "rope_theta": preset.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": preset.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": INIT_STD,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if preset.arch == "qwen3":
        cfg.update(
            {
                "use_sliding_window": False,
                "sliding_window": None,
                "max_window_layers": preset.num_hidden_layers,
                "layer_types": ["full_attention"] * preset.num_hidden_layers,
            }
        )
    else:
        cfg.update({"mlp_bias": False, "pretraining_tp": 1})
    return cfg


def generation_config() -> dict[str, Any]:
    """The ``generation_config.json`` contents (token ids only, greedy by default)."""
    return {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": PAD_TOKEN_ID}


def _tokenizer_corpus(limit: int = TOKENIZER_CORPUS_BYTES) -> list[str]:
    """A fixed slice of stdlib source: top-level ``*.py`` files sorted by name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    used = 0
    for path in sorted(stdlib.glob("*.py"), key=lambda p: p.name):
        if used >= limit:
            break
        data = path.read_bytes()[: limit - used]
        used += len(data)
        texts.append(data.decode("utf-8", errors="replace"))
    if not texts:
        raise RuntimeError(f"no Python stdlib sources found under {stdlib}")
    return texts


def train_tokenizer_json(vocab_size: int = VOCAB_SIZE) -> str:
    """Train the byte-level BPE and return its ``tokenizer.json`` text.

    The ``tokenizers`` BPE trainer is deterministic for a fixed corpus
    regardless of its thread count (checked by the sha256 tests).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"BPE produced {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    for token in SPECIAL_TOKENS:
        if tok.token_to_id(token) != SPECIAL_TOKENS.index(token):
            raise RuntimeError(f"special token {token!r} did not get id {SPECIAL_TOKENS.index(token)}")
    return tok.to_str(pretty=True)


def tokenizer_config(preset: TinyPreset) -> dict[str, Any]:
    """The ``tokenizer_config.json`` contents, loadable by transformers 4.x and 5.x."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": preset.max_position_embeddings,
        "padding_side": "right",
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, token in enumerate(SPECIAL_TOKENS)
        },
    }


def _tensor_seed(preset: str, name: str) -> int:
    digest = hashlib.sha256(f"tinkerd:{preset}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_weights(preset: TinyPreset) -> dict[str, torch.Tensor]:
    """Deterministic fp32 weights keyed by the HF parameter names of ``preset``.

    Norm weights are ones; the unembedding uses ``LM_HEAD_STD``; every other
    matrix is N(0, ``INIT_STD``).  Each tensor has its own generator seeded from
    its name, so the values never depend on iteration order or thread count.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**model_config(preset))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    weights: dict[str, torch.Tensor] = {}
    for name, meta in sorted(skeleton.state_dict().items()):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(meta.shape, dtype=torch.float32)
            continue
        std = LM_HEAD_STD if name == "lm_head.weight" else INIT_STD
        gen = torch.Generator(device="cpu").manual_seed(_tensor_seed(preset.name, name))
        weights[name] = torch.randn(meta.shape, generator=gen, dtype=torch.float32) * std
    return weights


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    os.chmod(path, FILE_MODE)


def _json_bytes(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def build_tiny(out_dir: Path, preset: str = "tiny-qwen3") -> Path:
    """Write the tiny ``preset`` model into ``out_dir`` (created if needed) and return it.

    Output files: ``config.json``, ``generation_config.json``,
    ``model.safetensors`` (fp32), ``tokenizer.json``, ``tokenizer_config.json``
    and ``chat_template.jinja``.  All are mode 0644 and byte-identical across
    builds.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny preset {preset!r}; known presets: {', '.join(sorted(PRESETS))}")
    spec = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    _write(out / "tokenizer.json", (train_tokenizer_json(spec.vocab_size) + "\n").encode())
    _write(out / "tokenizer_config.json", _json_bytes(tokenizer_config(spec)))
    _write(out / "chat_template.jinja", CHAT_TEMPLATE.encode())
    _write(out / "config.json", _json_bytes(model_config(spec)))
    _write(out / "generation_config.json", _json_bytes(generation_config()))
    from safetensors.torch import save as safetensors_save

    weights = init_weights(spec)
    _write(out / "model.safetensors", safetensors_save(weights, metadata={"format": "pt"}))
    return out
