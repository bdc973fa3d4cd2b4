"""A multi-tenant SDK workload, an event watcher to time faults, and the checks the fault tests share."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tinker
from safetensors.numpy import load_file
from tinker import types

from infra.bus import Bus
from libs.contracts import subjects as s

TENANTS = 3
STEPS = 4


def _result(value):  # type: ignore[no-untyped-def]
    return value.result() if hasattr(value, "result") else value


def datum(tenant: int, step: int, index: int) -> types.Datum:
    rng = np.random.default_rng(1000 * tenant + 10 * step + index)
    tokens = rng.integers(4, 2000, size=12).tolist()
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64)), "weights": types.TensorData.from_numpy(np.ones(11, dtype=np.float32))},
    )


@dataclass
class TenantRun:
    tenant: int
    final_path: str = ""
    model_id: str = ""
    samples: int = 0
    error: BaseException | None = None


def run_tenant(base_url: str, run: TenantRun) -> None:
    try:
        client = tinker.ServiceClient(base_url=base_url, api_key=f"tml-fault-tenant-{run.tenant}")
        trainer = _result(client.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=100 + run.tenant))
        run.model_id = trainer.model_id
        for step in range(STEPS):
            fb = trainer.forward_backward([datum(run.tenant, step, 0), datum(run.tenant, step, 1)], "cross_entropy")
            opt = trainer.optim_step(types.AdamParams(learning_rate=1e-2))
            fb.result()
            opt.result()
            if step == 1:
                sampler = _result(trainer.save_weights_and_get_sampling_client())
                prompt = types.ModelInput.from_ints([5, 6, 7])
                out = sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=4, temperature=0.0)).result()
                run.samples += len(out.sequences)
        run.final_path = trainer.save_state("final").result().path
    except BaseException as exc:
        run.error = exc


def run_workload(base_url: str) -> list[TenantRun]:
    runs = [TenantRun(t) for t in range(TENANTS)]
    threads = [threading.Thread(target=run_tenant, args=(base_url, r)) for r in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return runs


@dataclass
class EventTrigger:
    """Calls `action` once, from a background thread, when the n-th event of `kind` is seen."""

    nats_url: str
    kind: str
    n: int
    action: Callable[[], None]
    fired: threading.Event = field(default_factory=threading.Event)
    counts: Counter[str] = field(default_factory=Counter)
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> EventTrigger:
        subscribed = threading.Event()

        async def main() -> None:
            bus = await Bus.connect(self.nats_url, "fault-trigger")

            async def on_event(msg) -> None:  # type: ignore[no-untyped-def]
                kind = msg.subject.split(".")[2]
                self.counts[kind] += 1
                if kind == self.kind and self.counts[kind] == self.n:
                    threading.Thread(target=self._fire, daemon=True).start()

            await bus.nc.subscribe(s.EVENTS_ALL, cb=on_event)
            await bus.nc.flush()
            subscribed.set()
            await asyncio.get_running_loop().run_in_executor(None, self._stop.wait)
            await bus.close()

        self._thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
        self._thread.start()
        subscribed.wait(30)
        return self

    def _fire(self) -> None:
        self.action()
        self.fired.set()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)


def checkpoint_digests(data_dir: Path, tinker_path: str) -> dict[str, str]:
    """sha256 of every tensor of a save_state checkpoint, plus its step counter."""
    from libs.checkpoints import layout

    run, _segment, name = tinker_path.removeprefix("tinker://").split("/")
    directory = layout.resolve(layout.public_path(data_dir, run, "training", name))
    assert directory is not None, f"{tinker_path} is not reachable"
    out = {"step": str(json.loads((directory / "state.json").read_text())["step"])}
    for file in ("adapter.safetensors", "optimizer.safetensors"):
        for key, value in load_file(str(directory / file)).items():
            out[f"{file}:{key}"] = hashlib.sha256(value.tobytes()).hexdigest()
    return out


def clean_replay_digests(data_dir: Path, nats_url: str) -> dict[str, dict[str, str]]:
    """Execute the recorded plan once, uninterrupted, in a fresh trainer; digests per model."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.faults.replay_check", str(data_dir), nats_url],
        capture_output=True, text=True, check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


async def results_published_once(nats_url: str) -> tuple[int, int]:
    """(messages ever appended to the results stream, messages kept): equal iff no result was replaced."""
    bus = await Bus.connect(nats_url, "fault-check")
    try:
        info = await bus.js.stream_info(s.STREAM_RESULTS)
        return info.state.last_seq, info.state.messages
    finally:
        await bus.close()
