"""The background save writer (services/trainer/saves.py): a save is handed over only once its
files are fsynced, a held write of one model delays neither another model's save nor the caller,
and one model's saves are handed over in the order they were submitted."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from libs.checkpoints import layout
from libs.checkpoints.tensor_file import TensorFile
from libs.contracts.common import LoraConfig
from libs.contracts.publish import PublishCommand
from libs.contracts.work import ExportSlot
from libs.faults import fired, hits, release
from services.trainer import handover as handover_module
from services.trainer.engine import TrainerEngine
from services.trainer.handover import Handover, Shelf
from services.trainer.saves import BackgroundSaves
from services.trainer.state import checkpoints
from services.trainer.state.checkpoints import PendingSave
from tests.faults.holds import wait_for

POINT = "trainer.checkpoint_write"  # the test names its process the trainer (TINKERD_SERVICE)


def pending(data_dir: Path, model_id: str, unit_id: str) -> PendingSave:
    staging = layout.staging_dir(data_dir, unit_id, f"{model_id}:save")
    command = PublishCommand(
        kind="training",
        staging_dir=str(staging),
        base_model="tiny-qwen3",
        lora=LoraConfig(rank=2),
        version=unit_id,
        model_id=model_id,
        request_id=f"{model_id}:{unit_id}",
        tenant="t",
        at_ns=0,
    )
    return PendingSave({"adapter.safetensors": b"x" * 64, "state.json": b"{}"}, staging, command, 0.0)


def test_a_held_write_delays_only_later_saves_of_its_own_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Model m's first save is held mid-file: n's save, submitted after it, is handed over while
    m's is still unwritten, m's second save only after m's first, and each only with its files."""
    faults = tmp_path / "faults"
    hold = f"{POINT}@{hits(POINT) + 1}:hold"  # the next file this process writes (earlier tests may have counted)
    monkeypatch.setenv("TINKERD_SERVICE", "trainer")
    monkeypatch.setenv("TINKERD_FAULT_POINTS", hold)
    monkeypatch.setenv("TINKERD_FAULT_DIR", str(faults))
    handed: list[str] = []
    complete: dict[str, bool] = {}

    async def main() -> None:
        arrived = asyncio.Queue[str]()

        async def publish(command: PublishCommand) -> None:
            complete[command.request_id] = (Path(command.staging_dir) / "state.json").exists()
            handed.append(command.request_id)
            arrived.put_nowait(command.request_id)

        saves = BackgroundSaves(publish, limit=4)
        await saves.submit(pending(tmp_path, "m", "u1"))  # held half-way through its first file
        # n's write must not take the held hit: submit it only once m's write is the one held
        # (the fault point's own marker file says so; a bounded wait on it, as `hold` itself waits)
        await asyncio.to_thread(wait_for, lambda: fired(hold, faults), "m's first write held")
        await saves.submit(pending(tmp_path, "m", "u2"))
        await saves.submit(pending(tmp_path, "n", "u3"))
        assert await asyncio.wait_for(arrived.get(), 30) == "n:u3"
        assert saves.pending == 2 and handed == ["n:u3"]
        release(hold, faults)
        await asyncio.wait_for(saves.drain(), 30)
        saves.close()

    try:
        asyncio.run(main())
    finally:
        # a failed assertion must not leave a writer thread held (the process could not exit)
        release(hold, faults)
    assert fired(hold, faults)
    assert handed == ["n:u3", "m:u1", "m:u2"]
    assert complete == {"n:u3": True, "m:u1": True, "m:u2": True}, "a save was handed over before its files"


def test_the_shelf_keeps_handovers_until_durable_then_the_newest_limit_of_them_until_keep_s(
    tmp_path: Path,
) -> None:
    """Handovers whose files are not durable are all kept; of the durable ones, the newest
    `limit` stay readable (until `keep_s` passes) and older ones are released: their segments go."""
    shelf = Shelf(keep_s=3600.0, limit=1)
    handovers = [Handover(f"r{i}", {"w": torch.full((2, 3), float(i))}, {"r": 1}) for i in range(3)]
    for handover in handovers:
        shelf.hold(handover)
    segments = [h.segment for h in handovers]
    assert all(s is not None and s.exists() for s in segments)

    shelf.durable("r0")
    assert all(s is not None and s.exists() for s in segments), "one durable handover is within the limit"
    shelf.durable("r1")
    assert segments[0] is not None and not segments[0].exists(), "the older durable handover was kept"
    assert (
        segments[1] is not None and segments[1].exists() and segments[2] is not None and segments[2].exists()
    )

    expired = Shelf(keep_s=0.0, limit=4)
    expired.hold(handovers[2])
    expired.durable("r2")
    assert not segments[2].exists(), "a handover past keep_s after its files were durable was kept"
    shelf.durable("r1")  # a second report changes nothing
    assert segments[1].exists()


def test_a_durable_handover_whose_timer_fires_early_is_released_once_keep_s_has_passed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The event loop may fire a timer before the shelf's clock reaches its deadline (uvloop arms
    timers in whole milliseconds from a cached time): the handover then stays until `keep_s` has
    passed and is released by a timer for the rest, not left until the next save prunes."""
    clock = [1_000.0]
    monkeypatch.setattr(handover_module.time, "monotonic", lambda: clock[0])
    timers: list[tuple[float, Any, tuple[Any, ...]]] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        monkeypatch.setattr(loop, "call_later", lambda delay, fn, *args: timers.append((delay, fn, args)))
        shelf = Shelf(keep_s=60.0, limit=4)
        handover = Handover("r0", {"w": torch.ones(2, 3)}, {"r": 1})
        shelf.hold(handover)
        shelf.durable("r0")
        segment = handover.segment
        assert segment is not None and segment.exists()
        assert [delay for delay, _, _ in timers] == [60.0]

        clock[0] += 59.9995  # the timer fires half a millisecond early
        _, fn, args = timers.pop()
        fn(*args)
        assert segment.exists(), "a handover was released before keep_s had passed"
        assert len(timers) == 1 and 0 < timers[0][0] <= 0.0005 + 1e-9, "no timer was left for the rest"

        clock[0] += 0.0005
        _, fn, args = timers.pop()
        fn(*args)
        assert not segment.exists(), "a handover past keep_s was kept"
        assert not timers

    asyncio.run(scenario())


def test_an_ephemeral_export_is_handed_over_or_without_room_for_it_written_as_files_alone(
    engine: TrainerEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With room, an ephemeral export's handover holds the export's tensors (its files are built
    from it later); with no room for the handover (its segment directory is gone), the export is
    prepared as files alone, with the same tensors, and the save is not failed."""
    engine.init_slot(0, LoraConfig(rank=4, seed=3))
    op = ExportSlot(model_id="m", request_id="m:save", slot=0, sampling_session_id="s:sample:0", tenant="t")
    shared = checkpoints.prepare(engine, "tiny-qwen3", tmp_path, "u1", op, handover=True)
    assert shared.handover is not None and shared.files == {}
    handed_over = shared.handover.host_tensors()
    shared.handover.release()

    monkeypatch.setattr(handover_module, "segment_dir", lambda: tmp_path / "no-such-dir")
    alone = checkpoints.prepare(engine, "tiny-qwen3", tmp_path, "u2", op, handover=True)
    assert alone.handover is None
    weights = alone.files["adapter_model.safetensors"]
    assert isinstance(weights, TensorFile)
    assert weights.tensors.keys() == handed_over.keys()
    assert all(torch.equal(weights.tensors[k], handed_over[k]) for k in handed_over)
