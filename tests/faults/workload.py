"""The seeded multi-tenant SDK workload the fault tests and the chaos soak run, and their checks.

Every tenant is a thread with its own SDK client. A tenant's calls and data depend only on its
index (LoRA seed, datums, learning rate), never on time, model ids or the other tenants, so the
same workload on two separate stacks must give the same results bit for bit (CPU fp32; packing
tenants together does not change a tenant's numbers: docs/semantics.md §3). That is the
independent reference: the fault-free run of the same workload on a stack of its own.

What a run records per tenant: a digest of every call's result in call order (forward_backward
losses and logprobs, optim_step metrics, sampled tokens) and the digests of its final checkpoint
(adapter, AdamW moments, step). `exactly_once` reads the streams of the faulted stack back: no
result appended twice (the results stream replaces a subject's message, so a second append shows
as a gap between its last sequence and its message count), no unit planned twice, no unit with two
outcomes (a unit the trainer ran twice live).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tinker
from safetensors.numpy import load_file
from tinker import types

from infra.bus import Bus, replay
from libs.contracts import codec
from libs.contracts import subjects as s

TENANTS = 3  # in each fault scenario
REFERENCE_TENANTS = 4  # in the reference run (the chaos soak runs 4; tenants are independent)
STEPS = 4
SAMPLE_AT = 1  # the step after which each tenant saves for sampling and samples once
STALL_S = 300.0  # a call that has no result after this long is stalled (and fails the run)
CLOSE_S = 60.0  # how long ServiceClient.close() may take
LEARNING_RATE = 1e-2


def _result(value):  # type: ignore[no-untyped-def]
    return value.result(timeout=STALL_S) if hasattr(value, "result") else value


def datum(tenant: int, step: int, index: int) -> types.Datum:
    rng = np.random.default_rng(1000 * tenant + 10 * step + index)
    tokens = rng.integers(4, 2000, size=12).tolist()
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64)),
            "weights": types.TensorData.from_numpy(np.ones(11, dtype=np.float32)),
        },
    )


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
            fb = trainer.forward_backward([datum(t, step, 0), datum(t, step, 1)], "cross_entropy")
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


@dataclass
class ExactlyOnce:
    """What the streams of a run say was applied twice (every field must be 0)."""

    results_replaced: int  # a request's result appended again (results keep one per subject)
    units_planned_twice: int  # a unit id appended to the work stream more than once
    units_with_two_outcomes: int  # a unit the trainer ran (and reported) twice
    examples: dict[str, list[int]] = field(default_factory=dict)  # "stream unit_id" -> sequences

    @property
    def clean(self) -> bool:
        return not (self.results_replaced or self.units_planned_twice or self.units_with_two_outcomes)


async def _exactly_once(nats_url: str, injected: set[tuple[str, int]]) -> ExactlyOnce:
    bus = await Bus.connect(nats_url, "fault-check")
    try:
        results = await bus.js.stream_info(s.STREAM_RESULTS)
        counts: dict[str, Counter[str]] = {s.STREAM_WORK: Counter(), s.STREAM_OUTCOMES: Counter()}
        where: dict[str, list[int]] = {}
        for stream, subject in ((s.STREAM_WORK, s.WORK_ALL), (s.STREAM_OUTCOMES, s.OUTCOMES_ALL)):
            info = await bus.js.stream_info(stream)

            def count(msg, stream: str = stream) -> None:  # type: ignore[no-untyped-def]
                if (stream, msg.metadata.sequence.stream) in injected:
                    return  # a copy the test appended on purpose
                decoder = codec.unit_decoder if stream == s.STREAM_WORK else codec.outcome_decoder
                unit_id = decoder.decode(msg.data).unit_id
                counts[stream][unit_id] += 1
                where.setdefault(f"{stream} {unit_id}", []).append(msg.metadata.sequence.stream)

            await replay(bus, stream, subject, info.state.last_seq, count)
        twice = {name: sum(1 for n in c.values() if n > 1) for name, c in counts.items()}
        return ExactlyOnce(
            results_replaced=results.state.last_seq - results.state.messages,
            units_planned_twice=twice[s.STREAM_WORK],
            units_with_two_outcomes=twice[s.STREAM_OUTCOMES],
            examples={key: seqs for key, seqs in where.items() if len(seqs) > 1},
        )
    finally:
        await bus.close()


def exactly_once(nats_url: str, injected: set[tuple[str, int]] | None = None) -> ExactlyOnce:
    return asyncio.run(_exactly_once(nats_url, injected or set()))


@dataclass
class EventTrigger:
    """Calls `action` once, from a background thread, when the n-th event of `kind` is seen."""

    nats_url: str
    kind: str
    n: int
    action: Callable[[], None]
    fired: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    counts: Counter[str] = field(default_factory=Counter)
    error: BaseException | None = None
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
        self.fired.set()
        try:
            self.action()
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)
