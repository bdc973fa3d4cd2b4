"""The SDK's two HTTP transports against one stack: per-call latency, and how often a finished
client process dies as it exits.

One real stack per transport (``TINKERD_GATEWAY_CLIENT_TRANSPORT=httpx|pyqwest``; tiny model,
loopback). Per transport:

* latency: one in-process ``ServiceClient``, sequential calls, each from the SDK call to its
  ``.result()``: ``list_checkpoints`` (a small REST call) and ``forward_backward`` of one 64-token
  datum (through the trainer);
* exits: ``tinker --format json checkpoint list`` (the SDK's own CLI, a fresh process each time)
  run N times while three busy loops keep the machine's cores loaded, counting exit statuses
  (134 / -6: SIGABRT).

    .venv/bin/python bench/client_transport.py [--quick]
"""

from __future__ import annotations

import collections
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import cpu_parser, dist, footer, header, random_tokens, running_stack, sft_datum, table  # noqa: E402

TRANSPORTS = ("httpx", "pyqwest")
VOCAB = 2048  # tiny-qwen3
BUSY_LOOPS = 3


def latencies(base_url: str, calls: int) -> dict[str, list[float]]:
    import tinker

    service = tinker.ServiceClient(base_url=base_url, api_key="tml-bench-transport")
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=4).result()
    rest = tinker.RestClient(base_url=base_url, api_key="tml-bench-transport")
    datum = sft_datum(random_tokens(0, 64, VOCAB))
    work = {
        "list_checkpoints": lambda: rest.list_checkpoints(training.model_id).result(),
        "forward_backward (1 x 64 tokens)": lambda: training.forward_backward([datum], "cross_entropy").result(),
    }
    out: dict[str, list[float]] = {}
    for name, call in work.items():
        for _ in range(5):  # warm-up
            call()
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        out[name] = times
    return out


def cli_exits(base_url: str, runs: int) -> collections.Counter[int]:
    from tests.tinker_cli import run_tinker_cli

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(BUSY_LOOPS)]
    try:
        codes: collections.Counter[int] = collections.Counter()
        for _ in range(runs):
            done = run_tinker_cli(base_url, "tml-bench-transport", "--format", "json", "checkpoint", "list")
            codes[done.returncode] += 1
        return codes
    finally:
        for p in busy:
            p.kill()
            p.wait()


def main() -> None:
    args = cpu_parser(__doc__ or "").parse_args()
    calls, runs = (10, 3) if args.quick else (100, 100)
    header("The SDK's HTTP transports", args.quick, calls=calls, cli_runs=runs, busy_loops=BUSY_LOOPS)
    latency_rows, exit_rows = [], []
    for transport in TRANSPORTS:
        with running_stack({"TINKERD_GATEWAY_CLIENT_TRANSPORT": transport}) as stack:
            for name, times in latencies(stack.base_url, calls).items():
                d = dist(times, 1e3)
                latency_rows.append({"transport": transport, "call": name, **d})
            codes = cli_exits(stack.base_url, runs)
        aborted = codes[-6] + codes[134]
        exit_rows.append(
            {
                "transport": transport,
                "runs": runs,
                "ok": codes[0],
                "aborted": aborted,
                "other": runs - codes[0] - aborted,
            }
        )
    table(
        f"Per call (ms, {calls} sequential calls each)",
        latency_rows,
        [("transport", "transport"), ("call", "call"), ("p50", "p50"), ("p99", "p99"), ("mean", "mean")],
    )
    table(
        f"`tinker checkpoint list` exits with {BUSY_LOOPS} busy loops on the machine",
        exit_rows,
        [("transport", "transport"), ("runs", "runs"), ("exit 0", "ok"), ("SIGABRT", "aborted"), ("other", "other")],
    )
    footer()


if __name__ == "__main__":
    main()
