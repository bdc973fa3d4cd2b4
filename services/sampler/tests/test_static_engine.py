"""The static-cache engine (``static_engine.py``, the sampler's CUDA path) against the same
independent float64 reference as the ``hf`` engine.

On the CPU (fp32) every test of ``test_generate.py`` and ``test_adapters.py`` runs again here
with the static engine serving (their fixtures are redefined below), plus the paths only this
engine has: rows that wait for a LoRA slot, and non-finite adapters refused at load (what keeps
one pooled adapter's values out of other rows).  On CUDA (``-k cuda``): bf16 logprobs within the
bf16 floor measured beside them, and graph-replayed decode equal to eager decode.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from litestar.testing import TestClient
from safetensors.torch import load_file, save_file

from services.sampler.app import create_app
from services.sampler.config import SamplerConfig
from services.sampler.interface import SequenceRequest
from services.sampler.static_engine import StaticCacheEngine
from services.sampler.tests.test_adapters import *  # noqa: F403  (re-run with the static engine)
from services.sampler.tests.test_adapters import greedy_body, run_held
from services.sampler.tests.test_generate import *  # noqa: F403  (re-run with the static engine)
from tests.hf_reference import HFReference

pytestmark = pytest.mark.numerics


def static_config(model_dir: Path, **kwargs: object) -> SamplerConfig:
    return SamplerConfig(model_path=str(model_dir), engine="static", **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[StaticCacheEngine]:
    eng = StaticCacheEngine(static_config(model_dir))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def client(engine: StaticCacheEngine, model_dir: Path, adapter_dirs: dict[str, Path]) -> Iterator[TestClient]:
    """The app over the static engine, with ``ad0..ad7`` and ``head`` loaded."""
    with TestClient(create_app(static_config(model_dir), engine=engine)) as test_client:
        for name, path in adapter_dirs.items():
            resp = test_client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
            assert resp.status_code == 200, resp.text
        yield test_client


@pytest.fixture(scope="module")
def small_engine(model_dir: Path) -> Iterator[StaticCacheEngine]:
    """Two LoRA slots and two rows per batch: eviction, slot reuse and join paths."""
    eng = StaticCacheEngine(static_config(model_dir, max_loaded_loras=2, max_batch_size=2))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def small_client(small_engine: StaticCacheEngine, model_dir: Path) -> Iterator[TestClient]:
    with TestClient(create_app(static_config(model_dir), engine=small_engine)) as test_client:
        yield test_client


def test_rows_wait_for_a_free_lora_slot(
    model_dir: Path, adapter_dirs: dict[str, Path], reference: HFReference
) -> None:
    """Three adapters at once on a two-slot pool with room for four rows: the third adapter's
    row is admitted only once a slot frees, and every output still equals the reference."""
    eng = StaticCacheEngine(static_config(model_dir, max_loaded_loras=2, max_batch_size=4))
    try:
        with TestClient(create_app(static_config(model_dir), engine=eng)) as test_client:
            for name in ("ad0", "ad1", "ad2"):
                resp = test_client.post(
                    "/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter_dirs[name])}
                )
                assert resp.status_code == 200, resp.text
            cases = [([11, 17, 300, 45], "ad0", 6), ([40, 5, 6], "ad1", 4), ([1200, 44, 88], "ad2", 5)]
            outs = run_held(eng, test_client, [greedy_body(p, a, n) for p, a, n in cases])
            counters = eng.counters()
        for (prompt, adapter, n), out in zip(cases, outs, strict=True):
            assert out["output_ids"] == reference.greedy(prompt, adapter, n)
        assert counters.max_prefill_batch == 2  # the third row waited for a slot
        assert counters.prefill_batches >= 2
    finally:
        eng.close()


def test_non_finite_adapters_are_refused(
    client: TestClient, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """An adapter with a NaN in one lora_B is refused at load (400, success false, the message
    names the module) and is not served."""
    src = adapter_dirs["ad0"]
    bad = tmp_path / "nan-adapter"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    tensors = load_file(str(src / "adapter_model.safetensors"))
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    resp = client.post("/load_lora_adapter", json={"lora_name": "nan", "lora_path": str(bad)})
    assert resp.status_code == 400
    body = resp.json()
    module = key.removeprefix("base_model.model.").split(".lora_B")[0]
    assert (
        body["success"] is False and "non-finite" in body["error_message"] and module in body["error_message"]
    )
    assert "nan" not in body["loaded_adapters"]


def _generate_all(config: SamplerConfig, adapters: dict[str, Path], reqs: list[SequenceRequest]) -> tuple[Any, Any]:
    """``reqs`` submitted in one call (admitted together) on a fresh engine: results, counters."""
    eng = StaticCacheEngine(config)
    try:

        async def run() -> Any:
            for name, path in adapters.items():
                await eng.load_adapter(name, str(path))
            return await eng.generate(reqs)

        return asyncio.run(run()), eng.counters()
    finally:
        eng.close()


def test_decoding_ahead_of_the_host_gives_the_rows_of_step_by_step_decoding(
    model_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    """One batch of greedy and seeded sampled rows, with adapters, top logprobs, and rows that end
    at different steps (by length, at the prefill, on a stop token while others go on), decoded
    with steps launched ahead of the host's read and step by step: the same tokens, finish
    reasons and top-logprob tokens, logprobs within 1e-4 (a step launched ahead still carries a
    row that just finished, so a batch can be one row larger than step by step: fp32 GEMMs of
    another shape), and steps really were launched ahead."""
    adapters = {name: adapter_dirs[name] for name in ("ad0", "ad1", "ad2")}
    probe = [SequenceRequest(input_ids=[3, 3, 3], max_new_tokens=9, temperature=0.0, lora_name="ad2")]
    (free,), _ = _generate_all(static_config(model_dir, decode_lookahead=False), adapters, probe)
    stop = free.output_ids[4]  # this row stops on its 5th token while the others go on
    reqs = [
        SequenceRequest(input_ids=[5, 6, 7], max_new_tokens=12, temperature=0.0, lora_name="ad0"),
        SequenceRequest(input_ids=[1, 2, 3, 4], max_new_tokens=10, temperature=0.9, top_p=0.9, seed=3, lora_name="ad1"),
        SequenceRequest(input_ids=[9, 8], max_new_tokens=7, temperature=1.0, seed=5, top_logprobs_num=3),
        SequenceRequest(input_ids=[9, 8, 7], max_new_tokens=1, temperature=0.0),
        SequenceRequest(input_ids=[3, 3, 3], max_new_tokens=9, temperature=0.0, stop_token_ids=[stop], lora_name="ad2"),
    ]
    ahead, ahead_counts = _generate_all(static_config(model_dir), adapters, reqs)
    steps, step_counts = _generate_all(static_config(model_dir, decode_lookahead=False), adapters, reqs)
    assert ahead_counts.lookahead_steps > 0 and step_counts.lookahead_steps == 0
    assert [len(r.output_ids) for r in steps] == [12, 10, 7, 1, 5]  # the endings the case meant
    for a, b in zip(ahead, steps, strict=True):
        assert (a.output_ids, a.finish_kind, a.finish_matched) == (b.output_ids, b.finish_kind, b.finish_matched)
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs, strict=True)) <= 1e-4
        for top_a, top_b in zip(a.output_top_logprobs, b.output_top_logprobs, strict=True):
            assert [t for _, t in top_a] == [t for _, t in top_b]
            assert max(abs(x - y) for (x, _), (y, _) in zip(top_a, top_b, strict=True)) <= 1e-4
    assert any(a.output_top_logprobs for a in ahead)


def test_a_full_batch_decodes_ahead_while_a_request_waits_and_the_request_joins_later(
    model_dir: Path, adapter_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two rows per batch and three requests: while the third waits for a free row, the two running
    rows still decode ahead of the host (the full batch could not admit it anyway); it joins once a
    row ends, and every row gets the tokens of step-by-step decoding."""
    launched_while_waiting = []
    launch = StaticCacheEngine._launch

    def counting(self: StaticCacheEngine, after: Any) -> Any:
        if after is not None and self._waiting:
            launched_while_waiting.append(len(self._waiting))
        return launch(self, after)

    monkeypatch.setattr(StaticCacheEngine, "_launch", counting)
    adapters = {name: adapter_dirs[name] for name in ("ad0", "ad1")}
    reqs = [
        SequenceRequest(input_ids=[5, 6, 7], max_new_tokens=4, temperature=0.0, lora_name="ad0"),
        SequenceRequest(input_ids=[1, 2, 3, 4], max_new_tokens=12, temperature=0.0, lora_name="ad1"),
        SequenceRequest(input_ids=[9, 8], max_new_tokens=6, temperature=0.0),
    ]
    small = {"max_batch_size": 2}
    ahead, ahead_counts = _generate_all(static_config(model_dir, **small), adapters, reqs)
    steps, _ = _generate_all(static_config(model_dir, decode_lookahead=False, **small), adapters, reqs)
    assert ahead_counts.prefill_joins == 1 and launched_while_waiting
    assert [r.output_ids for r in ahead] == [r.output_ids for r in steps]
    assert [len(r.output_ids) for r in ahead] == [4, 12, 6]


# ---------------------------------------------------------------- CUDA (bf16, graphs)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA_CASES = [
    ([11, 17, 300, 45, 987, 12], "ad0"),
    ([40, 5, 6], "head"),
    ([1200, 44, 88, 301, 7, 9, 1000, 64, 30, 5, 17], None),
    ([3, 99, 512, 7], "ad3"),
]


def _cuda_generate(
    model_dir: Path, adapter_dirs: dict[str, Path], graphs: bool, lookahead: bool = True
) -> list[tuple[list[int], list[float]]]:
    eng = StaticCacheEngine(
        SamplerConfig(
            model_path=str(model_dir), device="cuda", cuda_graphs=graphs, max_batch_size=8, decode_lookahead=lookahead
        )
    )
    try:

        async def run() -> list[tuple[list[int], list[float]]]:
            for name in {a for _, a in CUDA_CASES if a is not None}:
                await eng.load_adapter(name, str(adapter_dirs[name]))
            # the first row ends while the others go on: a step launched ahead carries it once
            # more, in the same batch bucket (4) as the step-by-step step without it
            reqs = [
                SequenceRequest(
                    input_ids=p, max_new_tokens=6 if i == 0 else 12, temperature=0.0, ignore_eos=True, lora_name=a
                )
                for i, (p, a) in enumerate(CUDA_CASES)
            ]
            outs = await eng.generate(reqs)
            return [(o.output_ids, o.output_logprobs) for o in outs]

        return asyncio.run(run())
    finally:
        eng.close()


@cuda
def test_cuda_bf16_logprobs_are_within_the_bf16_floor(
    model_dir: Path, adapter_dirs: dict[str, Path], reference: HFReference
) -> None:
    """Mixed adapters in one bf16 batch on CUDA (graphs on): the logprob of every generated token
    differs from the float64 reference by no more than twice what a plain HF bf16 forward (PEFT,
    no cache) of the same tokens differs from it, plus 1e-3."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    outs = _cuda_generate(model_dir, adapter_dirs, graphs=True)
    base: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, local_files_only=True)
    base = base.cuda()
    names = sorted({a for _, a in CUDA_CASES if a is not None})
    bf16 = PeftModel.from_pretrained(base, str(adapter_dirs[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        bf16.load_adapter(str(adapter_dirs[name]), adapter_name=name)
    bf16.eval()
    worst_engine, worst_hf = 0.0, 0.0
    for (prompt, adapter), (tokens, logprobs) in zip(CUDA_CASES, outs, strict=True):
        full = prompt + tokens
        ref, _ = reference.logprobs(full, adapter)
        at = (torch.arange(len(prompt) - 1, len(full) - 1), torch.tensor(tokens))
        with torch.inference_mode():
            if adapter is None:
                with bf16.disable_adapter():
                    logits = bf16(input_ids=torch.tensor([full]).cuda()).logits[0]
            else:
                bf16.set_adapter(adapter)
                logits = bf16(input_ids=torch.tensor([full]).cuda()).logits[0]
        hf = torch.log_softmax(logits.float(), dim=-1).cpu().double()
        worst_engine = max(
            worst_engine, float((torch.tensor(logprobs, dtype=torch.float64) - ref[at]).abs().max())
        )
        worst_hf = max(worst_hf, float((hf[at] - ref[at]).abs().max()))
    assert worst_engine <= 2 * worst_hf + 1e-3, (worst_engine, worst_hf)


@cuda
def test_cuda_graph_decode_equals_eager_decode(model_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    """The same mixed-adapter batch decoded with CUDA graphs and eagerly: the same tokens, and
    logprobs equal to 1e-3 (the graphs replay the same kernels on the same inputs)."""
    graphed = _cuda_generate(model_dir, adapter_dirs, graphs=True)
    eager = _cuda_generate(model_dir, adapter_dirs, graphs=False)
    for (t1, l1), (t2, l2) in zip(graphed, eager, strict=True):
        assert t1 == t2
        assert max(abs(a - b) for a, b in zip(l1, l2, strict=True)) <= 1e-3


@cuda
def test_cuda_graph_decode_ahead_of_the_host_equals_step_by_step_decode(
    model_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    """Graph-replayed steps launched ahead of the host's read (inputs from the device, results
    through pinned buffers and events) against step by step: the same tokens and logprobs to
    1e-3 (every step runs in the same batch bucket either way; the row that ended is carried
    once more by the step launched ahead, in place of a padding row)."""
    ahead = _cuda_generate(model_dir, adapter_dirs, graphs=True)
    steps = _cuda_generate(model_dir, adapter_dirs, graphs=True, lookahead=False)
    for (t1, l1), (t2, l2) in zip(ahead, steps, strict=True):
        assert t1 == t2
        assert max(abs(a - b) for a, b in zip(l1, l2, strict=True)) <= 1e-3
