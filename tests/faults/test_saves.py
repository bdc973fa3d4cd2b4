"""Saves that do not queue: the trainer copies the slot on its unit path and writes the files
behind it, so one tenant's save never waits for another tenant's file write; a save completes,
and is catalogued, only once its files are fsynced; and a trainer killed before a save's files
were written redoes that save, from the state it copied, on restart.

A write is held at an exact place (`libs/faults.py`, action `hold`: the trainer's first
checkpoint file stops half written until the test releases it), so nothing here depends on
how fast the disk is.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tinker

from libs.faults import fired, release
from tests.faults.checks import exactly_once
from tests.faults.holds import HOLD, WAIT_S, held_stack, train, wait_for
from tests.harness import Stack
from tests.sdk import checkpoint_digests


def training_paths(stack: Stack, key: str, model_id: str) -> list[str]:
    listed = tinker.RestClient(base_url=stack.base_url, api_key=key).list_checkpoints(model_id).result().checkpoints
    return [c.tinker_path for c in listed if c.checkpoint_type == "training"]


def test_a_save_completes_while_another_tenants_save_write_is_held(tmp_path: Path) -> None:
    """Tenant a's save_state is held half-written. Meanwhile tenant b trains and its save_state
    completes and is catalogued, and tenant a itself trains on; a's save is not catalogued while
    its file is incomplete. Released, a's save completes with the state a had when it saved (step
    1), not its later one."""
    stack = held_stack(tmp_path)
    try:
        with (
            tinker.ServiceClient(base_url=stack.base_url, api_key="tml-saves-a") as client_a,
            tinker.ServiceClient(base_url=stack.base_url, api_key="tml-saves-b") as client_b,
        ):
            a = client_a.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=7).result()
            b = client_b.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=8).result()
            train(a, 0, 0)
            saving = a.save_state("a1")
            wait_for(lambda: fired(HOLD, tmp_path / "faults"), "the hold of a's save write")

            train(b, 1, 0)
            b_path = b.save_state("b1").result().path
            assert training_paths(stack, "tml-saves-b", b.model_id) == [b_path]
            assert checkpoint_digests(stack.data_dir, b_path)["step"] == "1"
            train(a, 0, 1)  # a's own units do not wait for its save either
            assert training_paths(stack, "tml-saves-a", a.model_id) == [], "a save was catalogued before its file was whole"

            release(HOLD, tmp_path / "faults")
            a_path = saving.result().path
            assert training_paths(stack, "tml-saves-a", a.model_id) == [a_path]
            assert checkpoint_digests(stack.data_dir, a_path)["step"] == "1"
    finally:
        stack.stop()


def test_a_save_whose_write_a_killed_trainer_never_finished_is_redone_from_the_state_it_copied(
    tmp_path: Path,
) -> None:
    """Tenant a's save_state is held half-written, a trains one more step (its outcome is
    published), and the trainer is killed -9. The restarted trainer replays the units and writes
    the save again: it completes once, with exactly the state of the save's time (the same tensors
    as tenant c's save after the same one step from the same seed), a later save of the same name
    is the newer state, and no result or outcome was appended twice."""
    stack = held_stack(tmp_path)
    try:
        with (
            tinker.ServiceClient(base_url=stack.base_url, api_key="tml-saves-a") as client_a,
            tinker.ServiceClient(base_url=stack.base_url, api_key="tml-saves-c") as client_c,
        ):
            a = client_a.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=7).result()
            train(a, 0, 0)
            saving = a.save_state("a1")
            wait_for(lambda: fired(HOLD, tmp_path / "faults"), "the hold of a's save write")
            train(a, 0, 1)
            assert stack.kill("trainer").wait(WAIT_S), "the trainer did not come back"

            a_path = saving.result().path
            first = checkpoint_digests(stack.data_dir, a_path)
            assert first["step"] == "1"
            c = client_c.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=7).result()
            train(c, 0, 0)
            reference = checkpoint_digests(stack.data_dir, c.save_state("c1").result().path)
            assert first == reference

            assert a.save_state("a1").result().path == a_path
            assert checkpoint_digests(stack.data_dir, a_path)["step"] == "2"
            assert training_paths(stack, "tml-saves-a", a.model_id) == [a_path]
        report = exactly_once(stack.nats_url)
        assert report.clean, f"something was applied twice: {report}"
    finally:
        stack.stop()


pytestmark = pytest.mark.slow
