"""Checkpoints through the official SDK: exact resume, sampler parity, and refused names."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from safetensors.numpy import load_file
from tinker import types

from libs.checkpoints import layout
from tests.harness import Stack
from tests.hf_reference import HFReference
from tests.numerics import assert_within
from tests.sdk import seeded_datum


def datum(step: int) -> types.Datum:
    return seeded_datum(step, 16)


def train(training: tinker.TrainingClient, steps: range) -> None:
    for step in steps:
        training.forward_backward([datum(step)], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()


def state_digest(stack: Stack, tinker_path: str) -> dict[str, str]:
    run, _, name = tinker_path.removeprefix("tinker://").split("/")
    directory = layout.resolve(layout.public_path(stack.data_dir, run, "training", name))
    assert directory is not None
    digest = {}
    for file in ("adapter.safetensors", "optimizer.safetensors"):
        for key, value in load_file(str(directory / file)).items():
            digest[f"{file}:{key}"] = hashlib.sha256(value.tobytes()).hexdigest()
    return digest


def test_resume_from_save_state_is_bit_identical_to_never_stopping(stack: Stack) -> None:
    """train 3, save_state, resume in a new client (with optimizer), train 3 more == train 6."""
    service = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-resume")
    straight = service.create_lora_training_client(base_model="tiny-qwen3", rank=8, seed=7).result()
    train(straight, range(6))
    expected = state_digest(stack, straight.save_state("six").result().path)

    first = service.create_lora_training_client(base_model="tiny-qwen3", rank=8, seed=7).result()
    train(first, range(3))
    saved = first.save_state("three").result().path
    resumed = service.create_training_client_from_state_with_optimizer(saved).result()
    train(resumed, range(3, 6))
    assert state_digest(stack, resumed.save_state("resumed-six").result().path) == expected


def test_sampler_logprobs_match_the_trainer(stack: Stack) -> None:
    """compute_logprobs on the sampler == forward logprobs on the trainer, base and adapter: two fp32
    engines computing the same model, so within twice the fp32 bound of the float64 reference."""
    service = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-parity")
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=8, seed=3).result()
    tokens = np.random.default_rng(11).integers(4, 2000, size=24).tolist()
    probe = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64))},
    )
    at = (torch.arange(len(tokens) - 1), torch.tensor(tokens[1:]))

    def compare(sampler: tinker.SamplingClient, adapter_dir: Path | None) -> None:
        reference = HFReference(Path(stack.data_dir) / "models" / "tiny-qwen3", {"a": adapter_dir} if adapter_dir else None)
        _, bound = reference.logprobs(tokens[:-1], "a" if adapter_dir else None)
        trainer_lp = np.asarray(training.forward([probe], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist())
        sampler_lp = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
        assert sampler_lp[0] is None  # position 0 is not scored
        assert_within(np.asarray(sampler_lp[1:], dtype=np.float64), trainer_lp, 2 * bound[at], "logprobs")

    compare(service.create_sampling_client(base_model="tiny-qwen3").result(), None)  # B = 0: the base model
    train(training, range(4))
    saved = training.save_weights_for_sampler("parity").result().path
    adapter_dir = layout.resolve(layout.public_path(stack.data_dir, training.model_id, "sampler", "parity"))
    assert adapter_dir is not None
    compare(training.create_sampling_client(saved), adapter_dir)


@pytest.mark.parametrize("name", ["../escape", "a/b", ".hidden", "x..y", "", "white space"])
def test_checkpoint_names_that_could_escape_are_refused(stack: Stack, name: str) -> None:
    service = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-names")
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="not a valid checkpoint name"):
        training.save_state(name).result()
    assert not any(Path(stack.data_dir).rglob("escape"))


def test_a_checkpoint_of_the_shared_a_lora_format_is_refused_naming_it(stack: Stack) -> None:
    """A save_state checkpoint of format 2 (from before LoRA had one A per projection) cannot be
    resumed: loading it fails at once with a user error that names its format and the reason."""
    import json

    service = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-old-format")
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=1).result()
    path = training.save_state("old").result().path
    run, _, name = path.removeprefix("tinker://").split("/")
    directory = layout.resolve(layout.public_path(stack.data_dir, run, "training", name))
    assert directory is not None
    meta = json.loads((directory / "state.json").read_text())
    assert meta["format_version"] == 3
    (directory / "state.json").write_text(json.dumps(meta | {"format_version": 2}))
    with pytest.raises(tinker.RequestFailedError, match="checkpoint format 2 predates format 3") as refused:
        service.create_training_client_from_state(path).result()
    assert refused.value.category == types.RequestErrorCategory.User
