"""Session fixtures: the tiny Qwen3 model, random PEFT adapters, engines and a PEFT reference."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from litestar.testing import TestClient
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from libs.models.tiny import build_tiny
from services.sampler.app import create_app
from services.sampler.config import SamplerConfig
from services.sampler.engine import HFEngine
from tests.hf_reference import HFReference

ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_NAMES = [f"ad{i}" for i in range(8)]


def make_adapter(
    base_dir: Path, out_dir: Path, *, seed: int, rank: int, targets: list[str], use_rslora: bool = False
) -> Path:
    """Save a PEFT LoRA with random (non-zero) A and B, so it changes the model's outputs."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0, use_rslora=use_rslora
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    peft_model.save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny") / "tiny-qwen3", preset="tiny-qwen3")


@pytest.fixture(scope="session")
def adapter_dirs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Eight attention+MLP adapters ``ad0..ad7`` plus ``head`` (rsLoRA, also on lm_head)."""
    root = tmp_path_factory.mktemp("adapters")
    dirs = {
        name: make_adapter(model_dir, root / name, seed=100 + i, rank=4 + 2 * i, targets=ATTN_MLP)
        for i, name in enumerate(ADAPTER_NAMES)
    }
    dirs["head"] = make_adapter(
        model_dir, root / "head", seed=7, rank=8, targets=[*ATTN_MLP, "lm_head"], use_rslora=True
    )
    return dirs


@pytest.fixture(scope="session")
def reference(model_dir: Path, adapter_dirs: dict[str, Path]) -> HFReference:
    return HFReference(model_dir, adapter_dirs)


@pytest.fixture(scope="session")
def engine(model_dir: Path) -> Iterator[HFEngine]:
    eng = HFEngine(SamplerConfig(model_path=str(model_dir)))
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def client(engine: HFEngine, model_dir: Path, adapter_dirs: dict[str, Path]) -> Iterator[TestClient]:
    """The app over the shared engine, with ``ad0..ad7`` and ``head`` loaded."""
    app = create_app(SamplerConfig(model_path=str(model_dir)), engine=engine)
    with TestClient(app) as test_client:
        for name, path in adapter_dirs.items():
            resp = test_client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
            assert resp.status_code == 200, resp.text
        yield test_client


@pytest.fixture(scope="module")
def small_engine(model_dir: Path) -> Iterator[HFEngine]:
    """Two adapters resident at most and two rows per batch: eviction and join paths."""
    eng = HFEngine(SamplerConfig(model_path=str(model_dir), max_loaded_loras=2, max_batch_size=2))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def small_client(small_engine: HFEngine, model_dir: Path) -> Iterator[TestClient]:
    with TestClient(create_app(SamplerConfig(model_path=str(model_dir)), engine=small_engine)) as test_client:
        yield test_client
