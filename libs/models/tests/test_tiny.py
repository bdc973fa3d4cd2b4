"""Tests for the tiny deterministic base models and the base-model registry."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sysconfig
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from libs.checkpoints.layout import models_root
from libs.models import registry
from libs.models.registry import (
    ResolvedModel,
    UnknownBaseModel,
    ensure_tiny,
    resolve_base_model,
)
from libs.models.tiny import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    SPECIAL_TOKENS,
    build_tiny,
)

EXPECTED_FILES = {
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}


def _digests(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data dir with both presets built through ``ensure_tiny``."""
    data = tmp_path_factory.mktemp("data")
    ensure_tiny(data, "tiny-qwen3")
    ensure_tiny(data, "tiny-llama")
    return data


@pytest.fixture(scope="session")
def qwen_dir(data_dir: Path) -> Path:
    return models_root(data_dir) / "tiny-qwen3"


@pytest.fixture(scope="session")
def llama_dir(data_dir: Path) -> Path:
    return models_root(data_dir) / "tiny-llama"


@pytest.fixture(scope="session")
def tokenizer(qwen_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_dir)


# --------------------------------------------------------------------------- build


def test_build_is_byte_identical(qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    second = build_tiny(tmp_path_factory.mktemp("second") / "nested" / "out", "tiny-qwen3")
    first_digests = _digests(qwen_dir)
    assert set(first_digests) == EXPECTED_FILES
    assert _digests(second) == first_digests


def test_files_are_0644_and_free_of_paths(qwen_dir: Path, llama_dir: Path) -> None:
    for model_dir in (qwen_dir, llama_dir):
        for path in model_dir.iterdir():
            assert path.stat().st_mode & 0o777 == 0o644, path
            data = path.read_bytes()
            assert str(model_dir).encode() not in data
            assert sysconfig.get_paths()["stdlib"].encode() not in data
            assert b"transformers_version" not in data


def test_safetensors_metadata_is_minimal(qwen_dir: Path) -> None:
    raw = (qwen_dir / "model.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    assert header["__metadata__"] == {"format": "pt"}
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"F32"}


def test_presets_differ(qwen_dir: Path, llama_dir: Path) -> None:
    q, ll = _digests(qwen_dir), _digests(llama_dir)
    assert q["tokenizer.json"] == ll["tokenizer.json"]
    assert q["model.safetensors"] != ll["model.safetensors"]


def test_unknown_preset_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny-qwen3"):
        build_tiny(tmp_path, "tiny-gpt5")


# --------------------------------------------------------------------------- model


def test_config_numbers(qwen_dir: Path) -> None:
    cfg = json.loads((qwen_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    expected = {
        "model_type": "qwen3",
        "vocab_size": 2048,
        "hidden_size": 192,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 48,
        "max_position_embeddings": 2048,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
    }
    assert {k: cfg[k] for k in expected} == expected
    gen = json.loads((qwen_dir / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (
        BOS_TOKEN_ID,
        EOS_TOKEN_ID,
        PAD_TOKEN_ID,
    )


def test_hf_loads_offline_and_generates(qwen_dir: Path, tokenizer: Any) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == 2_410_560
    assert 2_000_000 < n_params < 5_000_000

    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a poem about the sea."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=32, do_sample=False)
    new_tokens = out[0, enc["input_ids"].shape[1] :].tolist()
    assert len(set(new_tokens)) >= 12, new_tokens  # greedy decoding does not collapse


def test_llama_preset_loads(llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == 2048
    assert model.config.num_key_value_heads == 2
    assert not model.config.tie_word_embeddings
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 3_000_000
    tok = AutoTokenizer.from_pretrained(llama_dir)
    assert tok.eos_token_id == model.config.eos_token_id


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_config_is_portable(qwen_dir: Path) -> None:
    cfg = json.loads((qwen_dir / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["eos_token"] == "<|im_end|>"
    assert cfg["pad_token"] == "<|pad|>"


def test_tokenizer_special_tokens(tokenizer: Any) -> None:
    assert len(tokenizer) == 2048
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tokenizer.eos_token_id == EOS_TOKEN_ID
    assert tokenizer.pad_token_id == PAD_TOKEN_ID
    assert tokenizer.bos_token_id == BOS_TOKEN_ID
    assert tokenizer.encode("hello") == tokenizer.encode("hello", add_special_tokens=False)


@pytest.mark.parametrize(
    "text",
    [
        "hello world",
        "  leading and trailing spaces  \n\ttabs\r\n",
        "héllo wörld — naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어",
        "emoji 🚀🧪👩\u200d💻 and combining e\u0301 and \u0000 nul",
        "def f(x):\n    return x ** 2  # comment",
        "<|im_start|>user\nhi<|im_end|>",
    ],
)
def test_tokenizer_round_trip(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(0 <= i < 2048 for i in ids)
    assert tokenizer.decode(ids) == text


def test_chat_template_renders_chatml(tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tokenizer.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nab<|im_end|>\n"


# --------------------------------------------------------------------------- registry


def test_models_root(tmp_path: Path) -> None:
    assert models_root(tmp_path) == tmp_path / "models"


@pytest.mark.parametrize(
    ("name", "canonical", "arch"),
    [
        ("tiny-qwen3", "tiny-qwen3", "qwen3"),
        ("tinkerd/tiny-qwen3", "tiny-qwen3", "qwen3"),
        ("tiny-llama", "tiny-llama", "llama"),
        ("tinkerd/tiny-llama", "tiny-llama", "llama"),
    ],
)
def test_resolve_names(data_dir: Path, name: str, canonical: str, arch: str) -> None:
    resolved = resolve_base_model(name, data_dir)
    assert resolved == ResolvedModel(
        name=canonical,
        path=models_root(data_dir) / canonical,
        arch=arch,
        vocab_size=2048,
        max_context=2048,
    )


def test_resolve_paths(
    qwen_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_dir: Path
) -> None:
    absolute = resolve_base_model(str(qwen_dir), tmp_path)
    assert absolute.path == qwen_dir.resolve()
    assert absolute.name == str(qwen_dir.resolve())
    assert absolute.arch == "qwen3"

    monkeypatch.setenv("HOME", str(qwen_dir.parent))
    assert resolve_base_model("~/tiny-qwen3", tmp_path).path == qwen_dir.resolve()

    monkeypatch.chdir(qwen_dir.parent)
    assert resolve_base_model("./tiny-llama", tmp_path).arch == "llama"
    assert resolve_base_model("../models/tiny-qwen3", tmp_path).path == qwen_dir.resolve()


def test_resolve_installed_directory_name(data_dir: Path, qwen_dir: Path) -> None:
    custom = models_root(data_dir) / "my-model"
    if not custom.exists():
        shutil.copytree(qwen_dir, custom)
    resolved = resolve_base_model("my-model", data_dir)
    assert (resolved.name, resolved.path, resolved.arch) == ("my-model", custom, "qwen3")


def test_unknown_names_rejected(data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UnknownBaseModel) as err:
        resolve_base_model("Qwen/Qwen3-8B", data_dir)
    assert isinstance(err.value, ValueError)
    message = str(err.value)
    for known in ("tiny-qwen3", "tiny-llama", "tinkerd/tiny-qwen3", "tinkerd/tiny-llama"):
        assert known in message
    assert "'Qwen/Qwen3-8B'" in message

    with pytest.raises(UnknownBaseModel, match="tiny-qwen3"):
        resolve_base_model("no-such-model", data_dir)
    with pytest.raises(UnknownBaseModel, match=r"config\.json"):
        resolve_base_model(str(tmp_path), data_dir)  # exists, but holds no model


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 1}))
    with pytest.raises(registry.UnsupportedArchitecture, match="gpt2"):
        resolve_base_model(str(tmp_path), tmp_path)


def test_resolve_without_building(tmp_path: Path) -> None:
    with pytest.raises(UnknownBaseModel, match="not built"):
        resolve_base_model("tiny-qwen3", tmp_path, build_missing=False)
    assert not (models_root(tmp_path) / "tiny-qwen3").exists()


def test_ensure_tiny_is_idempotent(data_dir: Path, qwen_dir: Path) -> None:
    before = _digests(qwen_dir)
    mtime = (qwen_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny(data_dir, "tiny-qwen3") == qwen_dir
    assert (qwen_dir / "model.safetensors").stat().st_mtime_ns == mtime
    assert _digests(qwen_dir) == before
    assert oct(qwen_dir.stat().st_mode & 0o777) == oct(0o755)
    assert not [p for p in models_root(data_dir).iterdir() if p.name.startswith(".")]


def test_ensure_tiny_race_loser_discards_temp(
    tmp_path: Path, qwen_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While this process builds, another one finishes first: keep the winner's copy."""
    target = models_root(tmp_path) / "tiny-qwen3"

    def racing_build(out_dir: Path, preset: str = "tiny-qwen3") -> Path:
        shutil.copytree(qwen_dir, out_dir, dirs_exist_ok=True)  # our (loser's) build
        shutil.copytree(qwen_dir, target)  # the winner lands first
        (target / "winner").write_text("yes")
        return out_dir

    monkeypatch.setattr(registry, "build_tiny", racing_build)
    assert ensure_tiny(tmp_path, "tiny-qwen3") == target
    assert (target / "winner").read_text() == "yes"
    assert sorted(p.name for p in models_root(tmp_path).iterdir()) == ["tiny-qwen3"]


def test_ensure_tiny_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_build(out_dir: Path, preset: str = "tiny-qwen3") -> Path:
        (out_dir / "partial").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setattr(registry, "build_tiny", failing_build)
    with pytest.raises(RuntimeError, match="boom"):
        ensure_tiny(tmp_path, "tiny-llama")
    assert list(models_root(tmp_path).iterdir()) == []
