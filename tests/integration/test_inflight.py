"""Inflight and snapshot sampling clients through the official SDK (0.38, `SamplingClientKind`).

Every inflight client of a training model samples with the model's newest inflight save, the
clients made before it included; a snapshot client keeps the weights of its save forever. What a
client samples with is read from a probe's `compute_logprobs`: the same weights give the same
logprobs bit for bit on the CPU engine, other weights differ.
"""

from __future__ import annotations

import numpy as np
import tinker
from tinker import types

from tests.harness import Stack

PROBE = types.ModelInput.from_ints(np.random.default_rng(5).integers(4, 2000, size=20).tolist())


def train(training: tinker.TrainingClient, steps: int, seed: int) -> None:
    tokens = np.random.default_rng(seed).integers(4, 2000, size=17).tolist()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64)),
            "weights": types.TensorData.from_numpy(np.ones(16, dtype=np.float32)),
        },
    )
    for _ in range(steps):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()


def logprobs(sampler: tinker.SamplingClient) -> np.ndarray:
    return np.asarray(sampler.compute_logprobs(PROBE).result()[1:], dtype=np.float64)


def test_an_inflight_client_follows_later_inflight_saves_and_a_snapshot_client_does_not(stack: Stack) -> None:
    service = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-inflight")
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=8, seed=2).result()
    train(training, 2, seed=1)
    first = training.save_weights_and_get_sampling_client(kind="inflight").result()
    snapshot = training.save_weights_and_get_sampling_client().result()  # the same weights, fixed
    at_first = logprobs(first)
    np.testing.assert_array_equal(logprobs(snapshot), at_first)

    train(training, 3, seed=2)
    second = training.save_weights_and_get_sampling_client(kind="inflight").result()
    at_second = logprobs(second)
    assert np.abs(at_second - at_first).max() > 1e-2  # training moved the weights
    np.testing.assert_array_equal(logprobs(first), at_second)  # the older client follows
    np.testing.assert_array_equal(logprobs(snapshot), at_first)  # the snapshot does not

    train(training, 3, seed=3)
    later_snapshot = training.save_weights_and_get_sampling_client().result()  # not an inflight save
    np.testing.assert_array_equal(logprobs(first), at_second)
    np.testing.assert_array_equal(logprobs(second), at_second)
    assert np.abs(logprobs(later_snapshot) - at_second).max() > 1e-2


def test_the_inflight_target_survives_a_gateway_restart_and_belongs_to_its_model(stack: Stack) -> None:
    """The target is a stored fact, not gateway memory; another model's inflight saves (of the same
    tenant, in the same session) never move it."""
    service = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-inflight-restart")
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=8, seed=4).result()
    other = service.create_lora_training_client(base_model="tiny-qwen3", rank=8, seed=9).result()
    first = training.save_weights_and_get_sampling_client(kind="inflight").result()
    train(training, 3, seed=4)
    newest = logprobs(training.save_weights_and_get_sampling_client(kind="inflight").result())

    train(other, 3, seed=5)
    other_client = other.save_weights_and_get_sampling_client(kind="inflight").result()
    assert np.abs(logprobs(other_client) - newest).max() > 1e-2
    np.testing.assert_array_equal(logprobs(first), newest)

    assert stack.kill("gateway").wait(240), stack.dump_logs()
    np.testing.assert_array_equal(logprobs(first), newest)
