"""Trainer groups: aggregate training steps/s of 4 tenants on one group against two.

One real stack (tiny-qwen3) per configuration, on this machine: (1) one trainer group with 4
adapter slots, (2) two trainer groups (`TINKERD_TRAINER_GROUPS=a,b`) with 2 slots each, so all four
models stay resident in both. Every trainer process runs torch with one thread
(`OMP_NUM_THREADS=1`): the unit of scale-out is a group, and a second group brings a second
core's worth of compute. Four tenants (threads, one SDK client each) run `STEPS` steps at once,
each step a `forward_backward` of `DATUMS` datums of `TOKENS` tokens then an `optim_step`, after
`WARMUP` steps that are not timed. Aggregate steps/s = tenants x STEPS / wall time from the first
timed call to the last result.

    .venv/bin/python bench/groups.py [--quick]
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import cpu_parser, footer, header, random_tokens, running_stack, sft_datum, table  # noqa: E402

TENANTS = 4
VOCAB = 2048  # tiny-qwen3


def run(base_url: str, steps: int, warmup: int, datums: int, tokens: int) -> dict[str, Any]:
    """The tenants at once; returns the timed steps' aggregate rate."""
    import tinker
    from tinker import types

    ready = threading.Barrier(TENANTS + 1)
    finished: list[float] = []
    errors: list[BaseException] = []

    def tenant(t: int) -> None:
        try:
            with tinker.ServiceClient(base_url=base_url, api_key=f"tml-bench-groups-{t}") as service:
                tenant_steps(service, t)
        except BaseException as exc:  # reported below
            errors.append(exc)
            ready.abort()

    def tenant_steps(service: Any, t: int) -> None:
        training = service.create_lora_training_client(base_model="tiny-qwen3", rank=8).result()

        def step(n: int) -> None:
            data = [sft_datum(random_tokens(1000 * t + 10 * n + i, tokens, VOCAB)) for i in range(datums)]
            training.forward_backward(data, "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result()

        for n in range(warmup):
            step(n)
        ready.wait()
        for n in range(warmup, warmup + steps):
            step(n)
        finished.append(time.perf_counter())

    threads = [threading.Thread(target=tenant, args=(t,)) for t in range(TENANTS)]
    for thread in threads:
        thread.start()
    ready.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    elapsed = max(finished) - started
    return {"steps": TENANTS * steps, "seconds": elapsed, "steps_per_s": TENANTS * steps / elapsed}


def main() -> None:
    args = cpu_parser(__doc__ or "").parse_args()
    steps, warmup, datums, tokens = (4, 1, 4, 64) if args.quick else (20, 2, 8, 128)
    header("Trainer groups: aggregate steps/s", args.quick, tenants=TENANTS, steps=steps, warmup=warmup, datums=datums, tokens=tokens)
    rows = []
    for label, env in (
        ("1 group x 4 slots", {"TINKERD_NUM_SLOTS": "4"}),
        ("2 groups x 2 slots", {"TINKERD_NUM_SLOTS": "2", "TINKERD_TRAINER_GROUPS": "a,b"}),
    ):
        with running_stack({"OMP_NUM_THREADS": "1", **env}) as stack:
            got = run(stack.base_url, steps, warmup, datums, tokens)
        rows.append({"config": label, **got})
        print(f"{label}: {got}", flush=True)
    rows[1]["vs_one"] = rows[1]["steps_per_s"] / rows[0]["steps_per_s"]
    rows[0]["vs_one"] = 1.0
    table(
        "Aggregate training steps/s, 4 tenants at once",
        rows,
        [("configuration", "config"), ("timed steps", "steps"), ("wall s", "seconds"), ("steps/s", "steps_per_s"), ("x one group", "vs_one")],
    )
    footer()


if __name__ == "__main__":
    main()
