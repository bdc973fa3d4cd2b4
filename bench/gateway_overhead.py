"""Gateway overhead: what an SDK call costs beyond the trainer's own compute.

One real stack (``tests.harness.Stack``: nats-server plus every service as a subprocess, tiny
model, loopback). Part 1, one client, sequential: ``forward_backward`` (one 64-token datum) then
``optim_step``, each timed from the SDK call to its ``.result()``. Trainer compute per request is
read back from the operation events (``unit_done.duration_ms`` of the units ``planned`` for it;
that duration also covers publishing the outcome and acking the work message) and, tighter, from
the outcome stream (``finished_ns - started_ns``: ``TrainerService.execute`` alone).

    overhead = SDK round trip - trainer compute          (per call, then p50 / p99)

For scale, the bus primitives each hop pays are timed on the same stack: a JetStream publish
with its ack, and a KV get.

Part 2, submissions per second from 16 concurrent clients: raw ``httpx`` posts of pre-built
bodies (protobuf ``forward_backward`` bodies made with the SDK's own encoder, JSON ``asample``),
8 tenants; then the time until every future has its result (completions per second). The
gateway's sampling admission limit is raised for the run so that no post is refused with 429.

    .venv/bin/python bench/gateway_overhead.py [--quick]
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    cpu_parser,
    dist,
    event_tag,
    events,
    footer,
    header,
    random_tokens,
    running_stack,
    sft_datum,
    stream_messages,
    table,
)

TARGET_P50_MS = 10.0
TENANTS = 8
CLIENTS = 16
VOCAB = 2048  # tiny-qwen3


@dataclass
class Call:
    kind: str
    start_ns: int
    end_ns: int
    warmup: bool


class HttpLog:
    """The SDK's HTTP requests timed from outside it: while installed, ``httpx.AsyncClient.send``
    (the SDK's transport) is wrapped to record each request's path, when it was sent and when its
    response came back (``time.time_ns``, the clock of ``Call``). A bench-only patch: it splits a
    call's first and last stages into the SDK's own time and the server's."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, int, int]] = []
        self._original: Any = None

    def __enter__(self) -> HttpLog:
        import httpx

        original = self._original = httpx.AsyncClient.send
        requests = self.requests

        async def send(client: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            sent = time.time_ns()
            response = await original(client, request, *args, **kwargs)
            requests.append((request.url.path, sent, time.time_ns()))
            return response

        httpx.AsyncClient.send = send  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        import httpx

        httpx.AsyncClient.send = self._original  # type: ignore[method-assign]


class SequentialClient:
    """One SDK client on one stack: ``forward_backward`` (one 64-token datum), then ``optim_step``."""

    def __init__(self, base_url: str) -> None:
        import tinker
        from tinker import types

        service = tinker.ServiceClient(base_url=base_url, api_key="tml-bench-overhead")
        self.training = service.create_lora_training_client(base_model="tiny-qwen3", rank=8).result()
        self.model_id: str = self.training.model_id
        datum = sft_datum(random_tokens(0, 65, VOCAB))
        adam = types.AdamParams(learning_rate=1e-4)
        self.submit: dict[str, Callable[[], Any]] = {
            "forward_backward": lambda: self.training.forward_backward([datum], "cross_entropy"),
            "optim_step": lambda: self.training.optim_step(adam),
        }
        self.calls: list[Call] = []

    def step(self, warmup: bool) -> None:
        for kind, call in self.submit.items():
            start = time.time_ns()
            call().result()
            self.calls.append(Call(kind, start, time.time_ns(), warmup))


def stored_ns(msg: Any) -> int:
    """When JetStream stored ``msg`` (its server timestamp), in ns since the epoch."""
    return int(msg.metadata.timestamp.timestamp() * 1e9)


def overhead_rows(
    label: str, nats_url: str, model_id: str, calls: list[Call], http: HttpLog | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per call kind, the round trip against the trainer's compute, and the stages of the round
    trip from event and storage timestamps (with ``http``, stages 1 and 5 split at the SDK's own
    request and response)."""
    from libs.contracts import codec
    from libs.contracts import subjects as s

    by_tag: dict[str, list[Any]] = defaultdict(list)
    for _ in range(50):  # unit_done is emitted after the outcome: wait for the last one
        by_tag = defaultdict(list)
        for event in events(nats_url):
            by_tag[event_tag(event)].append(event)
        if len(by_tag["unit_done"]) >= len(by_tag["planned"]):
            break
        time.sleep(0.2)
    outcomes = stream_messages(
        nats_url, s.STREAM_OUTCOMES, s.OUTCOMES_ALL, lambda m: (codec.outcome_decoder.decode(m.data), stored_ns(m))
    )
    executed = {o.unit_id: o for o, _ in outcomes}
    outcome_stored = {o.unit_id: at for o, at in outcomes}
    result_stored = dict(
        stream_messages(
            nats_url,
            s.STREAM_RESULTS,
            s.RESULTS_ALL,
            lambda m: (codec.result_decoder.decode(m.data).request_id, stored_ns(m)),
        )
    )
    done = {e.unit_id: e for e in by_tag["unit_done"]}
    started = {e.unit_id: e for e in by_tag["started"]}
    completed = {e.request_id: e for e in by_tag["completed"]}
    units: dict[str, list[Any]] = defaultdict(list)
    for planned in by_tag["planned"]:
        for request_id in planned.requests:
            units[request_id].append(planned)
    first = min(call.start_ns for call in calls)  # the model may have run calls before these
    accepted = sorted(
        (e for e in by_tag["accepted"] if e.model_id == model_id and e.at_ns >= first), key=lambda e: e.seq_id
    )
    order = {kind: [e for e in accepted if e.kind == kind] for kind in ("forward_backward", "optim_step")}
    taken = {kind: iter(events_) for kind, events_ in order.items()}

    samples: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for call in calls:
        acc = next(taken[call.kind])
        if call.warmup:
            continue
        mine = units[acc.request_id]
        last = executed[mine[-1].unit_id]
        rtt = (call.end_ns - call.start_ns) / 1e6
        unit_ms = sum(done[u.unit_id].duration_ms for u in mine)
        exec_ms = sum((executed[u.unit_id].finished_ns - executed[u.unit_id].started_ns) / 1e6 for u in mine)
        row = samples[call.kind]
        row["rtt"].append(rtt)
        row["unit_done"].append(unit_ms)
        row["execute"].append(exec_ms)
        row["overhead"].append(rtt - unit_ms)
        row["overhead_exec"].append(rtt - exec_ms)
        row["1 SDK submit -> gateway accepted"].append((acc.at_ns - call.start_ns) / 1e6)
        row["2 accepted -> trainer started (planner, work fetch)"].append(
            (started[mine[0].unit_id].at_ns - acc.at_ns) / 1e6
        )
        row["3 trainer execute"].append(exec_ms)
        row["4 execute end -> result published (outcome, planner)"].append(
            (completed[acc.request_id].at_ns - last.finished_ns) / 1e6
        )
        # stage 4 split by the server's storage stamps (one host: one clock)
        row["4a execute end -> outcome stored (trainer)"].append(
            (outcome_stored[last.unit_id] - last.finished_ns) / 1e6
        )
        row["4b outcome stored -> result stored (planner)"].append(
            (result_stored[acc.request_id] - outcome_stored[last.unit_id]) / 1e6
        )
        row["5 result published -> SDK has it (long-poll)"].append(
            (call.end_ns - completed[acc.request_id].at_ns) / 1e6
        )
        if http is not None:  # the SDK's own time before its request and after the last response
            mine_http = [r for r in http.requests if call.start_ns <= r[1] and r[2] <= call.end_ns]
            submit = next(r for r in mine_http if r[0].endswith("/" + call.kind))
            answer = [r for r in mine_http if r[0].endswith("/retrieve_future")][-1]
            row["1a SDK call -> its request sent"].append((submit[1] - call.start_ns) / 1e6)
            row["1b request sent -> gateway accepted"].append((acc.at_ns - submit[1]) / 1e6)
            row["5a result published -> SDK's response received"].append(
                (answer[2] - completed[acc.request_id].at_ns) / 1e6
            )
            row["5b response received -> SDK returns the result"].append((call.end_ns - answer[2]) / 1e6)
    summary, stages = [], []
    for kind, row in samples.items():
        d = {name: dist(values) for name, values in row.items()}
        summary.append(
            {
                "stack": label,
                "call": kind,
                "n": d["rtt"]["n"],
                "rtt_p50": d["rtt"]["p50"],
                "rtt_p99": d["rtt"]["p99"],
                "unit_p50": d["unit_done"]["p50"],
                "exec_p50": d["execute"]["p50"],
                "ovh_p50": d["overhead"]["p50"],
                "ovh_p99": d["overhead"]["p99"],
                "ovhx_p50": d["overhead_exec"]["p50"],
                "ovhx_p99": d["overhead_exec"]["p99"],
                "met": "yes" if d["overhead"]["p50"] < TARGET_P50_MS else "no",
            }
        )
        for name, values in sorted(row.items()):
            if name[0].isdigit():
                s50, s99 = dist(values)["p50"], dist(values)["p99"]
                stages.append({"stack": label, "call": kind, "stage": name, "p50": s50, "p99": s99})
    return summary, stages


def bus_costs(nats_url: str, n: int) -> list[dict[str, Any]]:
    """The primitives every hop pays, on this machine: a JetStream publish with its ack (file
    storage, with a Nats-Msg-Id like the services' appends) and a KV get (the gateway's reads)."""
    from nats.js.api import StorageType, StreamConfig

    from infra.bus import Bus

    async def measure() -> dict[str, list[float]]:
        bus = await Bus.connect(nats_url, "bench-primitives")
        times: dict[str, list[float]] = defaultdict(list)
        try:
            await bus.js.add_stream(
                StreamConfig(name="BENCH", subjects=["bench.>"], storage=StorageType.FILE)
            )
            kv = await bus.js.create_key_value(bucket="bench", storage=StorageType.FILE)
            await kv.put("key", b"x" * 200)
            for i in range(n):
                start = time.perf_counter()
                await bus.publish("bench.x", b"x" * 500, msg_id=f"m{i}")
                times["JetStream publish + ack (file, Nats-Msg-Id)"].append(time.perf_counter() - start)
                start = time.perf_counter()
                await kv.get("key")
                times["KV get"].append(time.perf_counter() - start)
        finally:
            await bus.close()
        return times

    return [
        {"what": name, "n": len(values), "p50": dist(values, 1e3)["p50"], "p99": dist(values, 1e3)["p99"]}
        for name, values in asyncio.run(measure()).items()
    ]


# ---- submissions per second --------------------------------------------------------------


async def post_all(base_url: str, jobs: list[tuple[str, str, bytes, dict[str, str]]]) -> dict[str, Any]:
    """POST every (path, api key, body, headers) job from CLIENTS concurrent connections."""
    import httpx

    queue = list(reversed(jobs))
    latencies: list[float] = []
    statuses: dict[int, int] = defaultdict(int)
    request_ids: list[str] = []

    async def client() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            while queue:
                path, key, body, headers = queue.pop()
                start = time.perf_counter()
                response = await http.post(path, content=body, headers={"X-API-Key": key, **headers})
                latencies.append(time.perf_counter() - start)
                statuses[response.status_code] += 1
                if response.status_code == 200:
                    request_ids.append(f"{key}|{response.json()['request_id']}")

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    return {
        "wall": time.perf_counter() - start,
        "latencies": latencies,
        "statuses": dict(statuses),
        "ids": request_ids,
    }


async def retrieve_all(base_url: str, keyed_ids: list[str]) -> int:
    """Long-poll every future until it has a result; returns how many failed."""
    import httpx

    queue = list(keyed_ids)
    failed = 0

    async def client() -> None:
        nonlocal failed
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            while queue:
                key, request_id = queue.pop().split("|", 1)
                while True:
                    response = await http.post(
                        "/api/v1/retrieve_future", json={"request_id": request_id}, headers={"X-API-Key": key}
                    )
                    body = response.json() if response.status_code == 200 else {"error": response.text}
                    if body.get("type") != "try_again":
                        failed += "error" in body
                        break

    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    return failed


def fb_jobs(base_url: str, per_tenant: int) -> tuple[list[tuple[str, str, bytes, dict[str, str]]], list[str]]:
    """Pre-built protobuf forward_backward posts (seq 1..n per model), and the last request per model."""
    import tinker
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    jobs, last = [], []
    headers = {"Content-Type": "application/x-protobuf"}
    for tenant in range(TENANTS):
        key = f"tml-bench-fb-{tenant}"
        service = tinker.ServiceClient(base_url=base_url, api_key=key)
        model_id = service.create_lora_training_client(base_model="tiny-qwen3", rank=8).result().model_id
        for seq in range(1, per_tenant + 1):
            data = [sft_datum(random_tokens(1000 * tenant + seq, 65, VOCAB))]
            request = types.ForwardBackwardRequest(
                forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
                model_id=model_id,
                seq_id=seq,
            )
            body = forward_backward_request_to_proto(request).SerializeToString()
            jobs.append(("/api/v1/forward_backward", key, body, headers))
        last.append(f"{key}|{model_id}:{per_tenant}")
    return interleave(jobs, per_tenant), last


def sample_jobs(base_url: str, per_tenant: int) -> list[tuple[str, str, bytes, dict[str, str]]]:
    import httpx
    import msgspec

    jobs = []
    headers = {"Content-Type": "application/json"}
    for tenant in range(TENANTS):
        key = f"tml-bench-sample-{tenant}"
        auth = {"X-API-Key": key}
        session = httpx.post(
            f"{base_url}/api/v1/create_session", json={"tags": [], "sdk_version": "bench"}, headers=auth
        )
        create = {
            "session_id": session.json()["session_id"],
            "sampling_session_seq_id": 0,
            "base_model": "tiny-qwen3",
        }
        sampler = httpx.post(f"{base_url}/api/v1/create_sampling_session", json=create, headers=auth)
        sampler_id = sampler.json()["sampling_session_id"]
        for seq in range(per_tenant):
            body = {
                "type": "sample",
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": random_tokens(seq, 16, VOCAB)}]},
                "sampling_params": {"max_tokens": 16, "temperature": 1.0, "seed": seq},
                "num_samples": 1,
                "sampling_session_id": sampler_id,
                "seq_id": seq,
            }
            jobs.append(("/api/v1/asample", key, msgspec.json.encode(body), headers))
    return interleave(jobs, per_tenant)


def interleave(jobs: list[Any], per_tenant: int) -> list[Any]:
    """Round-robin over tenants, so every tenant's posts spread over the whole run."""
    return [jobs[t * per_tenant + i] for i in range(per_tenant) for t in range(TENANTS)]


def packing(nats_url: str, posted: dict[str, Any]) -> dict[str, Any]:
    """The trainer units the planner made for the burst's requests: count, datums per unit, and
    their ``unit_done`` durations (p50, and the sum: how long the trainer was busy with them)."""
    burst = {keyed.split("|", 1)[1] for keyed in posted["ids"]}
    everything = events(nats_url)
    units = {e.unit_id for e in everything if event_tag(e) == "planned" and burst & set(e.requests)}
    busy = [e.duration_ms for e in everything if event_tag(e) == "unit_done" and e.unit_id in units]
    return {
        "units": len(units),
        "per_unit": len(burst) / max(len(units), 1),
        "unit_p50": dist(busy)["p50"],
        "busy_s": sum(busy) / 1e3,
    }


def throughput_row(name: str, posted: dict[str, Any], drain_s: float, failed: int) -> dict[str, Any]:
    ok = posted["statuses"].get(200, 0)
    lat = dist(posted["latencies"], 1e3)
    return {
        "what": name,
        "posts": sum(posted["statuses"].values()),
        "ok": ok,
        "other": ", ".join(f"{code}: {n}" for code, n in posted["statuses"].items() if code != 200) or "-",
        "sub_s": ok / posted["wall"],
        "post_p50": lat["p50"],
        "post_p99": lat["p99"],
        "done_s": ok / drain_s,
        "failed": failed,
    }


def main() -> None:
    args = cpu_parser(__doc__ or "").parse_args()
    reps, warmup = (10, 2) if args.quick else (200, 10)
    per_tenant = 4 if args.quick else 125
    header(
        "Gateway overhead and submission throughput (tiny-qwen3, loopback)",
        args.quick,
        sequential_reps=reps,
        warmup=warmup,
        concurrent_clients=CLIENTS,
        tenants=TENANTS,
        posts_per_kind=TENANTS * per_tenant,
    )
    env = {"TINKERD_GATEWAY_SAMPLING_CAPACITY": "1000000"}
    plain_env = env | {"TINKERD_TRACE_EXPORTER": "none"}  # the production default
    with running_stack(plain_env) as stack, running_stack(env) as traced:
        clients = {
            "tracing off": SequentialClient(stack.base_url),
            "tracing jsonl": SequentialClient(traced.base_url),
        }
        with HttpLog() as http:
            for i in range(warmup + reps):  # interleaved, so both stacks see the same machine
                for client in clients.values():
                    client.step(warmup=i < warmup)
        summary, stages = [], []
        for (label, client), nats_url in zip(clients.items(), (stack.nats_url, traced.nats_url), strict=True):
            rows_, stages_ = overhead_rows(label, nats_url, client.model_id, client.calls, http)
            summary += rows_
            stages += stages_
        for kind in ("forward_backward", "optim_step"):
            off, on = (
                next(r for r in summary if r["stack"] == label and r["call"] == kind) for label in clients
            )
            on["vs_off"] = on["ovh_p50"] / off["ovh_p50"]
        primitives = bus_costs(stack.nats_url, 50 if args.quick else 500)

        rows = []
        jobs, last = fb_jobs(stack.base_url, per_tenant)
        start = time.perf_counter()
        posted = asyncio.run(post_all(stack.base_url, jobs))
        failed = asyncio.run(retrieve_all(stack.base_url, last))
        rows.append(
            throughput_row(
                "forward_backward (protobuf, 64 tokens)", posted, time.perf_counter() - start, failed
            )
        )
        rows[-1].update(packing(stack.nats_url, posted))

        jobs = sample_jobs(stack.base_url, per_tenant)
        start = time.perf_counter()
        posted = asyncio.run(post_all(stack.base_url, jobs))
        failed = asyncio.run(retrieve_all(stack.base_url, posted["ids"]))
        rows.append(
            throughput_row("asample (16 prompt + 16 new tokens)", posted, time.perf_counter() - start, failed)
        )

    table(
        f"Per-call overhead, one client, sequential (ms; target: overhead p50 < {TARGET_P50_MS:.0f} ms)",
        summary,
        [
            ("stack", "stack"),
            ("call", "call"),
            ("n", "n"),
            ("round trip p50", "rtt_p50"),
            ("round trip p99", "rtt_p99"),
            ("unit_done p50", "unit_p50"),
            ("execute p50", "exec_p50"),
            ("overhead p50", "ovh_p50"),
            ("overhead p99", "ovh_p99"),
            ("overhead vs execute p50", "ovhx_p50"),
            ("overhead vs execute p99", "ovhx_p99"),
            ("p50 < target", "met"),
            ("overhead p50 / tracing off", "vs_off"),
        ],
    )
    table(
        "Where the round trip goes (ms, from event timestamps)",
        stages,
        [("stack", "stack"), ("call", "call"), ("stage", "stage"), ("p50", "p50"), ("p99", "p99")],
    )
    table(
        "Bus primitives on this machine (ms, one client, sequential)",
        primitives,
        [("operation", "what"), ("n", "n"), ("p50", "p50"), ("p99", "p99")],
    )
    table(
        f"Submissions from {CLIENTS} concurrent clients, {TENANTS} tenants",
        rows,
        [
            ("request", "what"),
            ("posts", "posts"),
            ("200", "ok"),
            ("other status", "other"),
            ("submissions/s", "sub_s"),
            ("post p50 ms", "post_p50"),
            ("post p99 ms", "post_p99"),
            ("completed/s (until last result)", "done_s"),
            ("failed", "failed"),
            ("trainer units", "units"),
            ("datums per unit", "per_unit"),
            ("unit_done p50 ms", "unit_p50"),
            ("trainer busy s", "busy_s"),
        ],
    )

    footer()


if __name__ == "__main__":
    main()
