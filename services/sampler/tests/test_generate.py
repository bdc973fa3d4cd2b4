"""``POST /generate`` against a plain transformers/PEFT reference on the tiny Qwen3 model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from litestar.testing import TestClient

from tests.hf_reference import HFReference
from tests.numerics import assert_within

pytestmark = pytest.mark.numerics  # also run under other thread counts and CPU paths (tests/infra)

PROMPTS = [[11, 17, 300, 45, 987, 12], [40, 5, 6], [1200, 44, 88, 301, 7, 9, 1000, 64, 30, 5, 17]]
GREEDY = {"temperature": 0.0}


def generate(client: TestClient, **body: Any) -> Any:
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.parametrize("adapter", [None, "ad0", "head"])
def test_greedy_tokens_equal_hf_generate(
    client: TestClient, reference: HFReference, adapter: str | None
) -> None:
    """Greedy decoding matches transformers' greedy ``generate`` for the base model and adapters."""
    for prompt in PROMPTS:
        out = generate(
            client, input_ids=prompt, lora_path=adapter, sampling_params={**GREEDY, "max_new_tokens": 12}
        )
        assert out["output_ids"] == reference.greedy(prompt, adapter, 12)
        assert out["meta_info"]["prompt_tokens"] == len(prompt)
        assert out["meta_info"]["completion_tokens"] == len(out["output_ids"])


def test_adapters_change_the_output(client: TestClient) -> None:
    """Sanity check of the fixtures: the random adapters are not no-ops."""
    outs = {
        name: generate(
            client, input_ids=PROMPTS[0], lora_path=name, sampling_params={**GREEDY, "max_new_tokens": 8}
        )["output_ids"]
        for name in (None, "ad0", "ad1", "head")
    }
    assert len({tuple(v) for v in outs.values()}) == 4


def test_prompt_logprobs_equal_hf_forward_with_adapter(client: TestClient, reference: HFReference) -> None:
    """logprob_start_len=0: entry 0 is None, the rest equal a plain float64 forward's log-softmax
    within the fp32 bound (``tests.numerics``)."""
    prompt = PROMPTS[2]
    out = generate(
        client,
        input_ids=prompt,
        lora_path="head",
        sampling_params={**GREEDY, "max_new_tokens": 3},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=4,
    )
    meta = out["meta_info"]
    ref, bound = reference.logprobs(prompt, "head")  # (len(prompt), V): the same sequence, one plain forward

    entries = meta["input_token_logprobs"]
    assert [tok for _, tok, _ in entries] == prompt
    assert entries[0][0] is None and all(text is None for *_, text in entries)
    at = (torch.arange(len(prompt) - 1), torch.tensor(prompt[1:]))
    assert_within(torch.tensor([lp for lp, _, _ in entries[1:]]), ref[at], bound[at], "prompt logprobs")

    top = meta["input_top_logprobs"]
    assert top[0] is None and len(top) == len(prompt)
    ref_vals, ref_ids = torch.topk(ref[:-1], 4, dim=-1)
    assert [[tok for _, tok, _ in pos] for pos in top[1:]] == ref_ids.tolist()
    values = torch.tensor([[lp for lp, _, _ in pos] for pos in top[1:]])
    assert_within(values, ref_vals, bound[:-1].gather(-1, ref_ids), "top logprobs")


def test_output_logprobs_are_the_raw_distribution(client: TestClient, reference: HFReference) -> None:
    """At temperature 0.7 with top-k/top-p, output logprobs are still the temperature-1 model logprobs.

    The reference is one float64 forward over prompt + output; the engine decoded in fp32 with a
    KV cache, which is the same chain of reductions in another order: within the fp32 bound.
    """
    prompt = PROMPTS[1]
    out = generate(
        client,
        input_ids=prompt,
        lora_path="head",
        sampling_params={
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 50,
            "max_new_tokens": 10,
            "sampling_seed": 1,
        },
        return_logprob=True,
        top_logprobs_num=3,
        return_text_in_logprobs=True,
    )
    full = prompt + out["output_ids"]
    ref, bound = reference.logprobs(full, "head")
    positions = torch.arange(len(prompt) - 1, len(full) - 1)
    at = (positions, torch.tensor(out["output_ids"]))
    entries = out["meta_info"]["output_token_logprobs"]
    assert [tok for _, tok, _ in entries] == out["output_ids"]
    assert_within(torch.tensor([lp for lp, _, _ in entries]), ref[at], bound[at], "output logprobs")
    assert all(isinstance(text, str) for *_, text in entries)
    top = out["meta_info"]["output_top_logprobs"]
    assert [[tok for _, tok, _ in pos] for pos in top] == torch.topk(
        ref[positions], 3, dim=-1
    ).indices.tolist()


def test_logprob_start_len_defaults_to_the_last_prompt_token(client: TestClient) -> None:
    """logprob_start_len=-1 (SGLang's default) reports only ``[None, last_token]`` for the prompt."""
    meta = generate(client, input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 2}, return_logprob=True)[
        "meta_info"
    ]
    assert meta["input_token_logprobs"] == [[None, PROMPTS[0][-1], None]]
    assert len(meta["output_token_logprobs"]) == 2
    assert "input_top_logprobs" not in meta and "output_top_logprobs" not in meta
    start_3 = generate(
        client,
        input_ids=PROMPTS[0],
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=3,
    )
    assert [tok for _, tok, _ in start_3["meta_info"]["input_token_logprobs"]] == PROMPTS[0][3:]
    assert start_3["output_ids"] == [] and start_3["meta_info"]["finish_reason"] == {
        "type": "length",
        "length": 0,
    }


def test_same_seed_gives_same_tokens(client: TestClient) -> None:
    """A seeded request is reproducible; another seed gives another sample."""
    body = {"input_ids": PROMPTS[0], "lora_path": "ad2", "return_logprob": True}

    def sample(seed: int) -> list[int]:
        params = {"temperature": 1.0, "max_new_tokens": 16, "sampling_seed": seed, "ignore_eos": True}
        return list(generate(client, **body, sampling_params=params)["output_ids"])

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_n_samples_return_a_list_seeded_per_sample(client: TestClient) -> None:
    """n=3 returns three outputs; sample j equals an n=1 request seeded with sampling_seed + j."""
    params = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}
    outs = generate(client, input_ids=PROMPTS[1], sampling_params={**params, "n": 3, "sampling_seed": 50})
    assert isinstance(outs, list) and len(outs) == 3
    assert len({o["meta_info"]["id"] for o in outs}) == 3
    for j, out in enumerate(outs):
        single = generate(client, input_ids=PROMPTS[1], sampling_params={**params, "sampling_seed": 50 + j})
        assert out["output_ids"] == single["output_ids"]


def test_batch_input_returns_outputs_in_prompt_order(client: TestClient, reference: HFReference) -> None:
    """A list of prompts with per-prompt adapters answers with one output per prompt, in order."""
    adapters = ["ad4", None, "ad5"]
    outs = generate(
        client, input_ids=PROMPTS, lora_path=adapters, sampling_params={**GREEDY, "max_new_tokens": 9}
    )
    assert [o["output_ids"] for o in outs] == [
        reference.greedy(p, a, 9) for p, a in zip(PROMPTS, adapters, strict=True)
    ]


def test_length_stop_token_and_stop_string(client: TestClient) -> None:
    """max_new_tokens gives "length"; a stop id or stop string gives "stop" with the match."""
    params = {**GREEDY, "ignore_eos": True}
    base = generate(client, input_ids=PROMPTS[2], sampling_params={**params, "max_new_tokens": 12})
    ids = base["output_ids"]
    assert len(ids) == 12 and base["meta_info"]["finish_reason"] == {"type": "length", "length": 12}

    # Stop at the first occurrence of the fourth generated token.
    k = ids.index(ids[3])
    stopped = generate(
        client,
        input_ids=PROMPTS[2],
        sampling_params={**GREEDY, "max_new_tokens": 12, "stop_token_ids": [ids[3]]},
    )
    assert stopped["output_ids"] == ids[: k + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[3]}
    # SGLang semantics: ignore_eos also disables stop_token_ids.
    ignored = generate(
        client,
        input_ids=PROMPTS[2],
        sampling_params={**params, "max_new_tokens": 12, "stop_token_ids": [ids[3]]},
    )
    assert ignored["output_ids"] == ids

    # A stop string: the text of tokens 4..5 of the greedy output; the text ends before it.
    full_text = base["text"]
    prefix = generate(client, input_ids=PROMPTS[2], sampling_params={**params, "max_new_tokens": 4})["text"]
    upto6 = generate(client, input_ids=PROMPTS[2], sampling_params={**params, "max_new_tokens": 6})["text"]
    stop = upto6[len(prefix) :].strip() or upto6[len(prefix) :]
    assert stop and stop in full_text
    out = generate(
        client, input_ids=PROMPTS[2], sampling_params={**params, "max_new_tokens": 12, "stop": stop}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full_text[: full_text.find(stop)]
    assert out["output_ids"] == ids[: len(out["output_ids"])] and len(out["output_ids"]) <= 6


def test_invalid_requests_are_400_with_sglang_error_body(client: TestClient) -> None:
    """Context overflow names both numbers; bad ids, adapters and logprob starts are refused."""
    resp = client.post(
        "/generate", json={"input_ids": [5] * 2000, "sampling_params": {"max_new_tokens": 100}}
    )
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert "2000" in message and "100" in message and "2048" in message

    for body, needle in [
        ({"input_ids": [5, 2048]}, "vocabulary"),
        ({"input_ids": [5, -1]}, "vocabulary"),
        ({"input_ids": [5], "lora_path": "nope"}, "nope"),
        ({"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len"),
        ({"input_ids": []}, "empty"),
        ({"input_ids": [5], "stream": True}, "stream"),
        ({"input_ids": "abc"}, "Validation failed"),
    ]:
        resp = client.post("/generate", json=body)
        assert resp.status_code == 400, body
        assert needle in resp.json()["error"]["message"], (body, resp.json())


def test_null_max_new_tokens_fills_the_context(client: TestClient) -> None:
    """max_new_tokens=null generates up to the context length, like SGLang."""
    prompt = [5 + (i % 1000) for i in range(2043)]
    out = generate(client, input_ids=prompt, sampling_params={"max_new_tokens": None, "ignore_eos": True})
    assert len(out["output_ids"]) == 5
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
