"""Paging a model out of its slot and back is exact: training goes on bit for bit as if it had
never left (CPU fp32), whether its state waited in host memory or on disk, and a snapshot holds
paged models as well as resident ones."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from services.trainer.engine import AdamParams, EngineConfig, LoraConfig, TrainerEngine
from services.trainer.state import paging, slots, snapshots
from services.trainer.tests.helpers import ce_datum

HP = AdamParams(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=5.0)
X = LoraConfig(rank=4, seed=7)
Y = LoraConfig(rank=2, seed=9, train_mlp=False)


def _fb(engine: TrainerEngine, slot: int, step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + step)
    out = engine.forward_backward([ce_datum(rng, slot, 7), ce_datum(rng, slot, 4)], "cross_entropy")
    return [o.logprobs for o in out]


def _state(engine: TrainerEngine, slot: int) -> dict[str, torch.Tensor]:
    state = engine.get_slot_state(slot)
    tables = {"adapter": state.adapter, "exp_avg": state.exp_avg, "exp_avg_sq": state.exp_avg_sq}
    out = {f"{t}.{k}": v for t, table in tables.items() for k, v in table.items()}
    return out | {f"grad.{k}": v for k, v in engine.get_slot_grads(slot).items()}


def _uninterrupted(qwen_dir: Path) -> tuple[list[np.ndarray], dict[str, torch.Tensor]]:
    """X trained alone in slot 0: step, step, forward_backward (gradients pending), step, step."""
    engine = TrainerEngine(EngineConfig(str(qwen_dir), num_slots=2, max_lora_rank=8))
    engine.init_slot(0, X)
    logprobs = []
    for step in range(5):
        logprobs += _fb(engine, 0, step)
        if step != 2:
            engine.optim_step({0: HP})
    return logprobs, _state(engine, 0)


@pytest.fixture(scope="module")
def reference(qwen_dir: Path) -> tuple[list[np.ndarray], dict[str, torch.Tensor]]:
    return _uninterrupted(qwen_dir)


@pytest.mark.parametrize("budget", [1 << 40, 0], ids=["host", "disk"])
def test_a_paged_model_trains_on_bit_identically_after_paging_back_in(
    engine: TrainerEngine,
    reference: tuple[list[np.ndarray], dict[str, torch.Tensor]],
    tmp_path: Path,
    budget: int,
) -> None:
    """X is paged out with gradients pending, Y uses its slot meanwhile, X comes back into
    another slot: its logprobs and final state equal the uninterrupted run's exactly."""
    store = paging.PageStore(tmp_path / "paged", host_budget_bytes=budget)
    engine.init_slot(0, X)
    logprobs = []
    for step in range(3):
        logprobs += _fb(engine, 0, step)
        if step != 2:
            engine.optim_step({0: HP})
    out = store.page_out(engine, 0, "x")
    assert out.where == ("disk" if budget == 0 else "host") and out.nbytes > 0
    assert 0 not in engine.pool.configs and "x" in store
    engine.init_slot(0, Y)  # another model trains in the freed slot
    _fb(engine, 0, 99)
    engine.optim_step({0: HP})
    back = store.page_in(engine, 1, "x")
    assert back.where == out.where and back.nbytes == out.nbytes and "x" not in store
    assert engine.has_pending_grads(1)
    for step in range(3, 5):
        logprobs += _fb(engine, 1, step)
        engine.optim_step({1: HP})
    want_logprobs, want_state = reference
    assert all(np.array_equal(a, b) for a, b in zip(logprobs, want_logprobs, strict=True))
    got = _state(engine, 1)
    assert set(got) == set(want_state)
    for name, value in want_state.items():
        assert torch.equal(got[name], value), name
    assert not list((tmp_path / "paged").glob("*.safetensors"))  # the spill file went on page-in


@pytest.mark.parametrize("budget", [1 << 40, 0], ids=["host", "disk"])
def test_a_model_exported_by_one_group_trains_on_bit_identically_in_another(
    qwen_dir: Path,
    reference: tuple[list[np.ndarray], dict[str, torch.Tensor]],
    tmp_path: Path,
    budget: int,
) -> None:
    """X is paged out of group A's engine with gradients pending and exported to a file; group
    B (another engine, another page store) pages it in from that file: its logprobs and final
    state equal the uninterrupted run's exactly, and B's store holds nothing of it."""
    group_a = TrainerEngine(EngineConfig(str(qwen_dir), num_slots=2, max_lora_rank=8))
    group_b = TrainerEngine(EngineConfig(str(qwen_dir), num_slots=2, max_lora_rank=8))
    store_a = paging.PageStore(tmp_path / "a" / "paged", host_budget_bytes=budget)
    store_b = paging.PageStore(tmp_path / "b" / "paged", host_budget_bytes=budget)
    group_a.init_slot(0, X)
    logprobs = []
    for step in range(3):
        logprobs += _fb(group_a, 0, step)
        if step != 2:
            group_a.optim_step({0: HP})
    store_a.page_out(group_a, 0, "x")
    export = tmp_path / "exports" / "x" / "u1.safetensors"
    store_a.export("x", export)
    moved = store_b.page_in_from(group_b, 1, "x", export)
    assert moved.where == "disk" and moved.nbytes > 0 and "x" not in store_b
    assert group_b.has_pending_grads(1)
    for step in range(3, 5):
        logprobs += _fb(group_b, 1, step)
        group_b.optim_step({1: HP})
    want_logprobs, want_state = reference
    assert all(np.array_equal(a, b) for a, b in zip(logprobs, want_logprobs, strict=True))
    got = _state(group_b, 1)
    assert set(got) == set(want_state)
    for name, value in want_state.items():
        assert torch.equal(got[name], value), name


def test_a_snapshot_holds_paged_models_and_restores_them(
    engine: TrainerEngine, qwen_dir: Path, tmp_path: Path
) -> None:
    """One model resident, one paged in memory, one paged on disk: a snapshot restored into a
    fresh trainer gives back all three states exactly."""
    store = paging.PageStore(tmp_path / "data" / "paged", host_budget_bytes=1 << 40)
    for slot, config in enumerate((X, Y, X)):
        engine.init_slot(slot, config)
        _fb(engine, slot, slot)
        engine.optim_step({slot: HP})
        _fb(engine, slot, 10 + slot)  # pending gradients
    want = {m: _state(engine, s) for s, m in enumerate("abc")}
    store.page_out(engine, 2, "c")
    store.host_budget_bytes = store.host_bytes  # room for c alone (b is smaller)
    store.page_out(engine, 1, "b")  # over budget: the oldest, c, goes to disk
    assert store.state_of("b") is not None and store.file_of("c") is not None
    directory = snapshots.take(engine, {0: "a"}, store, tmp_path / "data", "g", work_seq=42)

    fresh = TrainerEngine(EngineConfig(str(qwen_dir), num_slots=4, max_lora_rank=8))
    restored_store = paging.PageStore(tmp_path / "data2" / "paged", host_budget_bytes=1 << 40)
    work_seq, slot_models = snapshots.restore(fresh, restored_store, directory)
    assert (work_seq, slot_models, restored_store.models) == (42, {0: "a"}, ["b", "c"])
    restored_store.page_in(fresh, 1, "b")
    restored_store.page_in(fresh, 2, "c")
    for slot, model in enumerate("abc"):
        got = _state(fresh, slot)
        assert set(got) == set(want[model])
        assert all(torch.equal(got[k], v) for k, v in want[model].items()), model
        assert fresh.has_pending_grads(slot)


def test_a_snapshot_of_an_older_adapter_format_is_refused(engine: TrainerEngine, tmp_path: Path) -> None:
    """A snapshot written before the per-projection LoRA shape (its index has no format_version:
    format 2) is refused on restore with a validation error naming both formats, which recovery
    answers by replaying the whole work stream; nothing is loaded into the engine."""
    import msgspec

    store = paging.PageStore(tmp_path / "data" / "paged", host_budget_bytes=1 << 40)
    engine.init_slot(0, X)
    directory = snapshots.take(engine, {0: "a"}, store, tmp_path / "data", "g", work_seq=7)
    index = msgspec.json.decode((directory / snapshots.INDEX).read_bytes())
    assert index.pop("format_version") == 3
    (directory / snapshots.INDEX).write_bytes(msgspec.json.encode(index))
    engine.release_slot(0)
    with pytest.raises(msgspec.ValidationError, match="format-2 adapters; this trainer reads format 3"):
        snapshots.restore(engine, paging.PageStore(tmp_path / "data2" / "paged", 1 << 40), directory)
    assert 0 not in engine.pool.configs


def test_a_snapshot_written_after_later_work_holds_the_captured_state(
    engine: TrainerEngine, qwen_dir: Path, tmp_path: Path
) -> None:
    """The trainer writes a snapshot while later units run: a state captured, then slot 0 trained
    on and the paged model b paged in, trained and paged out again (to the same file name on disk)
    before the snapshot is written and finished. The snapshot restores the captured states exactly,
    and the live page store still holds b's newer state, not the snapshot's older one."""
    store = paging.PageStore(tmp_path / "data" / "paged", host_budget_bytes=0)  # paged states on disk
    for slot, config in enumerate((X, Y)):
        engine.init_slot(slot, config)
        _fb(engine, slot, slot)
        engine.optim_step({slot: HP})
    want_a, want_b = _state(engine, 0), _state(engine, 1)
    store.page_out(engine, 1, "b")
    captured = snapshots.capture(engine, {0: "a"}, store, tmp_path / "data", "g", work_seq=9)
    _fb(engine, 0, 20)  # later units, before the background write ends
    engine.optim_step({0: HP})
    store.page_in(engine, 1, "b")
    _fb(engine, 1, 21)
    engine.optim_step({1: HP})
    newer_b = _state(engine, 1)
    store.page_out(engine, 1, "b")
    directory = snapshots.write(captured, tmp_path / "data", "g")
    snapshots.finish(captured, directory, store, tmp_path / "data", "g")

    store.page_in(engine, 1, "b")
    assert all(torch.equal(_state(engine, 1)[k], v) for k, v in newer_b.items())
    fresh = TrainerEngine(EngineConfig(str(qwen_dir), num_slots=2, max_lora_rank=8))
    restored_store = paging.PageStore(tmp_path / "data2" / "paged", host_budget_bytes=1 << 40)
    assert snapshots.restore(fresh, restored_store, directory) == (9, {0: "a"})
    restored_store.page_in(fresh, 1, "b")
    for slot, want in ((0, want_a), (1, want_b)):
        got = _state(fresh, slot)
        assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items()), slot


def test_a_snapshot_copies_only_the_slots_changed_since_the_last_and_restores_all_exactly(
    engine: TrainerEngine, qwen_dir: Path, tmp_path: Path
) -> None:
    """Three resident slots snapshotted, then only slot 1 trained (a forward_backward and a step)
    and slot 2 given a forward_backward whose gradients stay pending: the next capture copies
    slots 1 and 2 (into the host buffers of the first capture) and hard-links slot 0's file from
    the first snapshot. That snapshot restored
    into a fresh trainer gives back every slot's state exactly (pending gradients included); a
    snapshot of the fresh trainer copies every slot again (its state tokens are its own)."""
    data = tmp_path / "data"
    store = paging.PageStore(data / "paged", host_budget_bytes=1 << 40)
    models = {0: "a", 1: "b", 2: "c"}
    for slot, config in enumerate((X, Y, X)):
        engine.init_slot(slot, config)
        _fb(engine, slot, slot)
        engine.optim_step({slot: HP})
    first = snapshots.take(engine, models, store, data, "g", work_seq=1)
    buffers = engine.snapshot_buffers.nbytes
    _fb(engine, 1, 30)
    engine.optim_step({1: HP})
    _fb(engine, 2, 31)
    want = {slot: _state(engine, slot) for slot in models}

    captured = snapshots.capture(engine, models, store, data, "g", work_seq=2)
    assert set(captured.slots) == {1, 2} and set(captured.reused) == {0}
    assert engine.snapshot_buffers.nbytes == buffers  # the first snapshot's host buffers, reused
    second = snapshots.write(captured, data, "g")
    snapshots.finish(captured, second, store, data, "g")
    assert os.path.samefile(first / "slot-0.safetensors", second / "slot-0.safetensors")

    fresh = TrainerEngine(EngineConfig(str(qwen_dir), num_slots=4, max_lora_rank=8))
    restored_store = paging.PageStore(tmp_path / "data2" / "paged", host_budget_bytes=1 << 40)
    assert snapshots.restore(fresh, restored_store, second) == (2, models)
    for slot in models:
        got = _state(fresh, slot)
        assert set(got) == set(want[slot]), slot
        assert all(torch.equal(got[k], v) for k, v in want[slot].items()), slot
    assert [fresh.has_pending_grads(s) for s in models] == [False, False, True]
    again = snapshots.capture(fresh, models, restored_store, data, "g", work_seq=3)
    assert set(again.slots) == set(models) and not again.reused
    shutil.rmtree(again.hold)


def test_a_slots_snapshot_buffers_are_allocated_when_it_gets_a_model_not_by_the_snapshot(
    engine: TrainerEngine, tmp_path: Path
) -> None:
    """Initialising a slot, and loading a state of another rank into it, prepares its snapshot
    buffers (on a background thread) in the full layout of its tensors: the snapshot's copies
    are those very buffers, and hold the slot's state."""
    engine.init_slot(3, Y)
    other_rank = engine.get_slot_state(3)
    engine.init_slot(3, X)
    engine.snapshot_buffers.ready()
    first = next(t.name for t in engine.pool.slot_tensors(3))
    tables = ("adapter", "exp_avg", "exp_avg_sq", "grad")
    prepared = {table: engine.snapshot_buffers.holds(3, table, first) for table in tables}
    _fb(engine, 3, 3)
    engine.optim_step({3: HP})
    _fb(engine, 3, 4)
    captured = slots.capture(engine, 3, for_snapshot=True)
    copies = {"adapter": captured.adapter, "exp_avg": captured.exp_avg, "exp_avg_sq": captured.exp_avg_sq}
    copies["grad"] = captured.grads
    want = _state(engine, 3)
    for table in tables:
        assert copies[table][first] is prepared[table], table
        assert torch.equal(copies[table][first], want[f"{table}.{first}"]), table

    engine.set_slot_state(3, other_rank, with_optimizer=True)
    engine.snapshot_buffers.ready()
    reshaped = engine.snapshot_buffers.holds(3, "adapter", first)
    assert reshaped is not None and reshaped.shape == other_rank.adapter[first].shape
    assert reshaped.shape != copies["adapter"][first].shape
