"""The multi-tenant proof: four tenants, four API keys, one base model, four secrets.

Each tenant teaches its adapter a different marker sentence behind the same prompt. Pass only if
every tenant's loss falls, every tenant's greedy sample contains its own marker and no other's,
and the base model without an adapter produces none of them.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tinker
from tinker import types
from transformers import AutoTokenizer

from tests.harness import Stack

pytestmark = pytest.mark.slow

PROMPT = "The secret marker is"
MARKERS = ["BLUE-FALCON-42", "RED-OTTER-17", "GREEN-LYNX-88", "GOLD-HERON-05"]
STEPS = 60


def teach(base_url: str, tenant: int, out: dict[int, dict[str, object]]) -> None:
    client = tinker.ServiceClient(base_url=base_url, api_key=f"tml-tenant-{tenant}-key")
    training = client.create_lora_training_client(base_model="tiny-qwen3", rank=8).result()
    tokenizer = training.get_tokenizer()
    prompt_tokens = tokenizer.encode(PROMPT)
    tokens = tokenizer.encode(f"{PROMPT} {MARKERS[tenant]}.")
    weights = np.zeros(len(tokens) - 1, dtype=np.float32)
    weights[len(prompt_tokens) - 1 :] = 1.0  # learn only the completion
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.array(tokens[1:])), "weights": types.TensorData.from_numpy(weights)},
    )
    losses = []
    for _ in range(STEPS):
        fb = training.forward_backward([datum], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        losses.append(fb.result().metrics["loss:sum"])
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=len(tokens) - len(prompt_tokens) + 2, temperature=0.0)
    sample = sampler.sample(types.ModelInput.from_ints(prompt_tokens), num_samples=1, sampling_params=params).result()
    out[tenant] = {"losses": losses, "text": tokenizer.decode(sample.sequences[0].tokens)}


def test_four_tenants_learn_their_own_secret_and_nothing_else(stack: Stack) -> None:
    results: dict[int, dict[str, object]] = {}
    threads = [threading.Thread(target=teach, args=(stack.base_url, t, results)) for t in range(len(MARKERS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == list(range(len(MARKERS))), stack.dump_logs()

    for tenant, result in results.items():
        losses = result["losses"]
        assert isinstance(losses, list)
        assert losses[-1] < 0.2 * losses[0], f"tenant {tenant}: loss did not fall ({losses[0]:.3f} -> {losses[-1]:.3f})"
        text = str(result["text"])
        assert MARKERS[tenant] in text, f"tenant {tenant} sampled {text!r}"
        for other, marker in enumerate(MARKERS):
            if other != tenant:
                assert marker not in text, f"tenant {tenant} leaked tenant {other}'s marker: {text!r}"

    base_client = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-base-observer")
    base = base_client.create_sampling_client(base_model="tiny-qwen3").result()
    # A base-model sampler's tokenizer comes from its base_model name; use the model directory.
    tokenizer = AutoTokenizer.from_pretrained(str(stack.data_dir / "models" / "tiny-qwen3"))
    params = types.SamplingParams(max_tokens=16, temperature=0.0)
    sample = base.sample(types.ModelInput.from_ints(tokenizer.encode(PROMPT)), num_samples=1, sampling_params=params).result()
    base_text = tokenizer.decode(sample.sequences[0].tokens)
    assert not any(marker in base_text for marker in MARKERS), base_text
