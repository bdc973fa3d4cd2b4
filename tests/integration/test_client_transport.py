"""The HTTP transport the client config tells SDKs to use (`client_transport`): plain httpx by
default, the SDK's pyqwest when the operator asks for it, and either one carries a whole loop."""

from __future__ import annotations

import httpx
import pytest
import tinker
from tinker import types
from tinker.lib.internal_client_holder import ClientConnectionPoolType

from tests.harness import SharedStacks, Stack
from tests.sdk import datum

PYQWEST = {"TINKERD_GATEWAY_CLIENT_TRANSPORT": "pyqwest"}


@pytest.fixture(scope="module")
def pyqwest_stack(shared_stacks: SharedStacks) -> Stack:
    return shared_stacks.get(PYQWEST)


def transport_of(service: tinker.ServiceClient) -> str:
    """The class of the transport the SDK's training requests go through."""

    async def inspect() -> str:
        with service.holder.aclient(ClientConnectionPoolType.TRAIN) as client:
            return type(client._client._transport).__name__

    return str(service.holder.run_coroutine_threadsafe(inspect()).result())


def offered(stack: Stack) -> bool:
    config = httpx.post(
        f"{stack.base_url}/api/v1/client/config", json={"sdk_version": tinker.__version__}, headers={"X-API-Key": "tml-t"}
    ).json()
    return bool(config["use_pyqwest_transport"])


def train_and_sample(service: tinker.ServiceClient) -> list[int]:
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=4).result()
    training.forward_backward([datum([5, 6, 7, 8, 9])], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    return list(sampler.sample(types.ModelInput.from_ints([5, 6]), 1, greedy).result().sequences[0].tokens)


def test_by_default_sdks_are_told_to_use_httpx_and_do(stack: Stack) -> None:
    assert offered(stack) is False
    service = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-transport-httpx")
    assert transport_of(service) == "AsyncHTTPTransport"
    assert len(train_and_sample(service)) == 4


def test_with_client_transport_pyqwest_the_sdk_trains_and_samples_over_pyqwest(pyqwest_stack: Stack) -> None:
    assert offered(pyqwest_stack) is True
    service = tinker.ServiceClient(base_url=pyqwest_stack.base_url, api_key="tml-transport-pyqwest")
    assert transport_of(service) == "AsyncPyqwestTransport"
    assert len(train_and_sample(service)) == 4
