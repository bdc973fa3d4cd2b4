"""Session fixtures: tiny models built once, megatron imported once, one engine per preset."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.trainer.engine import EngineConfig, TrainerEngine

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from libs.models.tiny import build_tiny

    root = tmp_path_factory.mktemp("tiny-models")
    return {preset: build_tiny(root / preset, preset=preset) for preset in ("tiny-qwen3", "tiny-llama")}


@pytest.fixture(scope="session")
def qwen_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["tiny-qwen3"]


@pytest.fixture(scope="session")
def engines(model_dirs: dict[str, Path]) -> dict[str, TrainerEngine]:
    return {
        preset: TrainerEngine(EngineConfig(str(path), num_slots=4, max_lora_rank=8))
        for preset, path in model_dirs.items()
    }


def _released(engine: TrainerEngine) -> Iterator[TrainerEngine]:
    yield engine
    for slot in range(engine.config.num_slots):
        engine.release_slot(slot)


@pytest.fixture
def engine(engines: dict[str, TrainerEngine]) -> Iterator[TrainerEngine]:
    """The tiny-qwen3 engine (4 slots, max rank 8); every slot is released after the test."""
    yield from _released(engines["tiny-qwen3"])


@pytest.fixture
def llama_engine(engines: dict[str, TrainerEngine]) -> Iterator[TrainerEngine]:
    yield from _released(engines["tiny-llama"])


@pytest.fixture(scope="session")
def _engine64(qwen_dir: Path) -> TrainerEngine:
    import torch

    return TrainerEngine(EngineConfig(str(qwen_dir), num_slots=2, max_lora_rank=8, dtype=torch.float64))


@pytest.fixture
def engine64(_engine64: TrainerEngine) -> Iterator[TrainerEngine]:
    """A float64 tiny-qwen3 engine: isolates summation order from fp32 rounding noise."""
    yield from _released(_engine64)
