"""A pure driver for the planner: commands in, units out, a fake trainer's outcomes back in.

`Sim` keeps the whole history (commands with their arrival numbers, units, outcomes) so a test
can rebuild a fresh planner from any prefix, as the planner service does on restart (every
command, then every unit, then every outcome, through `Planner.apply`), and it counts how often
each request completed (exactly once is the invariant).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from libs.contracts import codec
from libs.contracts.common import AdamParams, BusDatum, BusTensor, LoraConfig
from libs.contracts.ids import HANDOFF
from libs.contracts.outcomes import BarrierOutcome, DatumOutcome, OpOutcome, Outcome, WorkOutcome
from libs.contracts.requests import (
    CreateModel,
    ForwardBackward,
    ModelCommand,
    OptimStep,
    Rejected,
    SaveForSampler,
    SaveWeights,
    UnloadModel,
)
from libs.contracts.results import Failure, ResultBody
from libs.contracts.work import (
    BarrierUnit,
    DiscardSlot,
    ExportSlot,
    FailRequest,
    SaveSlot,
    Unit,
    WorkUnit,
)
from services.planner.facts import CommandArrived, Fact, OutcomeArrived, UnitEmitted
from services.planner.planner import Planner

DISCARDED = (
    "this window's gradients were discarded and no step was applied; resubmit the batch's "
    "forward_backward calls, then optim_step again"
)
"""What the trainer appends to a DiscardSlot's reason (services/trainer/service.py)."""


# --- commands ----------------------------------------------------------------------------------
def rid(model: str, seq: int) -> str:
    return f"{model}:{seq}"


def datum(num_tokens: int, token: int = 1) -> BusDatum:
    tokens = np.full(num_tokens, token, dtype="<i4")
    return BusDatum(
        tokens=tokens.tobytes(),
        inputs={
            "target_tokens": BusTensor.of(np.full(num_tokens, token, dtype=np.int64)),
            "weights": BusTensor.of(np.ones(num_tokens, dtype=np.float32)),
        },
    )


def create(model: str, tenant: str = "tenant-a") -> CreateModel:
    return CreateModel(
        model_id=model,
        seq_id=0,
        request_id=rid(model, 0),
        tenant=tenant,
        session_id="s-1",
        base_model="tiny-qwen3",
        lora=LoraConfig(rank=4),
    )


def fb(
    model: str,
    seq: int,
    sizes: list[int],
    loss_fn: str = "cross_entropy",
    config: dict[str, float | str] | None = None,
    forward_only: bool = False,
) -> ForwardBackward:
    return ForwardBackward(
        model_id=model,
        seq_id=seq,
        request_id=rid(model, seq),
        loss_fn=loss_fn,
        loss_config=config or {},
        forward_only=forward_only,
        data=[datum(n) for n in sizes],
    )


def optim(model: str, seq: int, lr: float = 1e-3) -> OptimStep:
    return OptimStep(model_id=model, seq_id=seq, request_id=rid(model, seq), adam=AdamParams(learning_rate=lr))


def save(model: str, seq: int, name: str = "ckpt") -> SaveWeights:
    return SaveWeights(model_id=model, seq_id=seq, request_id=rid(model, seq), name=name)


def sampler_save(model: str, seq: int, name: str = "snap") -> SaveForSampler:
    return SaveForSampler(model_id=model, seq_id=seq, request_id=rid(model, seq), name=name)


def unload(model: str, seq: int) -> UnloadModel:
    return UnloadModel(model_id=model, seq_id=seq, request_id=rid(model, seq))


def rejected(model: str, seq: int, kind: str, error: str = "refused by the gateway") -> Rejected:
    return Rejected(model_id=model, seq_id=seq, request_id=rid(model, seq), kind=kind, error=error)


# --- the fake trainer ------------------------------------------------------------------------
def trainer_outcome(
    unit: Unit,
    datum_errors: dict[tuple[str, int], str] | None = None,
    unit_error: str | None = None,
    op_errors: dict[str, str] | None = None,
    omit: set[tuple[str, int]] | None = None,
) -> Outcome:
    """What a trainer reports for `unit`; logprobs are -(index+1) per token, loss = token count."""
    if isinstance(unit, WorkUnit):
        if unit_error is not None:
            return WorkOutcome(unit_id=unit.unit_id, error=unit_error)
        datums = []
        for item in unit.items:
            key = (item.request_id, item.index)
            if omit and key in omit:
                continue
            if datum_errors and key in datum_errors:
                datums.append(DatumOutcome(item.request_id, item.index, b"", 0.0, error=datum_errors[key]))
                continue
            n = item.datum.num_tokens
            logprobs = np.full(n, -(item.index + 1), dtype="<f4").tobytes()
            datums.append(DatumOutcome(item.request_id, item.index, logprobs, float(n)))
        return WorkOutcome(unit_id=unit.unit_id, datums=datums)
    assert isinstance(unit, BarrierUnit)
    ops = []
    for op in unit.ops:
        if op_errors and op.request_id in op_errors:
            ops.append(
                OpOutcome(
                    model_id=op.model_id,
                    request_id=op.request_id,
                    ok=False,
                    error=op_errors[op.request_id],
                    category="server",
                )
            )
        elif isinstance(op, DiscardSlot):
            error = f"{op.reason}: {DISCARDED}"
            ops.append(OpOutcome(model_id=op.model_id, request_id=op.request_id, ok=False, error=error))
        elif isinstance(op, FailRequest):
            ops.append(
                OpOutcome(
                    model_id=op.model_id,
                    request_id=op.request_id,
                    ok=False,
                    error=op.error,
                    category=op.category,
                )
            )
        elif isinstance(op, (SaveSlot, ExportSlot)):
            ops.append(
                OpOutcome(
                    model_id=op.model_id, request_id=op.request_id, ok=True, info={HANDOFF: "publisher"}
                )
            )
        else:
            ops.append(
                OpOutcome(model_id=op.model_id, request_id=op.request_id, ok=True, metrics={"grad_norm": 1.0})
            )
    return BarrierOutcome(unit_id=unit.unit_id, ops=ops)


# --- the driver --------------------------------------------------------------------------------
@dataclass
class Sim:
    num_slots: int = 4
    token_budget: int = 1_000
    planner: Planner = field(init=False)
    arrival: int = 0
    commands: list[tuple[ModelCommand, int]] = field(default_factory=list)
    units: list[Unit] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    history: list[tuple[str, int]] = field(default_factory=list)  # ("command"|"unit"|"outcome", index)
    results: dict[str, list[ResultBody | None]] = field(default_factory=lambda: defaultdict(list))
    sent: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.planner = Planner(num_slots=self.num_slots, token_budget=self.token_budget)

    def send(self, *commands: ModelCommand) -> list[bool]:
        accepted = []
        for command in commands:
            self.arrival += 1
            accepted.append(self.planner.apply(CommandArrived(command, self.arrival, now_ns=self.arrival)))
            self.history.append(("command", len(self.commands)))
            self.commands.append((command, self.arrival))
            self.sent.add(command.request_id)
        self._record(self.planner.collect())
        return accepted

    def plan(self) -> list[Unit]:
        units = self.planner.plan()
        for unit in units:
            self.history.append(("unit", len(self.units)))
            self.units.append(unit)
        self._record(self.planner.collect())
        return units

    def finish(self, unit: Unit, outcome: Outcome | None = None, **faults: object) -> Outcome:
        outcome = outcome or trainer_outcome(unit, **faults)  # type: ignore[arg-type]
        self.history.append(("outcome", len(self.outcomes)))
        self.outcomes.append(outcome)
        self.planner.apply(OutcomeArrived(outcome))
        self._record(self.planner.collect())
        return outcome

    def run(self) -> list[Unit]:
        """Plan and finish everything plannable (a healthy trainer); returns the units run."""
        done: list[Unit] = []
        while units := self.plan():
            for unit in units:
                self.finish(unit)
            done += units
        return done

    def _record(self, completions: list) -> None:  # type: ignore[type-arg]
        for completion in completions:
            self.results[completion.pending.command.request_id].append(completion.body)

    def result(self, request_id: str) -> ResultBody | None:
        bodies = self.results[request_id]
        assert len(bodies) == 1, f"{request_id} completed {len(bodies)} times"
        return bodies[0]

    def failure(self, request_id: str) -> Failure:
        body = self.result(request_id)
        assert isinstance(body, Failure), f"{request_id} did not fail: {body}"
        return body

    def assert_all_completed_once(self) -> None:
        for request_id in self.sent:
            assert len(self.results[request_id]) == 1, (
                f"{request_id}: {len(self.results[request_id])} completions"
            )

    def replayed(self, upto: int | None = None, start: Planner | None = None, after: int = 0) -> Planner:
        """A planner rebuilt as the service does on start: `start` (a snapshot's planner, taken at
        history entry `after`; a fresh planner if None), then every command, then every unit, then
        every outcome of history entries `after` to `upto`."""
        history = self.history[after:upto] if upto is not None else self.history[after:]
        fresh = start or Planner(num_slots=self.num_slots, token_budget=self.token_budget)
        for kind in ("command", "unit", "outcome"):
            for what, index in history:
                if what == kind:
                    fresh.apply(self.fact(what, index))
        fresh.collect()
        return fresh

    def fact(self, what: str, index: int) -> Fact:
        """History entry (`what`, `index`) as the fact the planner folds."""
        if what == "command":
            command, arrival = self.commands[index]
            return CommandArrived(command, arrival, now_ns=arrival)
        if what == "unit":
            return UnitEmitted(self.units[index])
        return OutcomeArrived(self.outcomes[index])


def encoded(units: list[Unit]) -> list[bytes]:
    return [codec.pack(unit) for unit in units]
