"""Rank entry points for test_group.py (importable: spawn pickles the target by name)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from services.trainer import group

TIMEOUT_S = 5.0
"""The freeze scenario's collective timeout; rank 0 pings every PING_S while idle."""
PING_S = 1.0
FREEZE_S = 3 * TIMEOUT_S


class ToyEngine:
    """Engine-shaped: public methods that enter collectives, as TrainerEngine's do."""

    def total(self, x: float) -> float:
        """The sum of `x` over the ranks (every rank must call it)."""
        value = torch.tensor([x])
        dist.all_reduce(value)
        return float(value.item())

    def twice(self, x: float) -> float:
        return self.total(x) + self.total(x)  # calls to itself are not broadcast again

    def reject(self, x: float) -> float:
        raise ValueError(f"bad x {x}")  # every rank refuses alike: a caller's error

    def die_on_follower(self) -> float:
        if dist.get_rank() > 0:
            os._exit(9)  # a rank killed inside a call
        return self.total(1.0)

    def freeze_on_follower(self) -> float:
        if dist.get_rank() > 0:
            time.sleep(FREEZE_S)  # alive but not answering, for longer than the group's timeout
        return self.total(1.0)

    def fail_on_follower(self) -> float:
        if dist.get_rank() > 0:
            raise RuntimeError("out of memory")  # only one rank fails: the states may differ
        return 0.0


def run_rank(rank: int, world: int, store: str, out: str, last: str) -> None:
    """Rank 0 leads: total, twice, reject, then `last`; it writes what it saw to `out`.

    Before `freeze_on_follower` the group runs with TIMEOUT_S and stays idle for more than twice
    that (its pings keep the follower waiting), then makes one more call."""
    os.environ.update({group.GROUP_STORE: store}, RANK=str(rank), WORLD_SIZE=str(world))
    freeze = last == "freeze_on_follower"
    control = group.init_rank("cpu", collective_timeout_s=TIMEOUT_S if freeze else 60)
    engine = ToyEngine()
    if rank > 0:
        group.follow(cast(Any, engine), control)
        dist.destroy_process_group()  # as services.trainer.service.follow_rank does
        return
    leader = group.lead(cast(Any, engine), control, ping_every_s=PING_S)
    seen: dict[str, Any] = {"total": engine.total(2.0), "twice": engine.twice(1.0)}
    try:
        engine.reject(3.0)
    except ValueError as exc:
        seen["reject"] = str(exc)
    seen["after_reject"] = engine.total(1.0)
    if freeze:
        time.sleep(2.5 * TIMEOUT_S)  # an idle group (no calls): not a synchronisation
        seen["after_idle"] = engine.total(1.0)
    Path(out).write_text(json.dumps(seen))
    if last:
        seen[last] = getattr(engine, last)()  # must not return: the group is broken
        Path(out).write_text(json.dumps(seen))
    leader.close()
    dist.destroy_process_group()
