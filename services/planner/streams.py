"""Per-model command streams: strict seq_id order, out-of-order buffering, dedupe, windows.

A model's commands execute in seq_id order 0 (create), 1, 2, ... A run of consecutive
forward_backward commands forms a *window*: its datums commute, so the planner may split, pack and
interleave them with other models' datums. Every other command is a *barrier* that runs alone, once
everything before it has completed.

Gradient windows: the commands between two optim_steps (in seq_id order) share one gradient
window, numbered by how many optim_step commands precede them. A command's window is fixed when it
is sequenced, so facts about a window (it holds gradients, it is poisoned) do not depend on the
order in which outcomes are folded: a replay that folds every unit before every outcome reaches
the same state as the live run that interleaved them.

Pure state: no I/O, no clocks except the `now_ns` arguments callers pass in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.contracts.requests import (
    CreateModel,
    ForwardBackward,
    ModelCommand,
    OptimStep,
    Rejected,
    UnloadModel,
)
from libs.contracts.results import DatumResult

SEALED = "sealed"
"""`Rejected.kind` of a seq_id the planner sealed after the gap timeout (its content is unknown)."""


@dataclass
class Pending:
    """A command that has been sequenced and not yet completed."""

    command: ModelCommand
    arrival: int  # global arrival order (the request stream's sequence number)
    window: int = 0  # gradient window: how many optim_step commands precede it
    issued: int = 0  # window commands: datums handed to units so far
    done: int = 0  # window commands: datums whose outcome arrived
    outputs: list[DatumResult | None] = field(default_factory=list)
    error: str | None = None
    category: str = "user"
    barrier_issued: bool = False
    finished: bool = False  # barriers: their outcome arrived
    metrics: dict[str, float] = field(default_factory=dict)  # barriers: what the trainer reported
    info: dict[str, str] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        command = self.command
        if isinstance(command, Rejected):
            return command.kind
        return str(type(command).__struct_config__.tag)

    @property
    def is_window(self) -> bool:
        return isinstance(self.command, ForwardBackward) or (
            isinstance(self.command, Rejected) and self.command.kind in ("forward_backward", "forward")
        )

    @property
    def trains(self) -> bool:
        """A forward_backward that accumulates gradients (forward-only passes never do)."""
        command = self.command
        if isinstance(command, ForwardBackward):
            return not command.forward_only
        return isinstance(command, Rejected) and command.kind == "forward_backward"

    @property
    def num_datums(self) -> int:
        return len(self.command.data) if isinstance(self.command, ForwardBackward) else 0

    @property
    def complete(self) -> bool:
        if isinstance(self.command, Rejected):
            return True
        if self.is_window:
            return self.done >= self.num_datums
        return self.finished


@dataclass
class ModelStream:
    model_id: str
    tenant: str = ""
    watermark: int = -1  # highest seq_id moved into `queue` (create is seq 0)
    buffered: dict[int, tuple[ModelCommand, int]] = field(default_factory=dict)
    queue: list[Pending] = field(default_factory=list)
    slot: int | None = None  # the adapter slot it holds (resident), None when it holds none
    paged: bool = False  # its training state is in the trainer's page store (not resident)
    group: str = ""  # the trainer group holding its state (resident, or paged in its store)
    base_model: str = ""  # from its create_model: it is placed only on groups of this base
    page_file: str = ""  # its last page-out's export (data-dir relative), "" when not exported
    last_used: int = -1  # number of the last unit that served it: least recently used goes first
    created: bool = False
    closed: bool = False
    closed_reason: str = ""  # completes "model <id> ..." in the error of requests that cannot run
    optims_seen: int = 0  # optim_step commands sequenced so far = the window of the next command
    windows_done: int = 0  # gradient windows consumed by an optim_step barrier (step or discard)
    dirty: set[int] = field(default_factory=set)  # windows in which a forward_backward left gradients
    poison: dict[int, str] = field(default_factory=dict)  # window -> why it can no longer be applied
    gap_since_ns: int | None = None
    unloading: bool = False  # an unload is queued: the model closes once it runs

    def accept(self, command: ModelCommand, arrival: int, now_ns: int) -> list[Pending] | None:
        """Take a command; returns the commands it made runnable, None if its seq_id was already seen
        (a duplicate has no effect)."""
        seq = command.seq_id
        if isinstance(command, UnloadModel) and seq < 0:
            # Lifecycle, not a client seq_id (session finished, or unload_model): runs after
            # everything sequenced so far; anything sequenced later finds the model closed.
            if self.unloading:
                return None
            self.unloading = True
            return [self._sequence(command, arrival)]
        if seq <= self.watermark or seq in self.buffered:
            return None
        before = self.watermark
        self.buffered[seq] = (command, arrival)
        sequenced: list[Pending] = []
        while self.watermark + 1 in self.buffered:
            self.watermark += 1
            cmd, arr = self.buffered.pop(self.watermark)
            sequenced.append(self._sequence(cmd, arr))
        if not self.buffered:
            self.gap_since_ns = None
        elif self.gap_since_ns is None or self.watermark != before:
            self.gap_since_ns = now_ns  # a new hole: its timeout starts now
        return sequenced

    def _sequence(self, cmd: ModelCommand, arrival: int) -> Pending:
        pending = Pending(cmd, arrival, window=self.optims_seen)
        if pending.is_window:
            pending.outputs = [None] * pending.num_datums
        if cmd.seq_id == 0 and not isinstance(cmd, UnloadModel):
            if isinstance(cmd, CreateModel):
                self.tenant, self.base_model = cmd.tenant, cmd.base_model
            else:
                self.close("was never created (its create_model, seq_id 0, did not arrive)")
        if isinstance(cmd, OptimStep):
            self.optims_seen += 1
        elif isinstance(cmd, Rejected) and (pending.trains or cmd.kind == SEALED):
            # A refused chunk, or a seq_id whose content never arrived (it may have been a chunk),
            # leaves this window incomplete.
            how = "never arrived (sealed)" if cmd.kind == SEALED else "was rejected"
            what = "seq_id" if cmd.kind == SEALED else "forward_backward seq_id"
            self.poison_window(pending.window, f"{what} {cmd.seq_id} {how}")
        self.queue.append(pending)
        return pending

    def close(self, reason: str) -> None:
        self.closed = True
        self.closed_reason = self.closed_reason or reason

    # --- gradient windows ---------------------------------------------------------------------
    def mark_dirty(self, window: int) -> None:
        if window >= self.windows_done:
            self.dirty.add(window)

    def poison_window(self, window: int, reason: str) -> None:
        if window >= self.windows_done:
            self.poison.setdefault(window, reason)

    def consume_window(self) -> None:
        """An optim_step barrier was emitted: it consumes the oldest open window, step or discard."""
        self.windows_done += 1
        self.dirty = {w for w in self.dirty if w >= self.windows_done}
        self.poison = {w: r for w, r in self.poison.items() if w >= self.windows_done}

    @property
    def pending_grads(self) -> bool:
        """forward_backward gradients accumulated and not yet consumed by an optim_step."""
        return any(w >= self.windows_done for w in self.dirty)

    # --- scheduling ---------------------------------------------------------------------------
    @property
    def missing_seq(self) -> int | None:
        """The seq_id the stream is waiting for, when later ones are buffered."""
        return self.watermark + 1 if self.buffered else None

    def open_window(self) -> list[Pending]:
        """The leading run of window commands: all of their datums may be issued now.

        A completed barrier, or a refused one (`Rejected` optim_step, a sealed seq_id: nothing to
        run), does not end the run.
        """
        run = []
        for pending in self.queue:
            if pending.is_window:
                run.append(pending)
            elif not pending.complete:
                break
        return run

    def oldest_runnable(self) -> Pending | None:
        """The oldest command that could be handed to a trainer now: a window command with
        datums left to issue, or the ready barrier."""
        rows = [p for p in self.open_window() if p.issued < p.num_datums]
        barrier = self.ready_barrier()
        candidates = [*rows, *([barrier] if barrier is not None else [])]
        return min(candidates, key=lambda p: p.arrival) if candidates else None

    def ready_barrier(self) -> Pending | None:
        """The first barrier when everything before it has completed and it was not issued yet."""
        for pending in self.queue:
            if pending.complete:
                continue
            if pending.is_window or pending.barrier_issued:
                return None
            return pending
        return None

    def pop_completed(self) -> list[Pending]:
        """Remove completed commands from the head, in order."""
        done = []
        while self.queue and self.queue[0].complete:
            done.append(self.queue.pop(0))
        return done
