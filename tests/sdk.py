"""The SDK-level test workload: datums, and the seeded multi-tenant workload of the fault tests.

Datums: `datum` (next-token cross-entropy on given tokens), `seeded_datum` (random tokens from a
seed), `json_datum` (the same as an HTTP body) and `tenant_datum` (the workload's own).

The workload: every tenant is a thread with its own SDK client. A tenant's calls and data depend
only on its index (LoRA seed, datums, learning rate), never on time, model ids or the other
tenants, so the same workload on two separate stacks must give the same results bit for bit (CPU
fp32; packing tenants together does not change a tenant's numbers: docs/semantics.md §3). That is
the independent reference: the fault-free run of the same workload on a stack of its own. What a
run records per tenant: a digest of every call's result in call order (forward_backward losses
and logprobs, optim_step metrics, sampled tokens) and the digests of its final checkpoint
(adapter, AdamW moments, step); `differences` compares two runs.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tinker
from safetensors.numpy import load_file
from tinker import types

TENANTS = 3  # in each fault scenario
REFERENCE_TENANTS = 4  # in the reference run (the chaos soak runs 4; tenants are independent)
STEPS = 4
SAMPLE_AT = 1  # the step after which each tenant saves for sampling and samples once
STALL_S = 300.0  # a call that has no result after this long is stalled (and fails the run)
CLOSE_S = 60.0  # how long ServiceClient.close() may take
LEARNING_RATE = 1e-2


def _result(value):  # type: ignore[no-untyped-def]
    return value.result(timeout=STALL_S) if hasattr(value, "result") else value


def datum(tokens: list[int]) -> types.Datum:
    """Next-token cross-entropy on `tokens`: input all but the last, targets all but the first, weight 1."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64)),
            "weights": types.TensorData.from_numpy(np.ones(len(tokens) - 1, dtype=np.float32)),
        },
    )


def seeded_datum(seed: int, size: int) -> types.Datum:
    """`datum` of `size` tokens drawn from [4, 2000) by a generator seeded with `seed`."""
    return datum(np.random.default_rng(seed).integers(4, 2000, size=size).tolist())


def json_datum(tokens: list[int]) -> dict[str, Any]:
    """`datum` as the JSON body of the HTTP API (for raw-HTTP tests)."""
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens[:-1]}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": tokens[1:], "dtype": "int64"},
            "weights": {"data": [1.0] * (len(tokens) - 1), "dtype": "float32"},
        },
    }


def tenant_datum(tenant: int, step: int, index: int) -> types.Datum:
    """The workload's `index`-th datum of `tenant` at `step` (12 tokens; a function of the three only)."""
    return seeded_datum(1000 * tenant + 10 * step + index, 12)


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()[:16]


def fb_digest(out: types.ForwardBackwardOutput) -> str:
    parts = [repr(sorted(out.metrics.items())).encode()]
    for record in out.loss_fn_outputs:
        parts += [np.asarray(record["logprobs"].to_numpy(), dtype="<f4").tobytes()]
    return _digest(*parts)


@dataclass
class TenantRun:
    tenant: int
    calls: list[tuple[str, str]] = field(default_factory=list)  # (call, digest of its result), in order
    final: dict[str, str] = field(default_factory=dict)  # digests of the final checkpoint
    model_id: str = ""
    error: BaseException | None = None
    stalled: str = ""  # the call that timed out
    call_seconds: list[float] = field(default_factory=list)
    completed_at: list[float] = field(default_factory=list)  # time.monotonic() of each call's result
    close_hung: bool = False  # the SDK's close() did not return within CLOSE_S
    session_finished: bool = True  # ...and whether the server had finished the session anyway

    def record(self, call: str, digest: str, started: float) -> None:
        self.calls.append((call, digest))
        now = time.monotonic()
        self.call_seconds.append(now - started)
        self.completed_at.append(now)

    @property
    def outcome(self) -> tuple[list[tuple[str, str]], dict[str, str]]:
        return self.calls, self.final


EXPECTED_CALLS = ["create"] + [
    call for step in range(STEPS) for call in ("fb", "optim", *(("save_for_sampler", "sample") if step == SAMPLE_AT else ()))
] + ["save_state"]


def run_tenant(base_url: str, data_dir: Path, run: TenantRun, key: str = "fault") -> None:
    """The tenant's calls, each waited for (at most STALL_S); the SDK's own retries only.

    The session is closed at the end (`finish`: its model gives its adapter slot back). The SDK's
    `close()` can hang on its side after the server has finished the session (its heartbeat task
    keeps retrying against the closed client); that wait is bounded and reported apart
    (`close_hung`), with whether the server did finish the session."""
    t = run.tenant
    current = "create"
    client = tinker.ServiceClient(base_url=base_url, api_key=f"tml-{key}-tenant-{t}")
    try:
        started = time.monotonic()
        trainer = _result(client.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=100 + t))
        run.model_id = trainer.model_id
        run.record("create", "", started)
        for step in range(STEPS):
            started = time.monotonic()
            current = f"fb {step}"
            fb = trainer.forward_backward([tenant_datum(t, step, 0), tenant_datum(t, step, 1)], "cross_entropy")
            opt = trainer.optim_step(types.AdamParams(learning_rate=LEARNING_RATE))
            run.record("fb", fb_digest(fb.result(timeout=STALL_S)), started)
            current = f"optim {step}"
            metrics = opt.result(timeout=STALL_S).metrics
            run.record("optim", _digest(repr(sorted(metrics.items())).encode()), started)
            if step == SAMPLE_AT:
                started = time.monotonic()
                current = "save_for_sampler"
                sampler = _result(trainer.save_weights_and_get_sampling_client())
                run.record("save_for_sampler", "", started)
                started = time.monotonic()
                current = "sample"
                prompt = types.ModelInput.from_ints([5, 6, 7 + t])
                params = types.SamplingParams(max_tokens=4, temperature=0.0)
                out = sampler.sample(prompt, num_samples=1, sampling_params=params).result(timeout=STALL_S)
                tokens = [list(seq.tokens) for seq in out.sequences]
                run.record("sample", _digest(json.dumps(tokens).encode()), started)
        started = time.monotonic()
        current = "save_state"
        path = trainer.save_state("final").result(timeout=STALL_S).path
        run.record("save_state", "", started)
        run.final = checkpoint_digests(data_dir, path)
    except TimeoutError as exc:
        run.stalled, run.error = current, exc
    except BaseException as exc:
        run.error = exc
    finally:
        try:
            client.close("success" if run.error is None else "errored").result(timeout=CLOSE_S)
        except TimeoutError:
            run.close_hung = True
            run.session_finished = bool(run.model_id) and _session_finished(base_url, run.model_id)


def _session_finished(base_url: str, model_id: str) -> bool:
    """Whether the server recorded the model's session as finished (the operator status)."""
    import httpx

    session_id = model_id.split(":")[0]
    sessions = httpx.get(f"{base_url}/api/v1/operator/status", timeout=30).json()["sessions"]
    return any(x["session_id"] == session_id and x["finished"] for x in sessions)


def run_workload(base_url: str, data_dir: Path, tenants: int = TENANTS, key: str = "fault") -> list[TenantRun]:
    runs = [TenantRun(t) for t in range(tenants)]
    threads = [threading.Thread(target=run_tenant, args=(base_url, data_dir, r, key), daemon=True) for r in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return runs


def differences(runs: Iterable[TenantRun], reference: dict[int, TenantRun]) -> list[str]:
    """Every way the runs differ from the reference (empty: bit-identical, call for call)."""
    out = []
    for run in runs:
        want = reference[run.tenant]
        for i, (got, expected) in enumerate(zip(run.calls, want.calls, strict=False)):
            if got != expected:
                out.append(f"tenant {run.tenant}: call {i} ({expected[0]}) returned {got} instead of {expected}")
        if len(run.calls) != len(want.calls):
            out.append(f"tenant {run.tenant}: {len(run.calls)} calls completed, the reference {len(want.calls)}")
        if run.final != want.final:
            keys = sorted(k for k in set(run.final) | set(want.final) if run.final.get(k) != want.final.get(k))
            out.append(f"tenant {run.tenant}: final checkpoint differs in {keys[:4]} ({len(keys)} entries)")
    return out


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
