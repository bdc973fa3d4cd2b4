"""The decode step's kernels (``decode_ops``, Triton on CUDA) against float64 torch references,
and the CUDA engine's fused decode path end to end.

Op tests draw fresh random bf16 inputs, poison what a kernel must not read, and hold the kernel
to ``‖out − ref‖ / ‖ref‖`` within a bf16 bound against the float64 torch function (the same
function the CPU path runs).  Isolation: rows of one LoRA slot are computed only from that
slot's matrices, rows of slot ``-1`` only from the base, whatever the other slots hold (NaN
included: the kernels never read a slot no row of the output uses).  The engine tests: the
NaN adapter refused at load, and a batch of mixed adapters where NaN in the unused slots and a
change of one row's adapter leave every other row's output bit-identical.  (The fused path's
logprobs against the float64 reference within the bf16 floor, and graph replay against eager
decoding, are ``test_static_engine.py``'s CUDA tests, which now run this path.)
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest
import torch

from services.sampler import decode_ops as ops
from services.sampler.config import SamplerConfig
from services.sampler.interface import SequenceRequest
from services.sampler.lora import AdapterError
from services.sampler.static_engine import StaticCacheEngine

cuda = pytest.mark.skipif(ops.triton is None or not torch.cuda.is_available(), reason="needs CUDA and Triton")
BF16_BOUND = 1e-2


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    return float((out - ref).norm() / ref.norm())


def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


@cuda
@pytest.mark.parametrize("batch", [1, 5, 64])
def test_cuda_rms_norm_with_residual_matches_float64(batch: int) -> None:
    """The residual is a folded projection's base columns: rows strided."""
    x, res, w = rnd(batch, 4096), rnd(batch, 4096 + 768)[:, :4096], rnd(4096)
    h, total = ops.rms_norm(x, w, 1e-6, res)
    ref_h, ref_total = ops.rms_norm_torch(x.double(), w.double(), 1e-6, res.double())
    assert rel(total, ref_total) < BF16_BOUND and rel(h, ref_h) < BF16_BOUND


@cuda
@pytest.mark.parametrize(
    ("batch", "slots_used", "span"),
    [(1, 1, 8), (5, 3, 8), (8, 8, 8), (16, 5, 8), (17, 5, 8), (64, 8, 8), (64, 3, 8), (1, 1, 1), (64, 3, 4)],
)
def test_cuda_lora_matches_float64_and_rows_read_only_their_slot(batch: int, slots_used: int, span: int) -> None:
    """q/k/v-shaped group: 8 slots of rank 32, their ``A`` folded under the base weight; rows use
    ``slots_used`` of them, some rows none. The unused slots hold NaN: no output row may see them.
    The kernel takes a slot's rows in tiles of ``GROUP_ROWS``: 16 and 17 rows of 5 slots and 64
    rows of 3 fill one tile or several. ``span`` < 8: the GEMM reads only the first ``span``
    slots' ``A`` rows (the engine's step whose rows all use lower slots)."""
    n_slots, rank, k_in, bounds = 8, 32, 4096, [0, 4096, 5120, 6144]
    out = bounds[-1]
    w = rnd(out, k_in, scale=k_in**-0.5)
    a = rnd(n_slots, 3 * rank, k_in, scale=k_in**-0.5)
    b = rnd(n_slots, out, rank, scale=0.05)
    slots = torch.arange(batch, device="cuda") % slots_used
    slots[::4] = -1  # every fourth row without an adapter
    unused = [s for s in range(n_slots) if s not in set(slots.tolist())]
    a[unused], b[unused] = float("nan"), float("nan")
    x = rnd(batch, k_in)
    folded = torch.nn.functional.linear(x, torch.cat([w, a[:span].flatten(0, 1)]))  # (batch, out + span * 3r)
    base = folded[:, :out].clone()
    y = ops.add_lora(folded, out, b, slots, bounds, r_total=3 * rank)
    ref = x.double() @ w.double().t()
    for i, slot in enumerate(slots.tolist()):  # row by row, its own slot's A and B in float64
        if slot >= 0:
            for j, (lo, hi) in enumerate(itertools.pairwise(bounds)):
                h = a[slot, j * rank : (j + 1) * rank].double() @ x[i].double()
                ref[i, lo:hi] += b[slot, lo:hi].double() @ h
    assert rel(y, ref) < BF16_BOUND
    assert torch.equal(y[slots < 0], base[slots < 0])  # no adapter: the base output, untouched


@cuda
@pytest.mark.parametrize("qk_norm", [True, False])
def test_cuda_qk_rope_cache_matches_float64(qk_norm: bool) -> None:
    batch, heads, kv, d, columns = 6, 32, 8, 128, 300
    qkv = rnd(batch, (heads + 2 * kv) * d)
    qw, kw = (rnd(d), rnd(d)) if qk_norm else (None, None)
    angle = torch.rand(batch, d // 2, device="cuda") * 6.28
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(torch.bfloat16)
    sin = torch.cat([angle.sin(), angle.sin()], -1).to(torch.bfloat16)
    positions = torch.randint(0, columns, (batch,), device="cuda")
    k_cache = torch.full((batch + 2, kv, columns, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    v_cache = k_cache.clone()
    q = ops.qk_rope_cache(qkv, qw, kw, 1e-6, cos, sin, k_cache, v_cache, positions, heads, kv)
    double = lambda t: t.double() if t is not None else None  # noqa: E731
    rq, rk, _ = ops.qk_heads_torch(
        qkv.double()[:, None],
        double(qw),
        double(kw),
        1e-6,
        cos.double()[:, None],
        sin.double()[:, None],
        heads,
        kv,
    )
    rows = torch.arange(batch, device="cuda")
    assert rel(q, rq[:, :, 0]) < BF16_BOUND
    assert rel(k_cache[rows, :, positions], rk[:, :, 0]) < BF16_BOUND
    assert torch.equal(v_cache[rows, :, positions], qkv[:, (heads + kv) * d :].reshape(batch, kv, d))
    k_cache[rows, :, positions] = 0
    assert torch.isnan(k_cache[rows]).sum() == batch * kv * (columns - 1) * d  # nothing else written


def _row_lora(batch: int, out: int, bounds: list[int], rank: int = 32, n_slots: int = 8) -> tuple[torch.Tensor, ops.RowLora]:
    """A folded projection's output (batch, out + n_slots * members * rank) and its ``RowLora``:
    rows use slots 0, 2 and 5 or none; every other slot's ``B`` and ``x A^T`` columns are NaN."""
    members = len(bounds) - 1
    r_total = members * rank
    y = rnd(batch, out + n_slots * r_total)
    b = rnd(n_slots, out, rank, scale=0.05)
    slots = torch.tensor([0, 2, 5, -1, 0, 5, 2, 2, -1][:batch], device="cuda")
    for s in range(n_slots):
        if s not in set(slots.tolist()):
            b[s] = float("nan")
            y[:, out + s * r_total : out + (s + 1) * r_total] = float("nan")
    return y, ops.RowLora(b, slots, out, bounds, r_total)


def _with_term_float64(y: torch.Tensor, lora: ops.RowLora) -> torch.Tensor:
    """The base columns plus each row's own slot's term, row by row in float64."""
    rank = lora.b.shape[2]
    ref = y[:, : lora.out].double().clone()
    for i, slot in enumerate(lora.slots.tolist()):
        if slot >= 0:
            for j, (lo, hi) in enumerate(itertools.pairwise(lora.bounds)):
                start = lora.out + slot * lora.r_total + j * rank
                ref[i, lo:hi] += lora.b[slot, lo:hi].double() @ y[i, start : start + rank].double()
    return ref


@cuda
@pytest.mark.parametrize("batch", [1, 9])
def test_cuda_qk_rope_cache_adding_each_rows_lora_term_matches_float64(batch: int) -> None:
    """The q/k/v projection's LoRA term added inside the RoPE kernel (``RowLora``): q, k and v
    against float64 with each row's own slot; NaN in every unused slot reaches no row, and rows
    without an adapter equal the kernel run on the base columns alone, bit for bit."""
    heads, kv, d, columns = 32, 8, 128, 64
    out = (heads + 2 * kv) * d
    y, lora = _row_lora(batch, out, [0, heads * d, (heads + kv) * d, out])
    qw, kw = rnd(d), rnd(d)
    angle = torch.rand(batch, d // 2, device="cuda") * 6.28
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(torch.bfloat16)
    sin = torch.cat([angle.sin(), angle.sin()], -1).to(torch.bfloat16)
    positions = torch.randint(0, columns, (batch,), device="cuda")
    rows = torch.arange(batch, device="cuda")

    def run(qkv: torch.Tensor, row_lora: ops.RowLora | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k_cache = torch.zeros(batch, kv, columns, d, device="cuda", dtype=torch.bfloat16)
        v_cache = k_cache.clone()
        q = ops.qk_rope_cache(qkv, qw, kw, 1e-6, cos, sin, k_cache, v_cache, positions, heads, kv, row_lora)
        return q, k_cache[rows, :, positions], v_cache[rows, :, positions]

    q, k, v = run(y, lora)
    full = _with_term_float64(y, lora)
    rq, rk, rv = ops.qk_heads_torch(
        full[:, None], qw.double(), kw.double(), 1e-6, cos.double()[:, None], sin.double()[:, None], heads, kv
    )
    assert rel(q, rq[:, :, 0]) < BF16_BOUND and rel(k, rk[:, :, 0]) < BF16_BOUND and rel(v, rv[:, :, 0]) < BF16_BOUND
    plain = run(y[:, :out], None)
    none = lora.slots < 0
    assert all(torch.equal(got[none], want[none]) for got, want in zip((q, k, v), plain, strict=True))


@cuda
@pytest.mark.parametrize("batch", [1, 9])
def test_cuda_silu_mul_adding_each_rows_lora_term_matches_float64(batch: int) -> None:
    """The gate/up projection's LoRA term added inside ``silu_mul``: against float64 with each
    row's own slot; NaN in every unused slot reaches no row; rows without an adapter equal the
    kernel on the base columns alone, bit for bit."""
    n = 12288
    y, lora = _row_lora(batch, 2 * n, [0, n, 2 * n])
    act = ops.silu_mul(y, lora)
    assert rel(act, ops.silu_mul_torch(_with_term_float64(y, lora))) < BF16_BOUND
    none = lora.slots < 0
    assert torch.equal(act[none], ops.silu_mul(y[:, : 2 * n])[none])


@cuda
@pytest.mark.parametrize("window", [256, 1024])
def test_cuda_decode_attention_matches_float64_and_reads_only_filled_columns(window: int) -> None:
    batch, heads, kv, d = 7, 32, 8, 128
    q = rnd(batch, heads, d)
    k_cache, v_cache = rnd(batch + 1, kv, window, d), rnd(batch + 1, kv, window, d)
    lengths = torch.tensor([1, 2, 63, 64, 65, window // 2, window], device="cuda")
    for row, n in enumerate(lengths.tolist()):  # columns past a row's length: poison
        k_cache[row, :, n:], v_cache[row, :, n:] = float("nan"), float("nan")
    o = ops.decode_attention(q, k_cache, v_cache, lengths, d**-0.5, window)
    clean_k, clean_v = k_cache.nan_to_num(0.0).double(), v_cache.nan_to_num(0.0).double()
    ref = ops.decode_attention_torch(q.double(), clean_k, clean_v, lengths, d**-0.5, window)
    assert rel(o, ref) < BF16_BOUND


@cuda
def test_cuda_silu_mul_matches_float64() -> None:
    gu = rnd(9, 2 * 12288 + 512)[:, : 2 * 12288]  # a folded projection's base columns: rows strided
    assert rel(ops.silu_mul(gu), ops.silu_mul_torch(gu.double())) < BF16_BOUND


# ---------------------------------------------------------------- the engine, fused decode path

CASES = [
    ([11, 17, 300, 45, 987, 12], "ad0"),
    ([40, 5, 6], "head"),
    ([1200, 44, 88, 301, 7, 9, 1000, 64, 30, 5, 17], None),
    ([3, 99, 512, 7], "ad3"),
    ([8, 8, 1900, 2], "ad5"),
]


def _generate(
    model_dir: Path,
    adapter_dirs: dict[str, Path],
    cases: list[tuple[list[int], str | None]],
    poison: bool = False,
) -> list[tuple[list[int], list[float]]]:
    """Greedy outputs of ``cases`` in one batch (graphs on); ``poison``: every LoRA slot the
    batch does not use holds NaN."""
    eng = StaticCacheEngine(SamplerConfig(model_path=str(model_dir), device="cuda", max_batch_size=8))
    try:
        names = sorted({a for _, a in cases if a is not None})
        if poison:
            with torch.inference_mode():
                for group in eng._pool.groups.values():
                    group.a[len(names) :] = float("nan")
                    group.b[len(names) :] = float("nan")

        async def run() -> list[tuple[list[int], list[float]]]:
            for name in names:
                await eng.load_adapter(name, str(adapter_dirs[name]))
            reqs = [
                SequenceRequest(input_ids=p, max_new_tokens=16, temperature=0.0, ignore_eos=True, lora_name=a)
                for p, a in cases
            ]
            return [(o.output_ids, o.output_logprobs) for o in await eng.generate(reqs)]

        return asyncio.run(run())
    finally:
        eng.close()


@cuda
def test_cuda_mixed_adapters_are_isolated_and_a_nan_adapter_is_refused(
    model_dir: Path, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """A NaN adapter cannot be loaded.  In a mixed batch: NaN in every slot no row uses changes
    no output (bit for bit), and changing one row's adapter changes that row and no other."""
    from safetensors.torch import load_file, save_file

    src = adapter_dirs["ad0"]
    bad = tmp_path / "nan"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    tensors = load_file(str(src / "adapter_model.safetensors"))
    key = next(k for k in sorted(tensors) if "lora_A" in k)
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    eng = StaticCacheEngine(SamplerConfig(model_path=str(model_dir), device="cuda", max_batch_size=8))
    try:
        with pytest.raises(AdapterError, match="non-finite"):
            asyncio.run(eng.load_adapter("nan", str(bad)))
    finally:
        eng.close()
    clean = _generate(model_dir, adapter_dirs, CASES)
    assert _generate(model_dir, adapter_dirs, CASES, poison=True) == clean
    swapped = _generate(model_dir, adapter_dirs, [(CASES[0][0], "ad7"), *CASES[1:]])
    assert swapped[0] != clean[0]
    assert swapped[1:] == clean[1:]


def test_lora_term_from_a_slot_span_equals_the_term_from_every_slot() -> None:
    """CPU (the torch twin): a folded output holding only the first ``span`` slots' ``x A^T``
    columns (a step whose rows all use lower slots) gives every row exactly the output of the
    one holding every slot's; rows without an adapter get the base columns."""
    gen = torch.Generator().manual_seed(0)
    n_slots, rank, out, bounds = 8, 4, 48, [0, 32, 40, 48]
    r_total = 3 * rank
    y = torch.randn(6, 1, out + n_slots * r_total, generator=gen)
    b = torch.randn(n_slots, out, rank, generator=gen)
    slots = torch.tensor([0, 2, -1, 3, 1, 3])
    full = ops.lora_expand_torch(y, out, b, slots, bounds)
    span = ops.lora_expand_torch(y[..., : out + 4 * r_total].clone(), out, b, slots, bounds, r_total)
    assert torch.equal(span, full)
    assert torch.equal(full[2], y[2, :, :out])
