"""The megatron model is the HF model: same logits (packed or not), lossless conversion."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.trainer.attention import BlockDiagonalSdpa, PerDocumentSdpa
from services.trainer.convert import ShardKind, shard, unshard
from services.trainer.engine import DatumInput, LoraConfig, TrainerEngine
from services.trainer.model import export_hf_state_dict, read_hf_state_dict
from services.trainer.tests.helpers import ReferenceLoRAModel, random_tokens
from tests.numerics import assert_within, attention_bound

pytestmark = pytest.mark.numerics  # also run under other thread counts and CPU paths (tests/infra)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_packed_logits_match_hf_per_document(
    preset: str, engines: dict[str, TrainerEngine], model_dirs: dict[str, Path]
) -> None:
    """A packed batch of 3 documents gives each document the logits HF gives it alone (HF in
    float64; bound: fp32 rounding of the forward, ``tests.numerics``)."""
    engine = engines[preset]
    engine.init_slot(0, LoraConfig(rank=4, seed=0))  # B = 0: the adapter adds exactly nothing
    try:
        rng = np.random.default_rng(1)
        docs = [random_tokens(rng, n)[0] for n in (7, 13, 4)]
        hf = ReferenceLoRAModel(model_dirs[preset])
        with torch.no_grad():
            expected = [(hf.logits(d), hf.logit_bound(len(d))) for d in docs]  # each [N, V]
        packed = engine.logits([DatumInput(0, d) for d in docs])
        single = engine.logits([DatumInput(0, docs[1])])
        for i, (got, (want, bound)) in enumerate(zip(packed, expected, strict=True)):
            assert got.shape == want.shape
            assert_within(got, want, bound, f"{preset} doc {i}")
        assert_within(single[0], expected[1][0], expected[1][1], f"{preset} alone")
    finally:
        engine.release_slot(0)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_megatron_to_hf_round_trips_exactly(
    preset: str, engines: dict[str, TrainerEngine], model_dirs: dict[str, Path]
) -> None:
    """HF -> megatron -> HF reproduces every checkpoint tensor bit for bit."""
    original = read_hf_state_dict(model_dirs[preset])
    exported = export_hf_state_dict(engines[preset].model, engines[preset].shape)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("kind", list(ShardKind))
def test_shard_unshard_round_trip(kind: ShardKind) -> None:
    """Cutting a full tensor into TP shards and re-assembling it is lossless."""
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    for size in (1, 2):
        parts = [shard(full, kind, r, size) for r in range(size)]
        assert torch.equal(unshard(parts, kind), full)


def test_attention_backends_agree() -> None:
    """Per-document SDPA and the block-diagonal mask compute the same packed attention."""

    class Cfg:
        num_attention_heads, num_query_groups, kv_channels, tensor_model_parallel_size = 4, 2, 8, 1

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(12, 4, 8, generator=gen)  # [T, heads, d]
    k = torch.randn(12, 2, 8, generator=gen)  # [T, groups, d]
    v = torch.randn(12, 2, 8, generator=gen)  # [T, groups, d]

    class Packed:
        cu_seqlens_q = torch.tensor([0, 5, 6, 12], dtype=torch.int32)

    outs = [
        cls(Cfg(), 1, None, "self")(q, k, v, None, packed_seq_params=Packed())
        for cls in (PerDocumentSdpa, BlockDiagonalSdpa)
    ]
    # two fp32 computations of the same attention: twice the bound of one
    bound = 2 * attention_bound(q, k, v, Packed.cu_seqlens_q)
    assert_within(outs[0], outs[1], bound, "block-diagonal vs per-document")
    # The first token of each document sees only itself.
    assert_within(outs[0][5].reshape(4, 8), v[5].repeat_interleave(2, dim=0), bound[5].reshape(4, 8) / 2, "first")
