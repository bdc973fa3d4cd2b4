"""Two base models of different shapes (tiny-qwen3 and tiny-qwen3-narrow: another width, depth,
head layout, vocabulary and context) in one deployment, each with its own trainer group (group q
and group n, one adapter slot each) and its own CPU sampler (`sampler` and `sampler@<narrow>`,
started by the supervisor as `tinkerd up` does): both train and sample at once through the SDK,
each on its own engine with its own adapter; request limits are each base's own; an unknown base is
a 400, and a create for a base whose only group is down waits with a clear queue state."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from libs.checkpoints import layout
from tests.harness import Stack
from tests.hf_reference import HFReference
from tests.integration.test_groups import Run, batch, group_of, unload
from tests.numerics import assert_within

PRIMARY = "tiny-qwen3"
NARROW = "tiny-qwen3-narrow"
NARROW_VOCAB = NARROW_CONTEXT = 1024  # libs/models/tiny.py; tiny-qwen3 has 2048 of each
PROMPT = [11, 42, 7, 99, 3]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {
        "TINKERD_TRAINER_GROUPS": f"q=tiny-qwen3,n={NARROW}",
        "TINKERD_GATEWAY_EXTRA_BASE_MODELS": NARROW,
        "TINKERD_NUM_SLOTS": "1",
        "TINKERD_TRAINER_HEARTBEAT_S": "0.5",
        "TINKERD_PLANNER_GROUP_TIMEOUT_S": "3",
    }
    running = Stack(tmp_path_factory.mktemp("bases"), env_overrides=env).start()  # every service
    try:
        yield running
    finally:
        running.stop()


def probe(tokens: list[int]) -> list[types.Datum]:
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64))},
        )
    ]


def forward_logprobs(training: tinker.TrainingClient, tokens: list[int]) -> np.ndarray:
    """The trainer's logprobs of tokens[1:] after tokens[:-1] (one forward pass)."""
    out = training.forward(probe(tokens), "cross_entropy").result()
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist(), dtype=np.float64)


def scored(sampling: tinker.SamplingClient, tokens: list[int]) -> np.ndarray:
    """The engine's logprobs of tokens[1:] (compute_logprobs; position 0 is not scored)."""
    logprobs = sampling.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert logprobs[0] is None
    return np.asarray(logprobs[1:], dtype=np.float64)


def exported(stack: Stack, path: str) -> Path:
    """The directory of a named sampler export `tinker://RUN/sampler_weights/NAME`."""
    run, _, name = path.removeprefix("tinker://").split("/")
    directory = layout.resolve(layout.public_path(stack.data_dir, run, "sampler", name))
    assert directory is not None
    return directory


class Tenant:
    """One tenant on one base model: a training step, then an ephemeral sampler export it samples
    from (save_weights_and_get_sampling_client) and a named export of the same weights."""

    def __init__(self, stack: Stack, base: str) -> None:
        self.base = base
        self.key = f"tml-bases-sample-{base}"
        self.client = tinker.ServiceClient(base_url=stack.base_url, api_key=self.key)  # open for the test
        self.training = self.client.create_lora_training_client(base_model=base, rank=4, seed=9).result()
        self.training.forward_backward(batch(np.random.default_rng(9)), "cross_entropy").result()
        self.training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        sampling = self.training.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
        self.sequence = sampling.sample(types.ModelInput.from_ints(PROMPT), 1, params).result().sequences[0]
        self.named = self.training.save_weights_for_sampler(f"export-{base}").result().path


def test_each_base_model_samples_its_adapters_on_its_own_engine(stack: Stack) -> None:
    """Capabilities list both bases as sampleable. A tenant per base trains a step and samples
    through save_weights_and_get_sampling_client, both at once. For each base, the sampled tokens'
    logprobs equal the trainer's forward logprobs of the same tokens with the same adapter (two
    fp32 engines computing one model: within twice the fp32 bound of a float64 HF + PEFT
    reference of that base and adapter), and a base-model sampling client of that base scores the
    same tokens as the plain base (within the bound of the reference without the adapter), which
    differs from the adapter's scores by more than the bound: each sample ran on its base's engine
    with its own adapter. A sampling client from the named export, and a training client from a
    save_state of the narrow model, stay on the narrow base."""
    rest = tinker.RestClient(base_url=stack.base_url, api_key="tml-bases-caps")
    capabilities = rest.get_server_capabilities().result()
    assert {m.model_name: m.sampleable for m in capabilities.supported_models} == {PRIMARY: True, NARROW: True}
    tenants: dict[str, Tenant] = {}
    errors: list[BaseException] = []

    def start(base: str) -> None:
        try:
            tenants[base] = Tenant(stack, base)
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(base,)) for base in (PRIMARY, NARROW)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert sorted(tenants) == sorted([PRIMARY, NARROW])

    for base, tenant in tenants.items():
        sampled, sampled_lp = list(tenant.sequence.tokens), tenant.sequence.logprobs
        assert sampled_lp is not None and len(sampled) == len(sampled_lp) == 6
        tokens = PROMPT + sampled
        at = (torch.arange(len(PROMPT) - 1, len(tokens) - 1), torch.tensor(sampled))
        every = (torch.arange(len(tokens) - 1), torch.tensor(tokens[1:]))
        reference = HFReference(stack.data_dir / "models" / base, {"a": exported(stack, tenant.named)})
        _, bound = reference.logprobs(tokens[:-1], "a")
        reference_base, bound_base = reference.logprobs(tokens[:-1], None)
        trainer = forward_logprobs(tenant.training, tokens)
        sampled_at = np.asarray(sampled_lp, dtype=np.float64)
        assert_within(sampled_at, trainer[len(PROMPT) - 1 :], 2 * bound[at], f"{base} sampled")
        with tenant.client as client:
            plain = scored(client.create_sampling_client(base_model=base).result(), tokens)
            assert_within(plain, reference_base[every], bound_base[every], f"{base} base")
            assert float(np.abs(plain - trainer).max()) > 2 * float(bound[every].max())  # the adapter counts
            from_path = client.create_sampling_client(model_path=tenant.named).result()
            assert_within(scored(from_path, tokens), trainer, 2 * bound[every], f"{base} named export")
            if base == NARROW:
                saved = tenant.training.save_state("narrow-state").result().path
                resumed = client.create_training_client_from_state(saved).result()
                assert resumed.get_info().model_data.model_name == NARROW
                again = forward_logprobs(resumed, tokens)
                assert_within(again, trainer, 2 * bound[every], "narrow resumed")
                unload(stack, tenant.key, str(resumed.model_id))
        unload(stack, tenant.key, str(tenant.training.model_id))


def test_request_limits_are_those_of_the_model_s_own_base(stack: Stack) -> None:
    """A token id valid for tiny-qwen3 (vocabulary 2048) but not for the narrow base (1024) is a
    400 naming the field, the limit and the base, in a narrow forward and a narrow sample, while
    tiny-qwen3 accepts both; a narrow sample past the narrow context (1024) is a 400 naming it."""
    big = NARROW_VOCAB + 500
    datum = probe([5, 6, big, 7])
    outside = rf"token id {big}; ids must be in \[0, {NARROW_VOCAB}\) for base model '{NARROW}'"
    with tinker.ServiceClient(base_url=stack.base_url, api_key="tml-bases-limits") as client:
        narrow = client.create_lora_training_client(base_model=NARROW, rank=4).result()
        with pytest.raises(tinker.BadRequestError, match=rf"data\[0\]\.model_input contains {outside}"):
            narrow.forward(datum, "cross_entropy").result()
        primary = client.create_lora_training_client(base_model=PRIMARY, rank=4).result()
        assert primary.forward(datum, "cross_entropy").result().loss_fn_outputs

        narrow_sampler = client.create_sampling_client(base_model=NARROW).result()
        one = types.SamplingParams(max_tokens=1, seed=1)
        with pytest.raises(tinker.BadRequestError, match=rf"prompt contains {outside}"):
            narrow_sampler.sample(types.ModelInput.from_ints([5, big]), 1, one).result()
        primary_sampler = client.create_sampling_client(base_model=PRIMARY).result()
        answered = primary_sampler.sample(types.ModelInput.from_ints([5, big]), 1, one).result()
        assert len(answered.sequences[0].tokens) == 1
        too_long = types.SamplingParams(max_tokens=NARROW_CONTEXT, seed=1)
        past = rf"exceeds the context length {NARROW_CONTEXT} of base model '{NARROW}'"
        with pytest.raises(tinker.BadRequestError, match=past):
            narrow_sampler.sample(types.ModelInput.from_ints(PROMPT), 1, too_long).result()
        unload(stack, "tml-bases-limits", str(narrow.model_id))
        unload(stack, "tml-bases-limits", str(primary.model_id))


def test_two_base_models_train_at_once_each_on_its_own_group_and_an_unknown_base_is_a_400(stack: Stack) -> None:
    """Capabilities list both base models; a tiny-qwen3 and a tiny-qwen3-narrow model train at
    once, each placed on a group of its base (its shape differs: the losses differ too); an unknown
    base is a 400 naming base_model; with the narrow group held down and marked lost, a create for
    it waits (try_again, queue_state paused_capacity, a reason naming the base). (A lost group's
    resident models are taken over by another group of their base: test_groups.py and
    test_takeover.py.)"""
    with tinker.ServiceClient(base_url=stack.base_url, api_key="tml-groups-bases") as client:
        rest = tinker.RestClient(base_url=stack.base_url, api_key="tml-groups-bases")
        capabilities = rest.get_server_capabilities().result()
        served = {m.model_name for m in capabilities.supported_models}
        assert served == {"tiny-qwen3", NARROW}
        runs: dict[str, Run] = {}

        def start(base: str) -> None:
            runs[base] = Run(client, seed=5, base_model=base)
            runs[base].step()

        threads = [threading.Thread(target=start, args=(base,)) for base in ("tiny-qwen3", NARROW)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert sorted(runs) == sorted(["tiny-qwen3", NARROW])
        assert group_of(stack, runs[NARROW].model_id) == "n"
        assert group_of(stack, runs["tiny-qwen3"].model_id) == "q"
        assert runs[NARROW].seen != runs["tiny-qwen3"].seen  # same seed and data, another model

    with httpx.Client(base_url=stack.base_url, headers={"X-API-Key": "tml-groups-bases-http"}, timeout=60) as http:
        session = http.post("/api/v1/create_session", json={"type": "create_session", "sdk_version": "test"}).json()

        def create(seq: int, base: str) -> httpx.Response:
            body = {
                "type": "create_model",
                "session_id": session["session_id"],
                "model_seq_id": seq,
                "base_model": base,
                "lora_config": {"rank": 2},
            }
            return http.post("/api/v1/create_model", json=body)

        unknown = create(0, "no-such-model")
        assert unknown.status_code == 400 and "base_model" in unknown.json()["error"], unknown.text
        assert unknown.json()["category"] == "user"

        lost = threading.Event()
        stack.listeners.append(
            lambda service, line: lost.set() if service == "planner" and "trainer group n " in line and "LOST" in line else None
        )
        stack.stop_service("trainer@n")
        assert lost.wait(60), "the planner never marked group n lost"
        posted = create(1, NARROW)
        assert posted.status_code == 200, posted.text
        request_id = posted.json()["request_id"]
        waiting = http.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
        while waiting.get("queue_state") == "active":  # until the planner's queue record is read
            waiting = http.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
        assert waiting["type"] == "try_again" and waiting["queue_state"] == "paused_capacity", waiting
        assert NARROW in waiting["queue_state_reason"] and "no trainer group" in waiting["queue_state_reason"]
