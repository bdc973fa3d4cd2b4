"""Rebuilding a lost group's model in another group (`AdoptSlot`, services/trainer/adoption.py),
from the lost group's snapshot and later units alone, with real engines and no bus: the lost
group's units here carry only the adopted model's datums, so the rebuild re-runs the very same
computations and must agree bit for bit (CPU fp32)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from libs.contracts.common import AdamParams, BusDatum, BusTensor, LoraConfig
from libs.contracts.outcomes import BarrierOutcome
from libs.contracts.work import (
    AdoptSlot,
    BarrierUnit,
    InitSlot,
    PageIn,
    PageOut,
    StepSlot,
    Unit,
    UnitItem,
    WorkUnit,
)
from services.trainer import adoption
from services.trainer.engine import EngineConfig, TrainerEngine
from services.trainer.execute import Executor
from services.trainer.state import paging, slots, snapshots

HP = AdamParams(learning_rate=5e-3)
VOCAB = 2048  # tiny-qwen3


def datum(seed: int, n: int = 6) -> BusDatum:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, VOCAB, size=n + 1)
    return BusDatum(
        tokens=tokens[:-1].astype("<i4").tobytes(),
        inputs={
            "target_tokens": BusTensor.of(tokens[1:].astype(np.int64)),
            "weights": BusTensor.of(np.ones(n, dtype=np.float32)),
        },
    )


class Group:
    """One trainer group's executor, and the units it ran (all with outcomes here)."""

    def __init__(self, qwen_dir: Path, data_dir: Path, name: str) -> None:
        engine = TrainerEngine(EngineConfig(str(qwen_dir), num_slots=2, max_lora_rank=8))
        pages = paging.PageStore(data_dir / "trainer" / name / "paged", 1 << 40)
        self.takeovers = adoption.Takeovers()
        self.executor = Executor(engine, "tiny-qwen3", data_dir, pages, adopt=self.takeovers)
        self.name, self.data_dir = name, data_dir
        self.units: list[tuple[int, Unit]] = []
        self.n = 0

    def run(self, unit: Unit) -> None:
        self.n += 1
        self.executor.execute(unit, False)
        self.units.append((self.n, unit))

    def fb(self, model: str, slot: int, seed: int) -> None:
        items = [UnitItem(model, f"{model}:{seed}", i, slot, datum(seed * 10 + i)) for i in range(2)]
        self.run(WorkUnit(unit_id=f"u{self.n + 1:04d}", group=self.name, forward_only=False, loss_fn="cross_entropy", items=items))

    def barrier(self, *ops: object) -> None:
        self.run(BarrierUnit(unit_id=f"u{self.n + 1:04d}", group=self.name, ops=list(ops)))  # type: ignore[arg-type]

    def snapshot(self) -> Path:
        ex = self.executor
        return snapshots.take(ex.engine, dict(ex.slot_models), ex.pages, self.data_dir, self.name, self.n)

    def state(self, slot: int) -> dict[str, torch.Tensor]:
        captured = slots.capture(self.executor.engine, slot)
        tables = {"adapter": captured.adapter, "exp_avg": captured.exp_avg, "exp_avg_sq": captured.exp_avg_sq}
        tables["grad"] = captured.grads
        tensors = {f"{t}.{k}": v for t, table in tables.items() for k, v in table.items()}
        return tensors | {"step": torch.tensor(captured.step), "pending": torch.tensor(captured.pending)}


def adopt(group: Group, source: adoption.Source, model: str, slot: int, lost: str = "a") -> BarrierOutcome:
    op = AdoptSlot(model_id=model, request_id=f"{model}:page", slot=slot, from_group=lost)
    group.takeovers.sources = {lost: source}
    outcome, _ = group.executor.execute(BarrierUnit(unit_id="u9000", group=group.name, ops=[op]), False)
    assert isinstance(outcome, BarrierOutcome)
    return outcome


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_a_model_is_rebuilt_exactly_from_the_lost_groups_snapshot_and_later_units(qwen_dir: Path, tmp_path: Path) -> None:
    """On group a: m created and stepped, a snapshot, then more steps, a page-out (n takes its
    slot) and a page-in from a's own store, and a forward_backward left pending. Group b adopts
    m from the snapshot plus the later units that touch it (n's ops are skipped): m's adapter,
    moments, step and pending gradients equal a's bit for bit; the state is written to
    `adopted_path`, and a replay of the takeover (b's recovery) restores the same from there."""
    a = Group(qwen_dir, tmp_path, "a")
    a.barrier(InitSlot(model_id="m", request_id="m:0", slot=0, lora=LoraConfig(rank=4, seed=7)))
    a.fb("m", 0, 1)
    a.barrier(StepSlot(model_id="m", request_id="m:2", slot=0, adam=HP))
    snapshot = a.snapshot()
    a.fb("m", 0, 3)
    a.barrier(StepSlot(model_id="m", request_id="m:4", slot=0, adam=HP))
    a.barrier(
        PageOut(model_id="m", request_id="m:page", slot=0),
        InitSlot(model_id="n", request_id="n:0", slot=0, lora=LoraConfig(rank=2, seed=9)),
    )
    a.fb("n", 0, 5)
    a.barrier(PageOut(model_id="n", request_id="n:page", slot=0), PageIn(model_id="m", request_id="m:page", slot=0))
    a.fb("m", 0, 6)  # pending at the takeover
    want = a.state(0)

    b = Group(qwen_dir, tmp_path, "b")
    later = [unit for seq, unit in a.units if seq > int(snapshot.name)]
    source = adoption.Source(snapshot, int(snapshot.name), later)
    outcome = adopt(b, source, "m", 1)
    assert [op.ok for op in outcome.ops] == [True], outcome
    assert b.executor.slot_models == {1: "m"}
    assert_same(b.state(1), want)
    assert adoption.adopted_path(tmp_path, "m", "u9000").exists()

    replayed = Group(qwen_dir, tmp_path, "b")
    op = AdoptSlot(model_id="m", request_id="m:page", slot=1, from_group="a")
    replayed.executor.execute(BarrierUnit(unit_id="u9000", group="b", ops=[op]), True)
    assert_same(replayed.state(1), want)


def test_a_model_with_no_snapshot_is_rebuilt_from_every_unit_and_one_with_no_state_fails(
    qwen_dir: Path, tmp_path: Path
) -> None:
    """Without a snapshot the rebuild re-runs every unit of the model from its create (a seeded
    init) and matches bit for bit; a model the lost group never held fails its AdoptSlot with a
    message naming the model and the group (unless `fresh`: its create follows in the unit)."""
    a = Group(qwen_dir, tmp_path, "a")
    a.barrier(InitSlot(model_id="m", request_id="m:0", slot=1, lora=LoraConfig(rank=4, seed=3)))
    a.fb("m", 1, 1)
    a.barrier(StepSlot(model_id="m", request_id="m:2", slot=1, adam=HP))
    want = a.state(1)
    b = Group(qwen_dir, tmp_path, "b")
    source = adoption.Source(None, 0, [unit for _, unit in a.units])
    assert [op.ok for op in adopt(b, source, "m", 0).ops] == [True]
    assert_same(b.state(0), want)

    (failed,) = adopt(b, source, "ghost", 1).ops
    assert not failed.ok and "no state of model ghost" in (failed.error or "") and "group a" in (failed.error or "")
    fresh = AdoptSlot(model_id="ghost", request_id="ghost:page", slot=1, from_group="a", fresh=True)
    b.takeovers.sources = {"a": source}
    outcome, _ = b.executor.execute(BarrierUnit(unit_id="u9001", group="b", ops=[fresh]), False)
    assert isinstance(outcome, BarrierOutcome) and [op.ok for op in outcome.ops] == [True]
    assert 1 not in b.executor.slot_models
