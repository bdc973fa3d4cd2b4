"""Ephemeral sampler exports handed over from the trainer's memory (services/trainer/handover.py).

`save_weights_and_get_sampling_client()` is answered as soon as the trainer has copied the slot:
the engine loads the adapter from that copy, and the export's files follow behind. The files'
write is held at an exact place (`libs/faults.py`, action `hold`: the first file the trainer
writes stops half written until the test releases it), so "before its files exist" is a fact of
the run, not a race. The reference each time is independent of the handover: a named
`save_weights_for_sampler` of the same state, sampled from its files.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from libs.checkpoints import layout
from libs.faults import fired, release
from tests.faults.checks import exactly_once
from tests.faults.holds import HOLD, WAIT_S, held_stack, train, wait_for
from tests.harness import Stack

PROMPT = types.ModelInput.from_ints([11, 17, 300, 45, 987, 12])
GREEDY = types.SamplingParams(max_tokens=8, temperature=0.0)

pytestmark = pytest.mark.slow


def greedy(sampler: tinker.SamplingClient) -> tuple[list[int], list[float]]:
    sequence = sampler.sample(PROMPT, num_samples=1, sampling_params=GREEDY).result().sequences[0]
    return list(sequence.tokens), list(sequence.logprobs or [])


def exported_dirs(stack: Stack) -> list[str]:
    root = layout.samplers_root(stack.data_dir)
    return sorted(str(p) for p in root.glob("*/*") if p.is_dir()) if root.exists() else []


def tensor_loaded(stack: Stack) -> list[str]:
    """The adapters the engine holds that it loaded from a trainer's memory."""
    loaded = httpx.get(f"{stack.sampler_url}/server_info", timeout=30).json()["loaded_lora_adapters"]
    return [name for name, path in loaded.items() if path == "__tensor__"]


def reference(client: tinker.ServiceClient, trainer: tinker.TrainingClient) -> tuple[list[int], list[float]]:
    """The same state saved by name and sampled from its files."""
    path = trainer.save_weights_for_sampler("reference").result().path
    return greedy(client.create_sampling_client(model_path=path))


def trained_and_handed_over(
    client: tinker.ServiceClient, tenant: int, seed: int, faults: Path
) -> tuple[tinker.TrainingClient, tinker.SamplingClient]:
    """A model trained one step and its ephemeral sampler, once the export's file write is held."""
    trainer = client.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=seed).result()
    train(trainer, tenant, 0)
    sampler = trainer.save_weights_and_get_sampling_client().result()
    wait_for(lambda: fired(HOLD, faults), "the hold of the export's file write")
    return trainer, sampler


def test_an_ephemeral_sampler_samples_the_trainers_copy_before_its_files_exist(tmp_path: Path) -> None:
    """The export's file write is held: the save is answered anyway, its sample runs on the
    adapter the engine loaded from the trainer's memory, and no export directory exists yet.
    Released, the files are published; the sample equals the same state's named save, token for
    token and logprob for logprob."""
    stack = held_stack(tmp_path)
    try:
        with tinker.ServiceClient(base_url=stack.base_url, api_key="tml-handover-a") as client:
            a, sampler = trained_and_handed_over(client, 0, 7, tmp_path / "faults")
            handed_over = greedy(sampler)
            assert len(tensor_loaded(stack)) == 1, "the engine did not load the adapter from memory"
            assert exported_dirs(stack) == [], "the export's files exist although their write is held"

            release(HOLD, tmp_path / "faults")
            wait_for(lambda: len(exported_dirs(stack)) == 1, "the export's files being published")
            assert handed_over == reference(client, a)
            assert greedy(sampler) == handed_over  # the same adapter, now also on disk
    finally:
        stack.stop()


def test_a_trainer_killed_after_handing_over_writes_the_files_when_it_restarts(tmp_path: Path) -> None:
    """The trainer is killed -9 after the handover answered the save, with the export's file
    write held. The restarted trainer redoes the export's files from the replayed state; the
    sampler samples exactly what a named save of that state samples, and no result or outcome
    was appended twice."""
    stack = held_stack(tmp_path)
    try:
        with tinker.ServiceClient(base_url=stack.base_url, api_key="tml-handover-b") as client:
            b, sampler = trained_and_handed_over(client, 1, 8, tmp_path / "faults")
            assert exported_dirs(stack) == []
            assert stack.kill("trainer").wait(WAIT_S), "the trainer did not come back"

            wait_for(lambda: len(exported_dirs(stack)) == 1, "the restarted trainer writing the export")
            assert greedy(sampler) == reference(client, b)
        report = exactly_once(stack.nats_url)
        assert report.clean, f"something was applied twice: {report}"
    finally:
        stack.stop()
