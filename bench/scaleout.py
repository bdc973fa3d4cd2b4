"""Scale-out: message sizes of a real step, and failover timings.

One real stack (tiny-qwen3) with two gateway replicas on a 3-node JetStream cluster (every stream
and bucket with 3 replicas). Raw HTTP (JSON bodies) pins sizes and replicas.

1. Message sizes: the bytes and messages each stream (the KV buckets' streams included) gains
   per training step (forward_backward + optim_step of one model), read from the streams' own
   state (`stream_info`: stored bytes, which count subject and headers), for two step sizes
   (1 datum of 64 tokens, 4 datums of 128 tokens), so the per-token and per-step parts separate.
   docs/operations.md scales these to 10,000 tenants.
2. Gateway failover: kill -9 of replica 0; a client that fails over to the next replica on a
   refused connection or a 5xx measures the time from the kill to (a) its first answered request
   (a retrieve_future of a known result) and (b) the result of a new forward_backward.
3. NATS node failover: kill -9 of the node leading the requests stream; the time until the
   surviving nodes name a new leader of the stream (asked every 20 ms, 1 s timeout per ask, over
   a connection made before the kill), until their `/jsz` names a new metadata leader when the
   killed node held that too, and until a new forward_backward (appended to that stream) has
   its result.

    .venv/bin/python bench/scaleout.py [--quick]
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.common import cpu_parser, dist, footer, header, table  # noqa: E402
from infra.bus import Bus  # noqa: E402
from libs.contracts import subjects as s  # noqa: E402
from tests.harness import Stack  # noqa: E402

VOCAB = 2048
OUT = ROOT / "bench" / "results" / "scaleout"


def datum(seed: int, tokens: int) -> dict[str, Any]:
    ids = [(seed * 31 + 7 * i) % VOCAB for i in range(tokens + 1)]
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": ids[:-1]}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": ids[1:], "dtype": "int64"},
            "weights": {"data": [1.0] * tokens, "dtype": "float32"},
        },
    }


class Client:
    """Raw HTTP over the replicas; a refused connection or a 5xx fails over to the next one."""

    def __init__(self, urls: list[str], key: str) -> None:
        self.urls, self.key, self.turn = urls, key, 0

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        for _ in range(2000):
            url = self.urls[self.turn % len(self.urls)]
            try:
                response = httpx.post(url + path, json=body, headers={"X-API-Key": self.key}, timeout=120)
            except httpx.TransportError:
                self.turn += 1
                continue
            if response.status_code >= 500:
                self.turn += 1
                continue
            assert response.status_code == 200, response.text
            out: dict[str, Any] = response.json()
            return out
        raise RuntimeError(f"{path} failed at every replica")

    def result(self, request_id: str) -> dict[str, Any]:
        while True:
            body = self.post("/api/v1/retrieve_future", {"request_id": request_id})
            if body.get("type") != "try_again":
                return body

    def model(self) -> str:
        session = self.post("/api/v1/create_session", {"tags": [], "sdk_version": "bench"})["session_id"]
        body = {"session_id": session, "model_seq_id": 0, "base_model": "tiny-qwen3", "lora_config": {"rank": 4}}
        return str(self.post("/api/v1/create_model", body)["model_id"])


class Model:
    def __init__(self, client: Client) -> None:
        self.client, self.model_id, self.seq = client, client.model(), 1

    def fb(self, datums: int, tokens: int) -> str:
        body = {
            "forward_backward_input": {"data": [datum(self.seq + i, tokens) for i in range(datums)], "loss_fn": "cross_entropy"},
            "model_id": self.model_id,
            "seq_id": self.seq,
        }
        self.seq += 1
        return str(self.client.post("/api/v1/forward_backward", body)["request_id"])

    def optim(self) -> str:
        body = {"model_id": self.model_id, "seq_id": self.seq, "adam_params": {"learning_rate": 1e-3}}
        self.seq += 1
        return str(self.client.post("/api/v1/optim_step", body)["request_id"])

    def step(self, datums: int, tokens: int) -> None:
        self.client.result(self.fb(datums, tokens))
        self.client.result(self.optim())


async def _streams(nats_url: str) -> dict[str, tuple[int, int]]:
    bus = await Bus.connect(nats_url, "bench-scaleout")
    try:
        out = {}
        for name in await bus.js.streams_info():
            out[name.config.name or "?"] = (name.state.messages, name.state.bytes)
        return out
    finally:
        await bus.close()


def streams(nats_url: str) -> dict[str, tuple[int, int]]:
    return asyncio.run(_streams(nats_url))


def message_sizes(stack: Stack, reps: int) -> list[dict[str, Any]]:
    model = Model(Client(stack.base_urls, "tml-bench-sizes"))
    model.step(1, 8)  # warm: the model is placed, compiled paths are hot
    rows = []
    for datums, tokens in ((1, 64), (4, 128)):
        before = streams(stack.nats_url)
        for _ in range(reps):
            model.step(datums, tokens)
        time.sleep(1.0)  # let the off-path operation events land before reading the counts
        after = streams(stack.nats_url)
        for name in sorted(after):
            msgs = after[name][0] - before.get(name, (0, 0))[0]
            nbytes = after[name][1] - before.get(name, (0, 0))[1]
            if msgs or nbytes:
                rows.append({
                    "step": f"{datums}x{tokens} tokens",
                    "stream": name,
                    "msgs_per_step": msgs / reps,
                    "bytes_per_step": nbytes / reps,
                    "bytes_per_msg": nbytes / msgs if msgs else None,
                })
    return rows


def gateway_failover(stack: Stack, reps: int) -> dict[str, Any]:
    client = Client(stack.base_urls, "tml-bench-gw")
    model = Model(client)
    known = model.fb(1, 8)
    client.result(known)
    model.client.result(model.optim())
    first_answer, next_result = [], []
    for _ in range(reps):
        client.turn = 0  # the next call goes to the replica about to die
        stack.stop_service("gateway")
        t0 = time.monotonic()
        client.result(known)
        first_answer.append(time.monotonic() - t0)
        client.turn = 0
        t0 = time.monotonic()
        client.result(model.fb(1, 8))
        next_result.append(time.monotonic() - t0)
        stack.start_service("gateway").wait(240)
        client.result(model.optim())
    return {"first_answered_request_s": dist(first_answer), "next_training_result_s": dist(next_result)}


def meta_leader(stack: Stack, skip: int) -> str | None:
    assert stack.cluster is not None
    for i, server in enumerate(stack.cluster.servers):
        if i == skip or server is None or server.monitor_url is None:
            continue
        try:
            with urllib.request.urlopen(server.monitor_url + "/jsz", timeout=1) as response:
                leader = json.load(response).get("meta_cluster", {}).get("leader")
                if leader:
                    return str(leader)
        except OSError:
            continue
    return None


async def _leader(urls: str, stream: str) -> str | None:
    bus = await Bus.connect(urls, "bench-leader")
    try:
        info = await bus.js.stream_info(stream)
        return info.cluster.leader if info.cluster else None
    finally:
        await bus.close()


async def _watch_stream(others: str, old: str, t0_box: list[float], found: dict[str, float], ready: threading.Event) -> None:
    """Ask the surviving nodes for the stream's leader (1 s timeout per ask) until it changes;
    record the time the answer naming a new leader arrived."""
    bus = await Bus.connect(others, "bench-watch")
    js = bus.nc.jetstream(timeout=1.0)
    ready.set()
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            try:
                info = await js.stream_info(s.STREAM_REQUESTS)
                leader = info.cluster.leader if info.cluster else None
            except Exception:  # no leader or no quorum yet: asked again
                leader = None
            if t0_box and leader and leader != old:
                found["stream"] = time.monotonic() - t0_box[0]
                return
            await asyncio.sleep(0.02)
    finally:
        await bus.close()


def _run_watch_stream(*args: Any) -> None:
    asyncio.run(_watch_stream(*args))


def _watch_meta(stack: Stack, index: int, old: str, t0_box: list[float], found: dict[str, float]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        new = meta_leader(stack, index)
        if t0_box and new and new != old:
            found["meta"] = time.monotonic() - t0_box[0]
            return
        time.sleep(0.02)


def nats_failover(stack: Stack, reps: int) -> dict[str, Any]:
    assert stack.cluster is not None
    cluster = stack.cluster
    client = Client(stack.base_urls, "tml-bench-nats")
    model = Model(client)
    model.step(1, 8)
    elected, meta, next_result, killed = [], [], [], []
    for _ in range(reps):
        leader = asyncio.run(_leader(stack.nats_url, s.STREAM_REQUESTS))
        assert leader is not None
        index = cluster.index_of(leader)
        held_meta = meta_leader(stack, -1) == leader
        others = ",".join(u for i, u in enumerate(cluster.urls) if i != index)
        found: dict[str, float] = {}
        t0_box: list[float] = []  # set at the kill; the watchers run (and connect) before it
        ready = threading.Event()
        watchers = [threading.Thread(target=_run_watch_stream, args=(others, leader, t0_box, found, ready), daemon=True)]
        if held_meta:
            meta_args = (stack, index, leader, t0_box, found)
            watchers.append(threading.Thread(target=_watch_meta, args=meta_args, daemon=True))
        for watcher in watchers:
            watcher.start()
        ready.wait(30)
        cluster.kill(index)
        t0 = time.monotonic()
        t0_box.append(t0)
        client.result(model.fb(1, 8))
        next_result.append(time.monotonic() - t0)
        for watcher in watchers:
            watcher.join(120)
        elected.append(found.get("stream", float("nan")))
        if held_meta:
            meta.append(found.get("meta", float("nan")))
        killed.append({"node": leader, "held_meta_leader": held_meta})
        cluster.restart(index)
        model.step(1, 8)
    return {
        "killed": killed,
        "stream_leader_elected_s": dist(elected),
        "meta_leader_elected_s": dist(meta) if meta else None,
        "next_training_result_s": dist(next_result),
    }


def main() -> None:
    args = cpu_parser(__doc__ or "").parse_args()
    reps = 2 if args.quick else 5
    header("Scale-out: message sizes and failover", args.quick, gateway_replicas=2, nats_nodes=3, reps=reps)
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tinkerd-bench-") as tmp:
        stack = Stack(Path(tmp), gateways=2, nats_nodes=3).start()
        try:
            sizes = message_sizes(stack, reps)
            table("Bytes per training step, by stream (3 replicas: each is stored 3 times)", sizes, [
                ("step", "step"), ("stream", "stream"), ("msgs/step", "msgs_per_step"),
                ("bytes/step", "bytes_per_step"), ("bytes/msg", "bytes_per_msg"),
            ])
            gw = gateway_failover(stack, reps)
            print("## Gateway replica kill -9\n\n" + json.dumps(gw, indent=1) + "\n", flush=True)
            nats = nats_failover(stack, reps)
            print("## NATS node kill -9 (the requests stream's leader)\n\n" + json.dumps(nats, indent=1) + "\n", flush=True)
        finally:
            stack.stop()
    (OUT / "results.json").write_text(json.dumps({"sizes": sizes, "gateway": gw, "nats": nats}, indent=1))
    footer()


if __name__ == "__main__":
    main()
