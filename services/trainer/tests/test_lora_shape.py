"""Tinker's LoRA shape: one LoRA pair per projection, so the parameter count is the cookbook's.

The Tinker cookbook's ``hyperparam_utils.get_lora_param_count`` (the table its learning-rate
recipes are tuned with) counts ``rank * (in + out)`` for every adapted HF projection. Each
supported architecture (``libs.models.registry.SUPPORTED_ARCHS``) is checked at the sizes of
every model of it in the cookbook's table, and the registry's own tiny presets against the same
per-projection formula evaluated on their Hugging Face modules.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tinker_cookbook.hyperparam_utils import get_lora_param_count

from libs.contracts.common import LoraConfig
from libs.models.registry import SUPPORTED_ARCHS
from services.trainer.convert import ModelShape, split_glu, split_qkv
from services.trainer.engine import TrainerEngine
from services.trainer.lora import AdapterPool, Segment, grouped_mm_supported, lora_scaling
from services.trainer.tests.helpers import ce_datum, randomize_slot
from tests.numerics import U32

# Sizes from each model's published config.json (dense models of the supported architectures
# that the cookbook's table lists; its MoE and other architectures are not served here).
_CONFIGS: dict[str, dict[str, object]] = {
    "Qwen/Qwen3-4B-Instruct-2507": dict(
        model_type="qwen3", num_hidden_layers=36, hidden_size=2560, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "Qwen/Qwen3-8B": dict(
        model_type="qwen3", num_hidden_layers=36, hidden_size=4096, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "Qwen/Qwen3-32B": dict(
        model_type="qwen3", num_hidden_layers=64, hidden_size=5120, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, intermediate_size=25600, vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "meta-llama/Llama-3.2-1B": dict(
        model_type="llama", num_hidden_layers=16, hidden_size=2048, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "meta-llama/Llama-3.2-3B": dict(
        model_type="llama", num_hidden_layers=28, hidden_size=3072, num_attention_heads=24,
        num_key_value_heads=8, head_dim=128, intermediate_size=8192, vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "meta-llama/Llama-3.1-8B": dict(
        model_type="llama", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "meta-llama/Llama-3.1-70B": dict(
        model_type="llama", num_hidden_layers=80, hidden_size=8192, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, intermediate_size=28672, vocab_size=128256,
        tie_word_embeddings=False,
    ),
}  # fmt: skip

_FLAGS = [f for f in itertools.product((False, True), repeat=3) if any(f)]  # (attn, mlp, unembed)


def _trained_count(pool: AdapterPool, slot: int) -> int:
    """Values the slot trains: every tensor the optimizer steps and a checkpoint saves."""
    return sum(t.value().numel() for t in pool.slot_tensors(slot))


Grads = dict[tuple[int, str], torch.Tensor]


def _step(
    engine: TrainerEngine, batch: list, slots: Iterable[int], stacked: bool, forward_only: bool = False
) -> tuple[np.ndarray, Grads]:
    """One ``forward_backward`` of ``batch`` (through the grouped matmuls where ``stacked``): its
    log-probabilities and a float32 CPU copy of each of ``slots``' gradients, then discarded."""
    engine.pool.routing.stacked = stacked
    try:
        outs = engine.forward_backward(batch, "cross_entropy", forward_only=forward_only)
    finally:
        engine.pool.routing.stacked = False
    grads = {
        (slot, k): v.detach().to("cpu", torch.float32, copy=True)
        for slot in slots
        for k, v in engine.get_slot_grads(slot).items()
    }
    for slot in slots:
        engine.discard_grads(slot)
    return np.concatenate([o.logprobs for o in outs]), grads


def _slot_error(grads: Grads, ref: Grads, slot: int) -> tuple[float, float]:
    """The norm of ``slot``'s gradient error against ``ref`` with all its tensors as one vector
    (single entries are bf16 noise), and the norm of that reference vector."""
    keys = [key for key in ref if key[0] == slot]
    want = torch.cat([ref[key].flatten() for key in keys])
    got = torch.cat([grads[key].flatten() for key in keys])
    return float(torch.linalg.vector_norm(got - want)), float(torch.linalg.vector_norm(want))


def test_every_supported_architecture_is_checked() -> None:
    """The table below covers every architecture the registry serves."""
    assert {str(c["model_type"]) for c in _CONFIGS.values()} == set(SUPPORTED_ARCHS)


@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_parameter_count_is_the_cookbooks(name: str, engines: dict[str, TrainerEngine]) -> None:
    """A slot of rank 32 (in a pool of max rank 64) trains exactly
    ``get_lora_param_count(name, 32, train_mlp, train_attn, train_unembed)`` values, for every
    combination of the three module groups. (``engines``: megatron's parallel state is set up.)"""
    shape = ModelShape.from_hf_config(SimpleNamespace(**_CONFIGS[name]))
    pool = AdapterPool(shape, num_slots=1, max_rank=64, device="meta")  # shapes only, no memory
    for attn, mlp, unembed in _FLAGS:
        pool.routing.configs[0] = LoraConfig(rank=32, seed=0, train_attn=attn, train_mlp=mlp, train_unembed=unembed)
        want = get_lora_param_count(name, 32, train_mlp=mlp, train_attn=attn, train_unembed=unembed)
        assert _trained_count(pool, 0) == want, (name, attn, mlp, unembed)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_tiny_presets_count_rank_times_in_plus_out_per_projection(
    preset: str, engines: dict[str, TrainerEngine], model_dirs: dict[str, Path]
) -> None:
    """The registry's tiny models: the saved state and the PEFT export both hold
    ``rank * (in + out)`` values per HF projection (q, k, v, o, gate, up, down, lm_head), the sizes
    read from the Hugging Face model's own ``nn.Linear`` modules."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dirs[preset]), dtype=torch.float32)
    leaves = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
    per_rank = sum(
        m.in_features + m.out_features
        for n, m in hf.named_modules()
        if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in leaves
    )
    engine = engines[preset]
    engine.init_slot(0, LoraConfig(rank=5, seed=3))
    try:
        state = engine.get_slot_state(0)
        tensors, _ = engine.export_peft(0)
        assert sum(t.numel() for t in state.adapter.values()) == 5 * per_rank
        assert sum(t.numel() for t in tensors.values()) == 5 * per_rank
    finally:
        engine.release_slot(0)


def test_peft_export_is_a_pure_split_with_one_a_per_projection(engine: TrainerEngine) -> None:
    """Each exported projection's ``lora_A`` is its own part of the fused ``A`` and its ``lora_B``
    its own rows of the fused ``B`` (de-interleaved like the base weights), bit for bit; q, k and v
    (and gate and up) start from different draws and are trained apart."""
    state = randomize_slot(engine, 0, LoraConfig(rank=4, seed=1), seed=1)
    rng = np.random.default_rng(3)
    engine.forward_backward([ce_datum(rng, 0, 6)], "cross_entropy")
    grads = engine.get_slot_grads(0)
    engine.init_slot(1, LoraConfig(rank=4, seed=1))
    init = engine.get_slot_state(1).adapter
    tensors, _ = engine.export_peft(0)
    pre, mg = "base_model.model.model.layers.1.", "decoder.layers.1."
    qkv_a, fc1_a = state.adapter[f"{mg}self_attention.linear_qkv.lora_A"], state.adapter[f"{mg}mlp.linear_fc1.lora_A"]
    assert qkv_a.shape == (3, 4, engine.shape.hidden_size) and fc1_a.shape == (2, 4, engine.shape.hidden_size)
    q_b, k_b, v_b = split_qkv(state.adapter[f"{mg}self_attention.linear_qkv.lora_B"], engine.shape)
    gate_b, up_b = split_glu(state.adapter[f"{mg}mlp.linear_fc1.lora_B"])
    expected = {
        "self_attn.q_proj": (qkv_a[0], q_b),
        "self_attn.k_proj": (qkv_a[1], k_b),
        "self_attn.v_proj": (qkv_a[2], v_b),
        "mlp.gate_proj": (fc1_a[0], gate_b),
        "mlp.up_proj": (fc1_a[1], up_b),
    }
    for module, (a, b) in expected.items():
        assert torch.equal(tensors[f"{pre}{module}.lora_A.weight"], a), module
        assert torch.equal(tensors[f"{pre}{module}.lora_B.weight"], b), module
    for fused in ("self_attention.linear_qkv", "mlp.linear_fc1"):
        for table in (init, grads):
            parts = table[f"{mg}{fused}.lora_A"]
            assert all(not torch.equal(parts[i], parts[j]) for i, j in itertools.combinations(range(len(parts)), 2))


@pytest.mark.parametrize("path", ["single", "per-segment", "stacked"])
@pytest.mark.parametrize("module", ["self_attention.linear_qkv", "self_attention.linear_proj"])
def test_a_bf16_forward_scales_b_in_fp32(engine: TrainerEngine, module: str, path: str) -> None:
    """In a bf16 forward the scaling ``alpha / rank`` is applied to ``B`` in float32, never
    rounded to bf16: with integer activations (exact in bf16) ``B``'s gradient is
    ``fl32(32/3) * (an exact integer)`` to float32 rounding, where a bf16-rounded scaling
    (10.6875) would be 0.2% off. Holds on each LoRA path (one slot; several per segment; stacked)."""
    scale = lora_scaling(3)
    assert abs(float(torch.tensor(scale, dtype=torch.bfloat16)) / scale - 1) > 1e-3  # the test can tell
    if path == "stacked":
        assert grouped_mm_supported(torch.zeros(1, dtype=torch.bfloat16))
    pool = engine.pool
    adapter = pool.adapter(f"decoder.layers.0.{module}")
    gen = torch.Generator().manual_seed(0)
    engine.init_slot(0, LoraConfig(rank=3, seed=1))
    engine.init_slot(1, LoraConfig(rank=2, seed=2))
    with torch.no_grad():
        adapter.lora_A.copy_(torch.randint(-2, 3, adapter.lora_A.shape, generator=gen).float())
        adapter.lora_A[0, :, 3:] = 0  # past each slot's rank: zero
        adapter.lora_A[1, :, 2:] = 0
        adapter.lora_B.fill_(1.0)
    tokens, width = 12, adapter.lora_A.shape[-1]
    x = torch.zeros(tokens, 1, width, dtype=torch.bfloat16)
    x[torch.arange(tokens), 0, torch.arange(tokens) * 7 % width] = 1  # one-hot rows: A x exact
    seg = 8 if path != "single" else tokens
    routing = pool.routing
    routing.segments = [Segment(0, 0, seg)] + ([Segment(1, seg, tokens)] if seg < tokens else [])
    routing.stacked = path == "stacked"
    try:
        base = torch.zeros(tokens, 1, adapter.lora_B.shape[1], dtype=torch.bfloat16)
        out = adapter.adapt(x, base)
        assert out is not base
        out.float().sum().backward()
    finally:
        routing.segments, routing.stacked = [], False
    assert adapter.lora_B.grad is not None
    grad = adapter.lora_B.grad[0, :, :3]  # [out, 3]
    # d(sum of outputs)/dB[o, c] = scale * sum over slot 0's tokens of (A_p(o) x)[c]: integers
    a = adapter.lora_A[0, :, :3].double()  # [parts, 3, in]
    h = torch.einsum("pri,ti->tpr", a, x[:seg, 0].double()).sum(0)  # [parts, 3]
    parts = torch.zeros(grad.shape[0], dtype=torch.int64)
    if adapter.part_mask is not None:
        parts = adapter.part_mask.long().argmax(1)
    exact = h[parts]  # [out, 3]
    want = torch.tensor(scale, dtype=torch.float32).double() * exact
    assert bool((exact != 0).any())
    assert float((grad.double() - want).abs().max()) <= U32 * float(want.abs().max())
    for param in (adapter.lora_A, adapter.lora_B):
        assert param.grad is not None
        param.grad.zero_()  # in place: the grads are views of the pool's rows


def test_the_grouped_matmul_probe_answers_alike_inside_a_forward_only_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-time probe of ``torch._grouped_mm`` runs a backward: made first inside a
    forward-only call (no grad, inference mode) it still finds the CPU's grouped matmul usable,
    so a forward-only first batch never turns the grouped path off for the process."""
    from services.trainer import lora

    monkeypatch.setattr(lora.GROUPED_MM, "verdicts", {})
    with torch.inference_mode():
        assert lora.grouped_mm_supported(torch.zeros(1))
    monkeypatch.setattr(lora.GROUPED_MM, "verdicts", {})
    with torch.no_grad():
        assert lora.grouped_mm_supported(torch.zeros(1))


_CUDA_SLOTS = {0: LoraConfig(rank=8, seed=1), 1: LoraConfig(rank=4, seed=2), 2: LoraConfig(rank=8, seed=3, train_mlp=False)}


def _cuda_engines(qwen_dir: Path, seed: int) -> tuple[TrainerEngine, TrainerEngine]:
    """A bf16 CUDA engine (its default attention) and a float32 one (``sdpa_per_document``:
    FlashAttention takes no fp32), both eager, with the same random adapters in ``_CUDA_SLOTS``
    (slot 2 without MLP adapters: its segments read the all-zero row there)."""
    from services.trainer.engine import EngineConfig

    engines = []
    for dtype, backend in ((torch.bfloat16, "auto"), (torch.float32, "sdpa_per_document")):
        config = EngineConfig(
            str(qwen_dir), num_slots=4, max_lora_rank=8, device="cuda", dtype=dtype, attention_backend=backend,
            step_graphs=False,
        )  # fmt: skip
        engine = TrainerEngine(config)
        for slot, lora_config in _CUDA_SLOTS.items():
            randomize_slot(engine, slot, lora_config, seed=seed + slot)
        engines.append(engine)
    return engines[0], engines[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_the_grouped_lora_path_is_as_close_to_fp32_as_the_per_segment_path(qwen_dir: Path) -> None:
    """One eager step of three slots' five documents (slot 2 without MLP adapters: its segments
    read the all-zero row there) on a bf16 CUDA engine, through the grouped matmuls (the second
    factor adding the base output as it writes, rounded once) and through one small matmul per
    segment, each against the same step of a float32 engine: the grouped path's largest
    logprob error is at most twice the per-segment path's, and the error of each slot's
    gradients (all its tensors as one vector) at most 1.5 times (each plus 1e-3 of the
    reference's size). Two bf16 paths that round differently are compared through
    the exact-er reference, not with each other."""
    cuda, fp32 = _cuda_engines(qwen_dir, seed=50)
    configs = _CUDA_SLOTS
    rng = np.random.default_rng(3)
    batch = [ce_datum(rng, slot, n) for slot, n in ((2, 40), (0, 64), (1, 24), (2, 16), (0, 8))]

    ref_lp, ref_grads = _step(fp32, batch, configs, stacked=False)
    seg_lp, seg_grads = _step(cuda, batch, configs, stacked=False)
    grouped_lp, grouped_grads = _step(cuda, batch, configs, stacked=True)
    lp_scale = float(np.abs(ref_lp).max())
    assert np.abs(grouped_lp - ref_lp).max() <= 2 * np.abs(seg_lp - ref_lp).max() + 1e-3 * lp_scale
    for slot in configs:
        (seg_error, size), (grouped_error, _) = (_slot_error(g, ref_grads, slot) for g in (seg_grads, grouped_grads))
        assert grouped_error <= 1.5 * seg_error + 1e-3 * size, slot


def _count_calls(monkeypatch: pytest.MonkeyPatch, function: type) -> list[str]:
    """Every forward and backward of the autograd ``function`` from here on, in order."""
    calls: list[str] = []
    forward, backward = function.forward, function.backward  # type: ignore[attr-defined]

    def counted_forward(ctx: object, *args: object) -> object:
        calls.append("forward")
        return forward(ctx, *args)

    def counted_backward(ctx: object, g: torch.Tensor) -> object:
        calls.append("backward")
        return backward(ctx, g)

    monkeypatch.setattr(function, "forward", staticmethod(counted_forward))
    monkeypatch.setattr(function, "backward", staticmethod(counted_backward))
    return calls


def test_a_one_slot_step_forms_every_needed_input_gradient_inside_the_adapted_linear(
    engine: TrainerEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of one slot: each adapted linear whose input needs a gradient (all but the first
    layer's qkv, whose input comes from the frozen embedding) runs as ``_AdaptedLinear``, forward
    and backward once per step; a step of two slots, and a forward-only call, never do."""
    from services.trainer import lora

    calls = _count_calls(monkeypatch, lora._AdaptedLinear)
    engine.init_slot(0, LoraConfig(rank=4, seed=1))
    engine.init_slot(1, LoraConfig(rank=4, seed=2))
    rng = np.random.default_rng(0)
    needed = 4 * engine.shape.num_layers  # every adapted linear (and the output layer) but one
    engine.forward_backward([ce_datum(rng, 0, 9), ce_datum(rng, 0, 5)], "cross_entropy")
    assert calls.count("forward") == needed and calls.count("backward") == needed
    calls.clear()
    engine.forward_backward([ce_datum(rng, 0, 9), ce_datum(rng, 1, 5)], "cross_entropy")
    engine.forward_backward([ce_datum(rng, 0, 9)], "cross_entropy", forward_only=True)
    assert calls == []
    for slot in (0, 1):
        engine.discard_grads(slot)


def test_a_grouped_step_forms_every_needed_input_gradient_inside_the_grouped_node(
    engine: TrainerEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of three slots through the grouped matmuls (``routing.stacked``; slot 2 without
    MLP adapters): each adapted linear whose input needs a gradient runs as
    ``_GroupedAdaptedLinear``, forward and backward once, and its log-probabilities and every
    slot's gradients equal the per-segment path's (autograd adding the base and LoRA input
    gradients) within fp32 rounding: 1e-5 of each tensor's largest entry."""
    from services.trainer import lora

    configs = {0: LoraConfig(rank=4, seed=1), 1: LoraConfig(rank=2, seed=2), 2: LoraConfig(rank=4, seed=3, train_mlp=False)}
    for slot, config in configs.items():
        randomize_slot(engine, slot, config, seed=30 + slot)
    rng = np.random.default_rng(4)
    batch = [ce_datum(rng, slot, n) for slot, n in ((2, 7), (0, 9), (1, 5), (0, 4))]

    want_lp, want_grads = _step(engine, batch, configs, stacked=False)
    calls = _count_calls(monkeypatch, lora._GroupedAdaptedLinear)
    got_lp, got_grads = _step(engine, batch, configs, stacked=True)
    needed = 4 * engine.shape.num_layers
    assert calls.count("forward") == needed and calls.count("backward") == needed
    np.testing.assert_allclose(got_lp, want_lp, rtol=1e-5, atol=1e-5)
    for key, want in want_grads.items():
        assert float((got_grads[key] - want).abs().max()) <= 1e-5 * float(want.abs().max()), key


def test_the_base_product_in_the_lora_gemms_epilogue_matches_the_frozen_linears_path(
    engine: TrainerEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``base_in_epilogue`` (CUDA's default) forced on the CPU: every adapted linear of a one-slot
    and of a grouped step of three slots, forward_only included, computes its base product itself
    (``_AdaptedLinear`` / ``_GroupedAdaptedLinear`` once per linear and call, the first layer's
    qkv too), and the log-probabilities and every slot's gradients equal the frozen linear's path
    within fp32 rounding (1e-5 of each tensor's largest entry); forward_only's log-probabilities
    equal forward_backward's bit for bit."""
    from services.trainer import lora

    configs = {0: LoraConfig(rank=4, seed=1), 1: LoraConfig(rank=2, seed=2), 2: LoraConfig(rank=4, seed=3, train_mlp=False)}
    for slot, config in configs.items():
        randomize_slot(engine, slot, config, seed=40 + slot)
    rng = np.random.default_rng(5)
    one_slot = [ce_datum(rng, 0, 9), ce_datum(rng, 0, 5)]
    grouped = [ce_datum(rng, slot, n) for slot, n in ((2, 7), (0, 9), (1, 5), (0, 4))]

    wants = [_step(engine, batch, configs, stacked=True) for batch in (one_slot, grouped)]
    monkeypatch.setattr(lora, "BASE_IN_EPILOGUE_DEVICES", frozenset({"cuda", "cpu"}))
    one_calls = _count_calls(monkeypatch, lora._AdaptedLinear)
    grouped_calls = _count_calls(monkeypatch, lora._GroupedAdaptedLinear)
    linears = 4 * engine.shape.num_layers + 1  # and the output layer
    for batch, (want_lp, want_grads), calls in zip((one_slot, grouped), wants, (one_calls, grouped_calls), strict=True):
        got_lp, got_grads = _step(engine, batch, configs, stacked=True)
        assert calls.count("forward") == linears and calls.count("backward") == linears
        np.testing.assert_allclose(got_lp, want_lp, rtol=1e-5, atol=1e-5)
        for key, want in want_grads.items():
            assert float((got_grads[key] - want).abs().max()) <= 1e-5 * float(want.abs().max()), key
        calls.clear()
        only_lp, _ = _step(engine, batch, configs, stacked=True, forward_only=True)
        assert calls.count("forward") == linears
        np.testing.assert_array_equal(only_lp, got_lp)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_the_base_product_in_the_epilogue_is_as_close_to_fp32_as_the_frozen_linears(
    qwen_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-slot step and a grouped step of three slots on a bf16 CUDA engine, with
    ``base_in_epilogue`` (the default) and without (the frozen linears' products), each against
    the same step of a float32 engine: with it, the largest logprob error is at most twice the
    frozen linears' and each slot's gradient error (its tensors as one vector) at most 1.5 times
    (each plus 1e-3 of the reference's size), and forward_only's log-probabilities equal
    forward_backward's bit for bit."""
    from services.trainer import lora

    cuda, fp32 = _cuda_engines(qwen_dir, seed=60)
    configs = _CUDA_SLOTS
    rng = np.random.default_rng(7)
    batches = [
        [ce_datum(rng, 0, n) for n in (64, 40, 24)],
        [ce_datum(rng, slot, n) for slot, n in ((2, 40), (0, 64), (1, 24), (2, 16), (0, 8))],
    ]

    for batch in batches:
        ref_lp, ref_grads = _step(fp32, batch, configs, stacked=True)
        monkeypatch.setattr(lora, "BASE_IN_EPILOGUE_DEVICES", frozenset())
        separate_lp, separate_grads = _step(cuda, batch, configs, stacked=True)
        monkeypatch.setattr(lora, "BASE_IN_EPILOGUE_DEVICES", frozenset({"cuda"}))
        got_lp, got_grads = _step(cuda, batch, configs, stacked=True)
        only_lp, _ = _step(cuda, batch, configs, stacked=True, forward_only=True)
        monkeypatch.undo()
        np.testing.assert_array_equal(only_lp, got_lp)
        scale = float(np.abs(ref_lp).max())
        assert np.abs(got_lp - ref_lp).max() <= 2 * np.abs(separate_lp - ref_lp).max() + 1e-3 * scale
        for slot in {d.slot for d in batch}:
            (separate_error, size), (error, _) = (_slot_error(g, ref_grads, slot) for g in (separate_grads, got_grads))
            assert error <= 1.5 * separate_error + 1e-3 * size, slot


def test_a_forward_failing_inside_a_base_linear_leaves_no_activations_held(
    engine: TrainerEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that fails inside a frozen linear, after its adapter's pre_hook kept the input for
    the hook that never runs (out of memory, say): once the call has raised, no adapter holds an
    input (nor, through it, the failed step's autograd graph), and the next step's
    log-probabilities equal those of the same step before the failure, bit for bit."""
    randomize_slot(engine, 0, LoraConfig(rank=4, seed=1), seed=50)
    rng = np.random.default_rng(6)
    batch = [ce_datum(rng, 0, 9), ce_datum(rng, 0, 5)]
    before = np.concatenate([o.logprobs for o in engine.forward_backward(batch, "cross_entropy", forward_only=True)])
    fc1 = engine.model.decoder.layers[1].mlp.linear_fc1

    def out_of_memory(*args: object, **kwargs: object) -> object:
        assert engine.pool.routing.handed_inputs, "the pre_hook kept this linear's input"
        raise RuntimeError("out of memory")

    monkeypatch.setattr(fc1, "forward", out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.forward_backward(batch, "cross_entropy")
    assert engine.pool.routing.handed_inputs == {}
    monkeypatch.undo()
    after = np.concatenate([o.logprobs for o in engine.forward_backward(batch, "cross_entropy", forward_only=True)])
    np.testing.assert_array_equal(after, before)
    engine.discard_grads(0)
