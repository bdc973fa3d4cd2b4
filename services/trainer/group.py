"""One tensor-parallel trainer group: N rank processes started by the trainer itself.

``tinkerd serve trainer --tp N`` (or ``TINKERD_TRAINER_TP=N``) runs ``launch``: it starts N
copies of ``tinkerd serve trainer`` with the variables torchrun would set (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) and, instead of a rendezvous port, a file
store in a fresh private directory (``TINKERD_GROUP_STORE``): no port is picked, so none can be
taken in between.  A process started with ``RANK`` set is one rank (whoever started it: this
launcher, or torchrun or an orchestrator with ``MASTER_ADDR``/``MASTER_PORT``), and joins the
group with ``init_rank``.

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
After every call the ranks agree whether it succeeded (``_agree``); a peer gone mid-call, or
ranks that disagree, end the rank with ``BROKEN_EXIT_CODE`` before rank 0 can publish anything
about the call.  Both process groups time out after the trainer's ``unit_timeout_s`` and an idle
rank 0 pings the followers, so a frozen rank ends the group instead of hanging it.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from libs.faults import crash_point

if TYPE_CHECKING:  # the launcher stays light: torch is imported by the ranks only
    from services.trainer.engine import TrainerEngine

log = logging.getLogger("tinkerd.trainer.group")

RANK_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
GROUP_STORE = "TINKERD_GROUP_STORE"
"""A file the ranks rendezvous through (torch.distributed's FileStore), set by ``launch``."""
STOP = "__stop__"
PING = "__ping__"
LAUNCHER_PID = "TINKERD_GROUP_LAUNCHER_PID"
PING_EVERY_S = 30.0
"""An idle rank 0 broadcasts a no-op this often, so that the followers' wait for the next call
never reaches the control group's timeout while the group is healthy."""
GRACE_S = 10.0
"""After a clean exit of one rank (a stop), how long the others get to exit by themselves."""


def rank_env(env: dict[str, str] | os._Environ[str]) -> tuple[int, int] | None:
    """(rank, world size) when this process was started as one rank of a group, else None."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    return int(env["RANK"]), int(env["WORLD_SIZE"])


# --- the launcher ---------------------------------------------------------------------------
def launch(tp: int, argv: list[str] | None = None) -> int:
    """Start `tp` ranks of this trainer and supervise them as one; returns the exit code.

    On GPU each rank takes the GPU of its ``LOCAL_RANK`` (``init_rank``).

    Args:
        tp: the number of ranks (the tensor-parallel size).
        argv: the command each rank runs (default: ``python -m tinkerd.cli serve trainer``).
    """
    command = argv or [sys.executable, "-m", "tinkerd.cli", "serve", "trainer"]
    with tempfile.TemporaryDirectory(prefix="tinkerd-group-") as private:
        return _launch(tp, command, str(Path(private) / "store"))


def _launch(tp: int, command: list[str], store: str) -> int:
    ranks: list[subprocess.Popen[bytes]] = []
    for rank in range(tp):
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        env.update(
            {GROUP_STORE: store},
            RANK=str(rank),
            WORLD_SIZE=str(tp),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(tp),
        )
        env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink SHARP off unless asked for (docs/gpu.md)
        env[LAUNCHER_PID] = str(os.getpid())
        if rank:
            env.pop("TINKERD_LIVENESS_FILE", None)  # rank 0's event loop speaks for the group
        ranks.append(subprocess.Popen(command, env=env))
    log.info("started trainer group of %d ranks (pids %s, rendezvous file %s)", tp, [p.pid for p in ranks], store)
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
    stopped = stopping.is_set()  # SIGTERM/SIGINT: every rank was told; give them time to finish
    if not stopped:
        what = "exited on its own" if code == 0 else f"exited with code {code}"
        log.error("rank %d (pid %d) %s: taking the trainer group down", rank, pid, what)
    deadline = time.monotonic() + (GRACE_S if stopped or code == 0 else 0.0)
    for other in ranks:
        if other is first:
            continue
        try:
            other.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            other.kill()  # may be blocked in a collective the dead rank will never join
            other.wait()
    if stopped:
        return 0
    return code if code > 0 else (1 if code == 0 else 128 - code)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the launcher) dies."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher and os.getppid() != int(launcher):  # it died before the request took effect
        os._exit(1)


# --- joining the group ----------------------------------------------------------------------
def init_rank(device: str, collective_timeout_s: float) -> Any:
    """Join the group described by the torchrun-style variables; returns the control group.

    The default group (gloo on CPU, NCCL on GPU) carries the engine's collectives; the control
    group (always gloo) carries the broadcast calls and the agreements. Both time out after
    `collective_timeout_s`: a rank that froze (alive, not answering) ends the group then, since
    rank 0 pings the followers while it is idle (``Leader``).
    """
    import torch
    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    store = os.environ.get(GROUP_STORE)
    if store:  # the launcher's file store: no rendezvous port
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world, timeout=timeout)
    else:  # torchrun or an orchestrator: MASTER_ADDR and MASTER_PORT
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=collective_timeout_s))


def _public_methods(engine: TrainerEngine) -> list[str]:
    return [
        name
        for name, value in vars(type(engine)).items()
        if not name.startswith("_") and callable(value) and not isinstance(value, (staticmethod, classmethod, property))
    ]


BROKEN_EXIT_CODE = 71
"""A rank's exit code when its group is broken: a peer is gone, or the ranks disagree about
whether a call succeeded (their states may differ). The group restarts and recovery replays."""


def _exit_broken(why: str) -> None:
    log.error("the trainer group is broken (%s); exiting so that the whole group restarts", why)
    logging.shutdown()
    os._exit(BROKEN_EXIT_CODE)


def _agree(ok: bool, control: Any) -> bool:
    """Whether every rank's call succeeded (True) or every rank's failed (False).

    Runs after every call on every rank. A peer that died makes the exchange fail, and ranks that
    disagree may hold different states: both end this process (``BROKEN_EXIT_CODE``) before any
    outcome of the call is published, so the unit is delivered again to the restarted group.
    """
    import torch
    import torch.distributed as dist

    flags = torch.tensor([int(ok)], dtype=torch.int64)
    try:
        dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=control)
    except RuntimeError as exc:
        _exit_broken(f"a rank is gone or frozen: {str(exc).splitlines()[0][:200]}")
    total, world = int(flags.item()), dist.get_world_size()
    if total not in (0, world):
        _exit_broken(f"{total} of {world} ranks completed a call the others failed")
    return total == world


class Leader:
    """Rank 0's side: broadcast each outermost engine call, then run it here."""

    def __init__(self, engine: TrainerEngine, control: Any, ping_every_s: float = PING_EVERY_S) -> None:
        self.engine = engine
        self.control = control
        self.lock = threading.Lock()  # one call at a time, in one order on every rank
        self.local = threading.local()  # calls the engine makes to itself are not broadcast
        self.closed = False
        self.stopped = threading.Event()
        self.last_call = time.monotonic()
        for name in _public_methods(engine):
            setattr(engine, name, self._wrap(name, getattr(engine, name)))
        threading.Thread(target=self._ping, args=(ping_every_s,), name="tp-ping", daemon=True).start()

    def _ping(self, every_s: float) -> None:
        import torch.distributed as dist

        while not self.stopped.wait(every_s / 2):
            with self.lock:
                if self.closed or time.monotonic() - self.last_call < every_s / 2:
                    continue
                try:
                    dist.broadcast_object_list([(PING, (), {})], src=0, group=self.control)
                except RuntimeError as exc:
                    _exit_broken(f"a rank is gone or frozen: {str(exc).splitlines()[0][:200]}")
                self.last_call = time.monotonic()

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if getattr(self.local, "inside", False):
                return method(*args, **kwargs)
            import torch.distributed as dist

            with self.lock:
                if self.closed:
                    raise RuntimeError("the trainer group is stopping")
                try:
                    dist.broadcast_object_list([(name, args, kwargs)], src=0, group=self.control)
                except RuntimeError as exc:
                    _exit_broken(f"a rank is gone: {str(exc).splitlines()[0][:200]}")
                self.local.inside = True
                failure: BaseException | None = None
                try:
                    result = method(*args, **kwargs)
                except Exception as exc:  # re-raised below if every rank failed alike
                    failure = exc
                finally:
                    self.local.inside = False
                agreed = _agree(failure is None, self.control)
                self.last_call = time.monotonic()
                if not agreed:
                    assert failure is not None
                    raise failure
                return result

        return call

    def close(self) -> None:
        """Tell the followers to exit (rank 0 is stopping)."""
        import torch.distributed as dist

        self.stopped.set()
        with self.lock:
            if not self.closed:
                self.closed = True
                try:
                    dist.broadcast_object_list([(STOP, (), {})], src=0, group=self.control)
                except RuntimeError as exc:  # a follower already gone (signalled with the group)
                    log.info("could not tell every rank to stop (%s); the launcher stops them", exc)


def lead(engine: TrainerEngine, control: Any, ping_every_s: float = PING_EVERY_S) -> Leader:
    """Make `engine` (rank 0's) broadcast every public call to the followers."""
    return Leader(engine, control, ping_every_s)


def follow(engine: TrainerEngine, control: Any) -> None:
    """A follower's loop: run every call rank 0 broadcasts until it says stop.

    A call that raises here must have raised on rank 0 too (same inputs, same checks): rank 0
    turns it into the unit's outcome and the follower goes on; ``_agree`` ends the group when
    the ranks differ.
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    calls = 0
    while True:
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=control)
        except RuntimeError as exc:
            _exit_broken(f"rank 0 is gone or frozen: {str(exc).splitlines()[0][:200]}")
        name, args, kwargs = box[0]
        if name == PING:
            continue
        if name == STOP:
            log.info("rank %d stops after %d calls (rank 0 is stopping)", rank, calls)
            return
        calls += 1
        crash_point(f"trainer.follower.{name}")  # fault tests: a rank dies inside a call
        ok = True
        try:
            getattr(engine, name)(*args, **kwargs)
        except Exception as exc:
            ok = False
            log.debug("rank %d: %s raised %s: %s", rank, name, type(exc).__name__, exc)
        _agree(ok, control)
