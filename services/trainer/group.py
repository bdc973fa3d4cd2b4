"""One tensor-parallel trainer group: N rank processes started by the trainer itself.

``tinkerd serve trainer --tp N`` (or ``TINKERD_TRAINER_TP=N``) runs ``launch``: it picks a
rendezvous port and starts N copies of ``tinkerd serve trainer`` with the variables torchrun
would set (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``).  A process started with ``RANK`` set is one rank (whoever started it:
this launcher, torchrun, or an orchestrator), and joins the group with ``init_rank``.

Roles inside the group:

* **Rank 0** is the trainer the rest of the stack sees: it alone consumes the group's work
  subject, recovers, writes checkpoints and snapshots, publishes outcomes and heartbeats.  Its
  engine is wrapped by ``lead`` so that every public engine call is first broadcast to the
  other ranks (over a gloo control group, also on GPU) and then run locally.
* **Ranks 1..N-1** run ``follow``: they receive each call and run it on their own engine shard,
  so every collective inside the engine is entered by all ranks in the same order with the same
  arguments.  Their results are dropped; rank 0's are the group's.

Failure: the group lives and dies as one.  The launcher waits for any rank to exit; when one
does, it kills the others (SIGKILL: a survivor may be blocked in a collective that will never
complete) and exits with the dead rank's code, so the supervisor restarts the whole group and
rank 0's recovery replays exactly as for a one-process trainer.  Every rank also asks the
kernel to kill it if the launcher dies (``PR_SET_PDEATHSIG``), so no rank outlives its group.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from services.trainer.engine import TrainerEngine
from services.trainer.parallel import free_port

log = logging.getLogger("tinkerd.trainer.group")

RANK_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
STOP = "__stop__"
IDLE_TIMEOUT = datetime.timedelta(days=365)
"""The control group's timeout: a follower waits for the next call as long as the group is idle
(a dead rank is the launcher's to notice, not a timeout's)."""
GRACE_S = 10.0
"""After a clean exit of one rank (a stop), how long the others get to exit by themselves."""


def rank_env(env: dict[str, str] | os._Environ[str]) -> tuple[int, int] | None:
    """(rank, world size) when this process was started as one rank of a group, else None."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    return int(env["RANK"]), int(env["WORLD_SIZE"])


# --- the launcher ---------------------------------------------------------------------------
def launch(tp: int, device: str, argv: list[str] | None = None) -> int:
    """Start `tp` ranks of this trainer and supervise them as one; returns the exit code.

    Args:
        tp: the number of ranks (the tensor-parallel size).
        device: the trainer's device setting; on ``cuda`` each rank gets ``LOCAL_RANK``'s GPU and
            ``NCCL_NVLS_ENABLE`` defaults to 0 (NVLink SHARP off: see docs/gpu.md).
        argv: the command each rank runs (default: ``python -m infra.cli serve trainer``).
    """
    command = argv or [sys.executable, "-m", "infra.cli", "serve", "trainer"]
    port = free_port()
    ranks: list[subprocess.Popen[bytes]] = []
    for rank in range(tp):
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(tp),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(tp),
        )
        if device != "cpu":
            env.setdefault("NCCL_NVLS_ENABLE", "0")
        if rank:
            env.pop("TINKERD_LIVENESS_FILE", None)  # rank 0's event loop speaks for the group
        ranks.append(subprocess.Popen(command, env=env))
    log.info("started trainer group of %d ranks (pids %s, rendezvous port %d)", tp, [p.pid for p in ranks], port)
    stopping = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stopping.set()
        for p in ranks:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return _wait_group(ranks, stopping)


def _wait_group(ranks: list[subprocess.Popen[bytes]], stopping: threading.Event) -> int:
    by_pid = {p.pid: (rank, p) for rank, p in enumerate(ranks)}
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 1
        if pid in by_pid:
            break
    rank, first = by_pid[pid]
    first.returncode = code = os.waitstatus_to_exitcode(status)
    clean = code == 0
    if not clean:
        log.error("rank %d (pid %d) exited with code %d: taking the trainer group down", rank, pid, code)
    deadline = time.monotonic() + (GRACE_S if clean else 0.0)
    for other in ranks:
        if other is first:
            continue
        try:
            other.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            other.kill()  # may be blocked in a collective the dead rank will never join
            other.wait()
    if clean and not stopping.is_set():
        log.error("rank %d exited on its own; the trainer group stops", rank)
        return 1
    return 0 if clean else (code if code > 0 else 128 - code)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the launcher) dies."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the launcher died before the request took effect
        os._exit(1)


# --- joining the group ----------------------------------------------------------------------
def init_rank(device: str, collective_timeout_s: float) -> Any:
    """Join the group described by the torchrun-style variables; returns the control group.

    The default group (gloo on CPU, NCCL on GPU) carries the engine's collectives with
    `collective_timeout_s`; the control group (always gloo) carries the broadcast calls.
    """
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend, init_method="env://", timeout=datetime.timedelta(seconds=collective_timeout_s)
    )
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def _public_methods(engine: TrainerEngine) -> list[str]:
    return [
        name
        for name, value in vars(type(engine)).items()
        if not name.startswith("_") and callable(value) and not isinstance(value, (staticmethod, classmethod, property))
    ]


class Leader:
    """Rank 0's side: broadcast each outermost engine call, then run it here."""

    def __init__(self, engine: TrainerEngine, control: Any) -> None:
        self.engine = engine
        self.control = control
        self.lock = threading.Lock()  # one call at a time, in one order on every rank
        self.local = threading.local()  # calls the engine makes to itself are not broadcast
        self.closed = False
        for name in _public_methods(engine):
            setattr(engine, name, self._wrap(name, getattr(engine, name)))

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if getattr(self.local, "inside", False):
                return method(*args, **kwargs)
            with self.lock:
                if self.closed:
                    raise RuntimeError("the trainer group is stopping")
                dist.broadcast_object_list([(name, args, kwargs)], src=0, group=self.control)
                self.local.inside = True
                try:
                    return method(*args, **kwargs)
                finally:
                    self.local.inside = False

        return call

    def close(self) -> None:
        """Tell the followers to exit (rank 0 is stopping)."""
        with self.lock:
            if not self.closed:
                self.closed = True
                dist.broadcast_object_list([(STOP, (), {})], src=0, group=self.control)


def lead(engine: TrainerEngine, control: Any) -> Leader:
    """Make `engine` (rank 0's) broadcast every public call to the followers."""
    return Leader(engine, control)


def follow(engine: TrainerEngine, control: Any) -> None:
    """A follower's loop: run every call rank 0 broadcasts until it says stop.

    An engine call that raises here raised on rank 0 too (same inputs, same checks): rank 0
    turns it into the unit's outcome; the follower just goes on to the next call.
    """
    rank = dist.get_rank()
    calls = 0
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        name, args, kwargs = box[0]
        if name == STOP:
            log.info("rank %d stops after %d calls (rank 0 is stopping)", rank, calls)
            return
        calls += 1
        try:
            getattr(engine, name)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - rank 0 sees and reports the same failure
            log.debug("rank %d: %s raised %s: %s (rank 0 reports it)", rank, name, type(exc).__name__, exc)
