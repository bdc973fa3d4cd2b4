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


# ---------------------------------------------------------------- CUDA (bf16, graphs)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA_CASES = [
    ([11, 17, 300, 45, 987, 12], "ad0"),
    ([40, 5, 6], "head"),
    ([1200, 44, 88, 301, 7, 9, 1000, 64, 30, 5, 17], None),
    ([3, 99, 512, 7], "ad3"),
]


def _cuda_generate(
    model_dir: Path, adapter_dirs: dict[str, Path], graphs: bool
) -> list[tuple[list[int], list[float]]]:
    eng = StaticCacheEngine(
        SamplerConfig(model_path=str(model_dir), device="cuda", cuda_graphs=graphs, max_batch_size=8)
    )
    try:

        async def run() -> list[tuple[list[int], list[float]]]:
            for name in {a for _, a in CUDA_CASES if a is not None}:
                await eng.load_adapter(name, str(adapter_dirs[name]))
            reqs = [
                SequenceRequest(input_ids=p, max_new_tokens=12, temperature=0.0, ignore_eos=True, lora_name=a)
                for p, a in CUDA_CASES
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
