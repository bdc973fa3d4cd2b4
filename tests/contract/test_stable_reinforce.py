"""Contract: recorded samples, provenance and `stable_reinforce` through the official SDK 0.38.

A sampler created with `record_stability_info=True` records each sequence it samples; a
`stable_reinforce` datum names them in its provenance spans and trains on the recorded sampler
logprobs. Every refusal is a non-retryable 400 naming the datum and the span, appended as a
`Rejected` (nothing of the request is applied), and another tenant's work is undisturbed.

The tests run in file order and share the clients they create (module-scoped state).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import msgspec
import nats
import pytest
import tinker
from tinker import types

from libs.contracts import codec
from libs.contracts import subjects as s
from libs.contracts.common import now_ns
from tests.harness import Stack

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::tinker.lib.experimental.ExperimentalWarning"),
]

KEY = "tml-stable-reinforce"
OTHER_KEY = "tml-stable-reinforce-other"
PROMPT = [5, 6, 7, 8]
PARAMS = types.SamplingParams(max_tokens=5, temperature=1.0, seed=7)
S = SimpleNamespace()


def ints(values: list[int]) -> types.TensorData:
    return types.TensorData(data=values, dtype="int64", shape=[len(values)])


def floats(values: list[float]) -> types.TensorData:
    return types.TensorData(data=values, dtype="float32", shape=[len(values)])


def recorded_datum(
    sequence: types.SampledSequence, advantage: float, prompt: list[int] = PROMPT
) -> types.Datum:
    """The datum `recipes/rl_loop` builds from one sample: prompt + sampled tokens, targets padded
    with 0 over the prompt, advantages only on sampled tokens, and the client's logprobs set to
    a value far from the sampler's (the loss must never read them)."""
    p, tokens, sid = len(prompt), list(sequence.tokens), sequence.sequence_id
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(prompt + tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": ints([0] * (p - 1) + tokens),
            "logprobs": floats([-50.0] * (p - 1 + len(tokens))),
            "advantages": floats([0.0] * (p - 1) + [advantage] * len(tokens)),
        },
    )
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, length=p),
            types.SampledProvenanceSpan(sequence_id=sid, length=len(tokens) - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=p - 1),
            types.SampledProvenanceSpan(sequence_id=sid, length=len(tokens)),
        ],
    )


def with_spans(
    datum: types.Datum, inputs: types.ProvenanceSpans | None, targets: types.ProvenanceSpans | None
) -> types.Datum:
    return dataclasses.replace(datum, model_input_spans=inputs, loss_fn_input_spans=targets)


def spans(datum: types.Datum) -> tuple[types.ProvenanceSpans, types.ProvenanceSpans]:
    assert datum.model_input_spans is not None and datum.loss_fn_input_spans is not None
    return datum.model_input_spans, datum.loss_fn_input_spans


def sampled_logprobs(result: types.ForwardBackwardOutput, index: int, prompt_len: int = len(PROMPT)) -> list[float]:
    return list(result.loss_fn_outputs[index]["logprobs"].data)[prompt_len - 1 :]


def test_a_recording_sampler_returns_one_sequence_id_per_sample(stack: Stack) -> None:
    S.service = tinker.ServiceClient(base_url=stack.base_url, api_key=KEY)
    S.training = S.service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=0).result()
    S.sampler = S.training.save_weights_and_get_sampling_client(record_stability_info=True)
    result = S.sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=3, sampling_params=PARAMS).result()
    ids = [seq.sequence_id for seq in result.sequences]
    assert len(ids) == 3 and len(set(ids)) == 3 and all(ids)
    S.sequences = [seq for seq in result.sequences if len(seq.tokens) >= 2]
    assert len(S.sequences) >= 2, "the tiny model stopped after one token twice; pick another seed"


def test_stable_reinforce_trains_on_the_recorded_sampler_logprobs(stack: Stack) -> None:
    """On-policy (the sampler's weights are the trainer's), every ratio is ~1: nothing is capped
    or masked, the KL estimate is ~0, and the loss is -sum A*lp over the sampled tokens. The
    client's logprobs (-50) would make every ratio e^50 if they were read."""
    advantages = [1.0, -0.5]
    data = [recorded_datum(seq, adv) for seq, adv in zip(S.sequences, advantages, strict=False)]
    out = S.training.forward_backward(data, "stable_reinforce").result()
    assert all(key.count(":") == 1 for key in out.metrics)
    assert out.metrics["stable_reinforce/capped_tokens:sum"] == 0
    assert out.metrics["stable_reinforce/masked_sequences:sum"] == 0
    assert abs(out.metrics["stable_reinforce/kl_sampler:sum"]) < 1e-4
    for i, seq in enumerate(S.sequences[:2]):
        trained = sampled_logprobs(out, i)
        assert len(trained) == len(seq.tokens)
        assert max(abs(a - b) for a, b in zip(trained, seq.logprobs, strict=True)) < 1e-3
    expected = -sum(adv * sum(sampled_logprobs(out, i)) for i, adv in enumerate(advantages))
    assert math.isclose(out.metrics["loss:sum"], expected, rel_tol=1e-4, abs_tol=1e-4)
    before = S.training.forward(data, "stable_reinforce").result()
    S.training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    after = S.training.forward(data, "stable_reinforce").result()
    assert sampled_logprobs(after, 0) != sampled_logprobs(before, 0), "the step moved the weights"
    S.off_policy = data


def test_off_policy_ratios_are_capped_and_far_sequences_masked(stack: Stack) -> None:
    """After large steps the trainer has moved away from the recorded sampler: the metrics see it,
    and a config can set the bounds (unknown keys are refused by name)."""
    for _ in range(3):
        S.training.forward_backward(S.off_policy, "stable_reinforce").result()
        S.training.optim_step(types.AdamParams(learning_rate=2e-1)).result()
    tight = {"ratio_cap": 1.0 + 1e-6, "sequence_ratio_bound": 1.0 + 1e-6, "kl_coeff": 0.5}
    out = S.training.forward(S.off_policy, "stable_reinforce", loss_fn_config=tight).result()
    assert out.metrics["stable_reinforce/masked_sequences:sum"] == len(S.off_policy)
    assert out.metrics["loss:sum"] == 0.0  # every sequence masked: nothing contributes
    assert out.metrics["stable_reinforce/kl_sampler:sum"] > 0
    with pytest.raises(tinker.BadRequestError, match=r"loss_fn_config\.clip_ratio is not read by stable_reinforce"):
        S.training.forward(S.off_policy, "stable_reinforce", loss_fn_config={"clip_ratio": 1.0}).result()


def refused(data: list[types.Datum], match: str, training: tinker.TrainingClient | None = None) -> None:
    with pytest.raises(tinker.BadRequestError, match=match):
        (training or S.training).forward_backward(data, "stable_reinforce").result()


def test_unknown_and_other_sessions_sequences_are_refused(stack: Stack) -> None:
    good = recorded_datum(S.sequences[0], 1.0)
    unknown = with_spans(
        good,
        [dataclasses.replace(spans(good)[0][0], sequence_id="nope:sample:0:0:0"), *spans(good)[0][1:]],
        spans(good)[1],
    )
    refused([good, unknown], r"data\[1\]\.model_input_spans\[0\]: sequence 'nope:sample:0:0:0' is unknown")
    refused([unknown], r"sequence 'nope:sample:0:0:0' is unknown")
    other = tinker.ServiceClient(base_url=stack.base_url, api_key=KEY)  # same tenant, another session
    other_training = other.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=0).result()
    refused([good], r"data\[0\]\.model_input_spans\[0\]: sequence '.+' belongs to another session", other_training)
    stranger = tinker.ServiceClient(base_url=stack.base_url, api_key=OTHER_KEY)
    S.stranger = stranger.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=1).result()
    refused([good], r"belongs to another session", S.stranger)


def test_an_expired_record_is_refused(stack: Stack) -> None:
    """A record whose last use is more than a day old (written so, on the real stream)."""
    sid = S.sequences[1].sequence_id

    async def age() -> None:
        nc = await nats.connect(stack.nats_url)
        js = nc.jetstream()
        raw = await js.get_last_msg(s.STREAM_STABILITY, s.stability_subject(sid), direct=True)
        assert raw.data is not None
        entry = codec.sequence_record_decoder.decode(raw.data)
        day_ago = now_ns() - 25 * 3600 * 10**9
        await js.publish(s.stability_subject(sid), codec.pack(msgspec.structs.replace(entry, touched_ns=day_ago)))
        await nc.close()

    asyncio.run(age())
    refused([recorded_datum(S.sequences[1], 1.0)], rf"data\[0\]\.model_input_spans\[0\]: sequence '{sid}' has expired")


def test_spans_past_the_record_or_with_other_tokens_are_refused(stack: Stack) -> None:
    seq = S.sequences[0]
    good = recorded_datum(seq, 1.0)
    n = len(seq.tokens)
    # one more sampled position than the sequence has (tiling kept: one more input and target)
    longer = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT + list(seq.tokens)),
        loss_fn_inputs={
            "target_tokens": ints([0] * (len(PROMPT) - 1) + list(seq.tokens) + [1]),
            "advantages": floats([0.0] * (len(PROMPT) - 1) + [1.0] * (n + 1)),
        },
    )
    longer = with_spans(
        longer,
        [spans(good)[0][0], dataclasses.replace(spans(good)[0][1], length=n)],
        [spans(good)[1][0], dataclasses.replace(spans(good)[1][1], length=n + 1)],
    )
    refused([good, longer], rf"data\[1\]\.loss_fn_input_spans\[1\] covers \[0, {n + 1}\) of sequence .+ sampled tokens, which has {n} tokens")
    changed_prompt = dataclasses.replace(
        good, model_input=types.ModelInput.from_ints([9, *PROMPT[1:], *seq.tokens[:-1]])
    )
    refused([changed_prompt], r"data\[0\]\.model_input_spans\[0\]: model_input tokens at \[0, 4\) differ from .+ recorded prompt")
    targets = [int(v) for v in good.loss_fn_inputs["target_tokens"].data]
    targets[-1] = (targets[-1] + 1) % 100
    changed_target = dataclasses.replace(good, loss_fn_inputs={**good.loss_fn_inputs, "target_tokens": ints(targets)})
    refused([changed_target], r"data\[0\]\.loss_fn_input_spans\[1\]: target_tokens at .+ differ from .+ recorded sampled tokens")
    miscount = with_spans(good, spans(good)[0][:1], spans(good)[1])
    refused([miscount], r"data\[0\]\.model_input_spans cover 4 positions; model_input has")


def test_advantages_off_sampled_tokens_and_missing_provenance_are_refused(stack: Stack) -> None:
    good = recorded_datum(S.sequences[0], 1.0)
    advantages = list(good.loss_fn_inputs["advantages"].data)
    advantages[0] = 0.25  # a prompt position
    on_prompt = dataclasses.replace(good, loss_fn_inputs={**good.loss_fn_inputs, "advantages": floats(advantages)})
    refused([on_prompt], r"data\[0\]\.loss_fn_inputs\.advantages is 0\.25 at position 0, which no sampled span")
    bare = with_spans(good, None, None)
    refused([good, bare], r"data\[1\] has no provenance: stable_reinforce needs model_input_spans")
    forged = dataclasses.replace(good, loss_fn_inputs={**good.loss_fn_inputs, "sampler_logprobs": floats([0.0] * 8)})
    refused([forged], r"data\[0\]\.loss_fn_inputs\.sampler_logprobs is filled in by the server")


def test_a_refused_request_applies_nothing_and_leaves_other_tenants_undisturbed(stack: Stack) -> None:
    """A request whose second datum is refused adds no gradient from its first: the optimizer
    step after it applies nothing (the window is incomplete) and the weights stay as they were.
    The other tenant's forward pass, issued around it, answers as it does alone."""
    probe = [recorded_datum(S.sequences[0], 1.0)]
    stranger_data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([3, 4, 5, 6]),
            loss_fn_inputs={"target_tokens": ints([4, 5, 6, 7]), "weights": floats([1.0] * 4)},
        )
    ]
    alone = S.stranger.forward(stranger_data, "cross_entropy").result()
    before = S.training.forward(probe, "stable_reinforce").result()
    around = S.stranger.forward(stranger_data, "cross_entropy")
    bad = with_spans(probe[0], None, None)
    refused([probe[0], bad], r"data\[1\] has no provenance")
    with pytest.raises(tinker.RequestFailedError, match="no step was applied"):
        S.training.optim_step(types.AdamParams(learning_rate=1e-1)).result()
    after = S.training.forward(probe, "stable_reinforce").result()
    assert after.loss_fn_outputs[0]["logprobs"].data == before.loss_fn_outputs[0]["logprobs"].data
    assert around.result().loss_fn_outputs[0]["logprobs"].data == alone.loss_fn_outputs[0]["logprobs"].data
    S.training.forward_backward(probe, "stable_reinforce").result()  # the seq_id after the refusal runs
    S.training.optim_step(types.AdamParams(learning_rate=1e-1)).result()
    moved = S.training.forward(probe, "stable_reinforce").result()
    assert moved.loss_fn_outputs[0]["logprobs"].data != before.loss_fn_outputs[0]["logprobs"].data


def json_datum(datum: types.Datum) -> dict[str, object]:
    """The JSON form of a provenance-carrying datum: spans as tagged objects."""

    def tagged(group: types.ProvenanceSpans) -> list[dict[str, object]]:
        return [
            {
                "type": "sampled_tokens" if isinstance(span, types.SampledProvenanceSpan) else "prompt_tokens",
                "sequence_id": span.sequence_id,
                "offset": span.offset,
                "length": span.length,
            }
            for span in group
        ]

    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": datum.model_input.to_ints()}]},
        "loss_fn_inputs": {
            name: {"data": list(td.data), "dtype": td.dtype} for name, td in datum.loss_fn_inputs.items()
        },
        "model_input_spans": tagged(datum.model_input_spans or []),
        "loss_fn_input_spans": tagged(datum.loss_fn_input_spans or []),
    }


def test_json_requests_resolve_provenance_like_protobuf_ones(stack: Stack) -> None:
    """The JSON body (SDK <= 0.24 form) with spans: resolved the same way, refused the same way."""
    model = S.service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=0).result().model_id
    good = recorded_datum(S.sequences[0], 1.0)
    headers = {"X-API-Key": KEY}

    def post(seq_id: int, data: list[types.Datum]) -> httpx.Response:
        body = {
            "forward_backward_input": {"loss_fn": "stable_reinforce", "data": [json_datum(d) for d in data]},
            "model_id": model,
            "seq_id": seq_id,
        }
        return httpx.post(f"{stack.base_url}/api/v1/forward_backward", json=body, headers=headers, timeout=30)

    accepted = post(1, [good])
    assert accepted.status_code == 200, accepted.text
    request_id = accepted.json()["request_id"]
    result: dict[str, object] = {}
    while "metrics" not in result:  # long-polls: each call waits for the result
        result = httpx.post(
            f"{stack.base_url}/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers, timeout=60
        ).json()
        assert "error" not in result, result
    assert result["metrics"]["stable_reinforce/masked_sequences:sum"] == 0  # type: ignore[index]
    unknown = with_spans(
        good,
        [dataclasses.replace(spans(good)[0][0], sequence_id="nope:sample:0:0:0"), *spans(good)[0][1:]],
        spans(good)[1],
    )
    refusal = post(2, [good, unknown])
    assert refusal.status_code == 400
    assert refusal.json()["category"] == "user"
    assert "data[1].model_input_spans[0]: sequence 'nope:sample:0:0:0' is unknown" in refusal.json()["error"]


def test_records_survive_a_gateway_restart_and_each_use_restarts_their_day(stack: Stack) -> None:
    sampler = S.training.save_weights_and_get_sampling_client(record_stability_info=True)
    result = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=PARAMS).result()
    seq = result.sequences[0]
    datum = recorded_datum(seq, 1.0)

    async def touched() -> int:
        nc = await nats.connect(stack.nats_url)
        raw = await nc.jetstream().get_last_msg(
            s.STREAM_STABILITY, s.stability_subject(seq.sequence_id), direct=True
        )
        await nc.close()
        assert raw.data is not None
        return codec.sequence_record_decoder.decode(raw.data).touched_ns

    sampled = asyncio.run(touched())
    assert stack.kill(stack.gateway_names[0]).wait(120), "the gateway came back"
    S.training.forward_backward([datum], "stable_reinforce").result()
    assert asyncio.run(touched()) > sampled


def test_dimuon_is_refused_saying_its_update_rule_is_unpublished(stack: Stack) -> None:
    with pytest.raises(tinker.BadRequestError, match="Dimuon update rule is unpublished"):
        S.service.create_lora_training_client(
            base_model="tiny-qwen3", rank=4, optimizer=types.DimuonOptimizerConfig()
        ).result()


@pytest.fixture(scope="module")
def refusing_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = Stack(
        tmp_path_factory.mktemp("refusing"), env_overrides={"TINKERD_STABLE_REINFORCE": "refuse"}
    ).start()
    try:
        yield running
    finally:
        running.stop()


def test_the_operator_switch_refuses_stable_reinforce_with_a_clear_400(refusing_stack: Stack) -> None:
    """`TINKERD_STABLE_REINFORCE=refuse`: the loss is a non-retryable 400 saying why; recording
    samplers and the other losses work as before."""
    service = tinker.ServiceClient(base_url=refusing_stack.base_url, api_key=KEY)
    training = service.create_lora_training_client(base_model="tiny-qwen3", rank=4, seed=0).result()
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True)
    seq = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=PARAMS).result().sequences[0]
    datum = recorded_datum(seq, 1.0)
    with pytest.raises(tinker.BadRequestError, match=r"stable_reinforce' is turned off on this server \(TINKERD_STABLE_REINFORCE=refuse\)"):
        training.forward_backward([datum], "stable_reinforce").result()
    plain = dataclasses.replace(datum, model_input_spans=None, loss_fn_input_spans=None)
    assert "loss:sum" in training.forward_backward([plain], "importance_sampling").result().metrics


def test_the_switch_takes_only_serve_or_refuse() -> None:
    from services.gateway.config import load_config

    assert load_config({"TINKERD_STABLE_REINFORCE": "refuse"}).stable_reinforce == "refuse"
    assert load_config({}).stable_reinforce == "serve"
    with pytest.raises(SystemExit, match="stable_reinforce"):
        load_config({"TINKERD_STABLE_REINFORCE": "maybe"})
