"""Per-model command streams: strict seq_id order, out-of-order buffering, dedupe, windows.

A model's commands execute in seq_id order 0 (create), 1, 2, ... A run of consecutive
forward_backward commands forms a *window*: its datums commute, so the planner may split, pack and
interleave them with other models' datums. Every other command is a *barrier* that runs alone, once
everything before it has completed.

Pure state: no I/O, no clocks except the `now_ns` arguments callers pass in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.contracts.requests import (
    CreateModel,
    ForwardBackward,
    ModelCommand,
    Rejected,
)
from libs.contracts.results import DatumResult


@dataclass
class Pending:
    """A command that has been sequenced and not yet completed."""

    command: ModelCommand
    arrival: int  # global arrival order (the request stream's sequence number)
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
    slot: int | None = None
    created: bool = False
    closed: bool = False
    pending_grads: bool = False  # forward_backward gradients accumulated since the last step
    poisoned: str | None = None  # why the current window can no longer be applied
    gap_since_ns: int | None = None

    def accept(self, command: ModelCommand, arrival: int, now_ns: int) -> bool:
        """Take a command; False if its seq_id was already seen (a duplicate has no effect)."""
        seq = command.seq_id
        if seq <= self.watermark or seq in self.buffered:
            return False
        self.buffered[seq] = (command, arrival)
        while self.watermark + 1 in self.buffered:
            self.watermark += 1
            cmd, arr = self.buffered.pop(self.watermark)
            pending = Pending(cmd, arr)
            if pending.is_window:
                pending.outputs = [None] * pending.num_datums
            if isinstance(cmd, CreateModel):
                self.tenant = cmd.tenant
            self.queue.append(pending)
        self.gap_since_ns = now_ns if self.buffered else None
        return True

    @property
    def missing_seq(self) -> int | None:
        """The seq_id the stream is waiting for, when later ones are buffered."""
        return self.watermark + 1 if self.buffered else None

    def open_window(self) -> list[Pending]:
        """The leading run of window commands: all of their datums may be issued now."""
        run = []
        for pending in self.queue:
            if not pending.is_window:
                break
            run.append(pending)
        return run

    def ready_barrier(self) -> Pending | None:
        """The head command when it is a barrier (everything before it has completed)."""
        if self.queue and not self.queue[0].is_window and not self.queue[0].barrier_issued:
            return self.queue[0]
        return None

    def pop_completed(self) -> list[Pending]:
        """Remove completed commands from the head, in order."""
        done = []
        while self.queue and self.queue[0].complete:
            done.append(self.queue.pop(0))
        return done
