"""The fused attention backends compute the per-document causal attention of the CPU ones.

flex_attention runs eagerly on CPU (forward only: torch has no CPU backward for it), so it is
checked here against ``PerDocumentSdpa`` on random packed streams and through the engine's
``logits``.  ``varlen_flash`` is CUDA-only: on CPU it must refuse clearly; its numbers (and
flex_attention's gradients) are checked where a GPU is present, and by ``bench/gpu_trainer.py``
on the H200 (docs/gpu.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.trainer.attention import (
    ATTENTION_BACKENDS,
    CUDNN_MIN_TOKENS,
    BlockDiagonalSdpa,
    FlexDocumentAttention,
    PerDocumentSdpa,
    VarlenFlashAttention,
    VarlenFlashCudnnAttention,
    _causal_sdpa,
    cudnn_attention_usable,
    document_ids,
    max_seqlen_rounded,
    one_long_document,
)
from services.trainer.engine import DatumInput, EngineConfig, LoraConfig, TrainerEngine, resolve_backend
from services.trainer.tests.helpers import ReferenceLoRAModel, random_tokens, record_causal_sdpa
from tests.numerics import U32, U64, assert_within, attention_bound

pytestmark = pytest.mark.numerics  # also run under other thread counts and CPU paths (tests/infra)


def _cfg(heads: int, groups: int, head_dim: int) -> object:
    class Cfg:
        num_attention_heads, num_query_groups, kv_channels = heads, groups, head_dim
        tensor_model_parallel_size = 1

    return Cfg()


class _Packed:
    def __init__(self, lengths: list[int], device: str = "cpu") -> None:
        self.cu_seqlens_q = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32, device=device)
        self.max_seqlen_q = max(lengths)


def _qkv(
    gen: torch.Generator, total: int, heads: int, groups: int, d: int, dtype: torch.dtype, device: str = "cpu"
) -> list[torch.Tensor]:
    return [
        torch.randn(total, h, d, generator=gen, dtype=dtype).to(device) for h in (heads, groups, groups)
    ]  # q [T, heads, d], k and v [T, groups, d]


def test_fused_backends_are_registered() -> None:
    assert ATTENTION_BACKENDS["flex_attention"] is FlexDocumentAttention
    assert ATTENTION_BACKENDS["varlen_flash"] is VarlenFlashAttention
    assert ATTENTION_BACKENDS["varlen_flash_cudnn"] is VarlenFlashCudnnAttention


def test_one_document_sdpa_layout_equals_per_document_sdpa() -> None:
    """The one-document path's layout (``[T, heads, d]`` as ``[1, heads, T, d]`` strides, key/value
    heads repeated to the query heads) computes what the per-document backend does: run here with
    SDPA's math kernel (cuDNN itself needs CUDA), float64, equal within rounding."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = _qkv(gen, 23, 6, 2, 16, torch.float64)
    want = PerDocumentSdpa(_cfg(6, 2, 16), 1, None, "self")(q, k, v, None, packed_seq_params=_Packed([23]))
    got = _causal_sdpa(q, k, v, 1.0 / 4.0, cudnn=False)
    assert got.shape == (23, 6, 16)
    torch.testing.assert_close(got.reshape(23, -1), want, rtol=1e-12, atol=1e-12)


def test_document_ids() -> None:
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    assert document_ids(cu, 9).tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("heads", "groups"), [(4, 2), (4, 4), (6, 1)])
def test_flex_matches_per_document_sdpa(dtype: torch.dtype, heads: int, groups: int) -> None:
    """Random document layouts (single tokens, one long document, many short ones)."""
    gen = torch.Generator().manual_seed(heads * 10 + groups)
    cfg = _cfg(heads, groups, 8)
    flex, ref = FlexDocumentAttention(cfg, 1, None, "self"), PerDocumentSdpa(cfg, 1, None, "self")
    u = U32 if dtype == torch.float32 else U64  # both sides round at this unit: twice one bound
    for lengths in ([5, 1, 6], [1], [17], [1, 1, 1, 1], [3, 40, 2, 1, 9]):
        q, k, v = _qkv(gen, sum(lengths), heads, groups, 8, dtype)
        packed = _Packed(lengths)
        got = flex(q, k, v, None, packed_seq_params=packed)
        want = ref(q, k, v, None, packed_seq_params=packed)
        assert got.shape == want.shape == (sum(lengths), heads * 8)
        bound = 2 * attention_bound(q, k, v, packed.cu_seqlens_q, u)
        assert_within(got, want, bound, f"lengths {lengths}")


def test_flex_unpacked_layout_matches() -> None:
    """[s, b, heads, d] without PackedSeqParams: every batch row is one causal document."""
    gen = torch.Generator().manual_seed(3)
    cfg = _cfg(4, 2, 8)
    q = torch.randn(7, 3, 4, 8, generator=gen)  # [s, b, heads, d]
    k = torch.randn(7, 3, 2, 8, generator=gen)
    v = torch.randn(7, 3, 2, 8, generator=gen)
    got = FlexDocumentAttention(cfg, 1, None, "self")(q, k, v, None)
    want = PerDocumentSdpa(cfg, 1, None, "self")(q, k, v, None)
    assert got.shape == want.shape == (7, 3, 32)
    for row in range(3):  # each batch row is one document of 7 positions
        bound = 2 * attention_bound(q[:, row], k[:, row], v[:, row], torch.tensor([0, 7]))
        assert_within(got[:, row], want[:, row], bound, f"unpacked row {row}")


def test_flex_padding_is_invisible(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path pads the stream to a multiple of 128 (pads form their own document)."""
    from services.trainer import attention

    monkeypatch.setattr(attention, "_flex_pads", lambda q: True)
    gen = torch.Generator().manual_seed(8)
    cfg = _cfg(4, 2, 8)
    lengths = [50, 1, 80]  # 131 tokens: padded to 256
    q, k, v = _qkv(gen, sum(lengths), 4, 2, 8, torch.float64)
    got = FlexDocumentAttention(cfg, 1, None, "self")(q, k, v, None, packed_seq_params=_Packed(lengths))
    want = PerDocumentSdpa(cfg, 1, None, "self")(q, k, v, None, packed_seq_params=_Packed(lengths))
    assert got.shape == want.shape
    bound = 2 * attention_bound(q, k, v, _Packed(lengths).cu_seqlens_q, U64)  # float64 on both sides
    assert_within(got, want, bound, "padded")


def test_flex_block_mask_is_built_once_per_stream() -> None:
    """Layers of one forward share the cu_seqlens tensor; the second call reuses the mask."""
    from services.trainer import attention

    gen = torch.Generator().manual_seed(4)
    cfg = _cfg(4, 2, 8)
    packed = _Packed([5, 7])
    q, k, v = _qkv(gen, 12, 4, 2, 8, torch.float32)
    FlexDocumentAttention(cfg, 1, None, "self")(q, k, v, None, packed_seq_params=packed)
    first = attention._FLEX_MASKS.mask
    FlexDocumentAttention(cfg, 2, None, "self")(q, k, v, None, packed_seq_params=packed)
    assert attention._FLEX_MASKS.mask is first
    other = _Packed([5, 7])  # equal values, new tensor: a new forward, a new mask
    FlexDocumentAttention(cfg, 1, None, "self")(q, k, v, None, packed_seq_params=other)
    assert attention._FLEX_MASKS.mask is not first


def test_varlen_refuses_cpu_tensors() -> None:
    gen = torch.Generator().manual_seed(5)
    q, k, v = _qkv(gen, 6, 4, 2, 8, torch.float32)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        VarlenFlashAttention(_cfg(4, 2, 8), 1, None, "self")(q, k, v, None, packed_seq_params=_Packed([6]))


def test_engine_logits_with_flex_match_default(qwen_dir: Path, engines: dict[str, TrainerEngine]) -> None:
    """A whole packed forward through megatron with flex_attention equals the default backend:
    both within fp32 rounding of the float64 HF forward of each document."""
    default = engines["tiny-qwen3"]
    flex = TrainerEngine(
        EngineConfig(str(qwen_dir), num_slots=4, max_lora_rank=8, attention_backend="flex_attention")
    )
    rng = np.random.default_rng(11)
    docs = [random_tokens(rng, n)[0] for n in (9, 1, 14, 5)]
    hf = ReferenceLoRAModel(qwen_dir)
    with torch.no_grad():
        expected = [(hf.logits(d), hf.logit_bound(len(d))) for d in docs]
    for engine in (default, flex):
        engine.init_slot(0, LoraConfig(rank=4, seed=0))
    try:
        want = default.logits([DatumInput(0, d) for d in docs])
        got = flex.logits([DatumInput(0, d) for d in docs])
        for i, (g, w, (ref, bound)) in enumerate(zip(got, want, expected, strict=True)):
            assert_within(w, ref, bound, f"default backend, doc {i}")
            assert_within(g, ref, bound, f"flex_attention, doc {i}")
            assert_within(g, w, 2 * bound, f"flex_attention vs default, doc {i}")
    finally:
        default.release_slot(0)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("backend", ["varlen_flash", "varlen_flash_cudnn", "flex_attention"])
def test_fused_backend_forward_backward_on_cuda(backend: str) -> None:
    """bf16 output and q/k/v gradients within bf16 error of the fp32 per-document reference."""
    gen = torch.Generator().manual_seed(6)
    cfg = _cfg(8, 2, 64)
    lengths = [100, 1, 300, 110]  # 511 tokens: flex_attention pads to 512
    packed = _Packed(lengths, "cuda")
    ref_in = [x.requires_grad_() for x in _qkv(gen, sum(lengths), 8, 2, 64, torch.float32, "cuda")]
    grad_out = torch.randn(sum(lengths), 8 * 64, generator=gen).cuda()
    want = PerDocumentSdpa(cfg, 1, None, "self")(*ref_in, None, packed_seq_params=packed)
    want_grads = torch.autograd.grad(want, ref_in, grad_out)
    inputs = [x.detach().bfloat16().requires_grad_() for x in ref_in]
    got = ATTENTION_BACKENDS[backend](cfg, 1, None, "self")(*inputs, None, packed_seq_params=packed)
    grads = torch.autograd.grad(got, inputs, grad_out.bfloat16())
    for g, w in zip([got, *grads], [want, *want_grads], strict=True):
        rel = float(torch.linalg.vector_norm(g.double() - w.double()) / torch.linalg.vector_norm(w.double()))
        assert rel < 2e-2, rel


@needs_cuda
def test_cuda_a_long_one_document_stream_runs_through_cudnn_within_bf16_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``varlen_flash_cudnn`` on a stream that is one document of ``CUDNN_MIN_TOKENS`` tokens (32
    query heads of 128, 8 key/value groups, as Qwen3-8B): cuDNN is usable on this GPU, the stream
    goes through it (one call of the cuDNN path), and its bf16 output and q/k/v gradients are
    within bf16 error of the fp32 reference."""
    assert cudnn_attention_usable(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16, 128)
    cudnn_calls = record_causal_sdpa(monkeypatch)
    gen = torch.Generator().manual_seed(9)
    cfg = _cfg(32, 8, 128)
    packed = _Packed([CUDNN_MIN_TOKENS], "cuda")
    ref_in = [x.requires_grad_() for x in _qkv(gen, CUDNN_MIN_TOKENS, 32, 8, 128, torch.float32, "cuda")]
    grad_out = torch.randn(CUDNN_MIN_TOKENS, 32 * 128, generator=gen).cuda()
    want = PerDocumentSdpa(cfg, 1, None, "self")(*ref_in, None, packed_seq_params=packed)
    want_grads = torch.autograd.grad(want, ref_in, grad_out)
    inputs = [x.detach().bfloat16().requires_grad_() for x in ref_in]
    got = VarlenFlashCudnnAttention(cfg, 1, None, "self")(*inputs, None, packed_seq_params=packed)
    grads = torch.autograd.grad(got, inputs, grad_out.bfloat16())
    for g, w in zip([got, *grads], [want, *want_grads], strict=True):
        rel = float(torch.linalg.vector_norm(g.double() - w.double()) / torch.linalg.vector_norm(w.double()))
        assert rel < 2e-2, rel
    assert cudnn_calls == [True]


def test_the_trainers_attention_setting_picks_its_engines_backend_and_an_unknown_one_fails_its_start(
    qwen_dir: Path, tmp_path: Path
) -> None:
    """``TINKERD_TRAINER_ATTENTION_BACKEND`` reaches the engine the trainer builds (every layer's
    core attention is that backend); an unknown name fails the build with an error naming it and
    the known ones."""
    from services.trainer.config import load_config
    from services.trainer.service import build_engine

    env = {"TINKERD_BASE_MODEL": str(qwen_dir), "TINKERD_DATA_DIR": str(tmp_path)}
    config = load_config({**env, "TINKERD_TRAINER_ATTENTION_BACKEND": "sdpa_block_diagonal"})
    engine, _ = build_engine(config, "cpu")
    kinds = {type(layer.self_attention.core_attention) for layer in engine.model.decoder.layers}
    assert kinds == {BlockDiagonalSdpa}
    with pytest.raises(ValueError, match=r"unknown attention backend 'nope'; known: .*varlen_flash_cudnn"):
        build_engine(load_config({**env, "TINKERD_TRAINER_ATTENTION_BACKEND": "nope"}), "cpu")


def test_auto_backend_is_sdpa_on_cpu_and_cudnn_assisted_varlen_on_cuda() -> None:
    """`auto` is per-document SDPA on CPU and FlashAttention-2 with cuDNN for one long document on
    CUDA; a named backend is kept as named."""
    assert resolve_backend("auto", "cpu") == "sdpa_per_document"
    assert resolve_backend("auto", "cuda") == "varlen_flash_cudnn"
    assert resolve_backend("flex_attention", "cuda") == "flex_attention"


def test_only_an_exact_max_seqlen_equal_to_the_stream_makes_one_long_document() -> None:
    """A stream is one document for cuDNN where its max_seqlen, the longest document's length,
    equals its length and reaches CUDNN_MIN_TOKENS; never under ``max_seqlen_rounded``, where a
    static step's rounded bound can equal the length of a stream of several documents."""
    n = CUDNN_MIN_TOKENS
    assert one_long_document(n, n) and one_long_document(2 * n, 2 * n)
    assert not one_long_document(n - 1, n) and not one_long_document(n // 2, n // 2)
    with max_seqlen_rounded():
        assert not one_long_document(n, n)
    assert one_long_document(n, n)
