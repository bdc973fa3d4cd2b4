"""The sampler loads an adapter from another process's memory (`/load_lora_adapter_from_tensors`).

A real second process hands a PEFT adapter over exactly as the trainer does
(`services.trainer.handover.Handover`: one shared-memory segment, described as SGLang's route
reads it); the sampler's real app loads it. Checked against the same adapter loaded from its
directory by the same engine, and for what must be refused: memory the sender has let go of, a
payload that names anything but torch's tensor reductions, and a non-finite adapter. A refused
load leaves nothing registered under its name.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from litestar.testing import TestClient
from safetensors.torch import load_file, save_file

from bench.common import random_peft_adapter
from libs.contracts import codec
from libs.contracts.publish import AdapterHandover
from libs.models.tiny import build_tiny
from services.sampler.app import create_app
from services.sampler.config import SamplerConfig
from services.sampler.engine import HFEngine

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [11, 17, 300, 45, 987, 12]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny") / "tiny-qwen3", preset="tiny-qwen3")


@pytest.fixture(scope="module")
def adapter_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_peft_adapter(model_dir, tmp_path_factory.mktemp("adapter") / "a", seed=5, rank=8)


@pytest.fixture(scope="module")
def client(model_dir: Path) -> Iterator[TestClient]:
    engine = HFEngine(SamplerConfig(model_path=str(model_dir)))
    with TestClient(create_app(SamplerConfig(model_path=str(model_dir)), engine=engine)) as test_client:
        yield test_client
    engine.close()


@pytest.fixture(scope="module")
def cuda_client(model_dir: Path) -> Iterator[TestClient]:
    """The sampler's CUDA engine (static cache, bf16), for handovers from device memory."""
    from services.sampler.static_engine import StaticCacheEngine

    config = SamplerConfig(model_path=str(model_dir), engine="static", device="cuda")
    engine = StaticCacheEngine(config)
    with TestClient(create_app(config, engine=engine)) as test_client:
        yield test_client
    engine.close()


class Producer:
    """The handing-over process (tests/integration/handover_producer.py)."""

    def __init__(self, directory: Path, device: str = "cpu") -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.handover_producer", str(directory), device],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.ref = codec.from_json(self.proc.stdout.readline().encode(), AdapterHandover)

    def release(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "released"

    def close(self) -> None:
        """Release (unless done) and end the process."""
        assert self.proc.stdin is not None
        if self.proc.poll() is None:
            self.proc.stdin.write("\n\n")
            self.proc.stdin.flush()
        self.proc.wait(timeout=60)


def load_tensors(client: TestClient, name: str, ref: AdapterHandover, payload: str | None = None) -> Any:
    body = {"lora_name": name, "config_dict": ref.config, "serialized_named_tensors": [payload or ref.tensors]}
    return client.post("/load_lora_adapter_from_tensors", json=body)


def assert_refused_and_not_registered(client: TestClient, response: Any, name: str, reason: str) -> None:
    """A 400 whose message says `reason`, and nothing serves under `name`."""
    assert response.status_code == 400
    assert reason in response.json()["error_message"]
    assert name not in client.get("/server_info").json()["loaded_lora_adapters"]


def greedy(client: TestClient, adapter: str | None) -> dict[str, Any]:
    body = {
        "input_ids": PROMPT,
        "lora_path": adapter,
        "return_logprob": True,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 8},
    }
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


@pytest.mark.parametrize("device", DEVICES)
def test_an_adapter_handed_over_from_another_process_samples_as_its_directory_does(
    request: pytest.FixtureRequest, adapter_dir: Path, device: str
) -> None:
    """Loaded from the sender's memory (a shared-memory segment into the CPU engine, or CUDA IPC
    handles into its device memory, into the CUDA engine), the adapter gives the same tokens and
    logprobs as the same adapter loaded from its directory, and the engine reports it as loaded
    from tensors."""
    client: TestClient = request.getfixturevalue("client" if device == "cpu" else "cuda_client")
    producer = Producer(adapter_dir, device)
    try:
        assert producer.ref.device == device
        response = load_tensors(client, f"from-{device}-memory", producer.ref)
        assert response.status_code == 200, response.text
        assert response.json()["loaded_adapters"][f"from-{device}-memory"] == "__tensor__"
    finally:
        producer.close()  # the engine holds its own copy: the sender may go
    loaded = client.post("/load_lora_adapter", json={"lora_name": f"files-{device}", "lora_path": str(adapter_dir)})
    assert loaded.status_code == 200, loaded.text
    from_memory, from_files = greedy(client, f"from-{device}-memory"), greedy(client, f"files-{device}")
    assert from_memory["output_ids"] == from_files["output_ids"]
    assert from_memory["meta_info"]["output_token_logprobs"] == from_files["meta_info"]["output_token_logprobs"]
    assert from_memory["output_ids"] != greedy(client, None)["output_ids"], "the adapter changed nothing"


def test_memory_the_sender_let_go_of_is_refused_and_nothing_is_registered(
    client: TestClient, adapter_dir: Path
) -> None:
    producer = Producer(adapter_dir)
    try:
        producer.release()
        response = load_tensors(client, "released", producer.ref)
    finally:
        producer.close()
    assert_refused_and_not_registered(client, response, "released", "cannot be opened here")


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.getcwd, ())


def test_a_payload_naming_anything_but_tensor_reductions_is_refused_before_it_runs(
    client: TestClient, adapter_dir: Path
) -> None:
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    payload = base64.b64encode(pickle.dumps({"x": _Evil()})).decode()
    ref = AdapterHandover(config=config, tensors=payload, host="", device="cpu", nbytes=0)
    refused = "may only use torch's tensor reductions, not posix.getcwd"
    assert_refused_and_not_registered(client, load_tensors(client, "evil", ref), "evil", refused)
    not_base64 = load_tensors(client, "evil", ref, payload="not base64!")
    assert_refused_and_not_registered(client, not_base64, "evil", "base64")


def test_a_non_finite_adapter_handed_over_is_refused(
    client: TestClient, adapter_dir: Path, tmp_path: Path
) -> None:
    poisoned = tmp_path / "nan"
    poisoned.mkdir()
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    first = sorted(tensors)[0]
    tensors[first] = tensors[first].clone()
    tensors[first][0, 0] = torch.nan
    save_file(tensors, str(poisoned / "adapter_model.safetensors"))
    (poisoned / "adapter_config.json").write_text((adapter_dir / "adapter_config.json").read_text())
    producer = Producer(poisoned)
    try:
        response = load_tensors(client, "nan", producer.ref)
    finally:
        producer.close()
    assert_refused_and_not_registered(client, response, "nan", "non-finite")


def test_a_handover_loads_while_the_engine_is_held_inside_a_decode_step(
    model_dir: Path, adapter_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's worker is held inside a decode step of a running generation; an adapter
    handed over meanwhile is loaded and registered all the same (a load does not wait for the
    worker, so it never stalls decoding), and the held generation then completes."""
    import asyncio
    import threading

    from services.sampler.interface import SequenceRequest

    engine = HFEngine(SamplerConfig(model_path=str(model_dir)))
    entered, release = threading.Event(), threading.Event()
    original = engine._decode_step

    def held_step() -> None:
        if not release.is_set():
            entered.set()
            release.wait(timeout=120)
        original()

    monkeypatch.setattr(engine, "_decode_step", held_step)
    outputs: list[Any] = []
    request = SequenceRequest(input_ids=PROMPT, max_new_tokens=4, temperature=0.0, ignore_eos=True)
    generation = threading.Thread(target=lambda: outputs.extend(asyncio.run(engine.generate([request]))))
    producer = Producer(adapter_dir)
    try:
        generation.start()
        assert entered.wait(timeout=120), "the generation never reached a decode step"
        asyncio.run(engine.load_adapter_tensors("mid-step", producer.ref.config, producer.ref.tensors))
        assert not release.is_set() and generation.is_alive(), "the worker was not held during the load"
        assert engine.adapters()["mid-step"] == "__tensor__"
    finally:
        release.set()
        producer.close()
        generation.join(timeout=120)
        engine.close()
    assert len(outputs) == 1 and len(outputs[0].output_ids) == 4
