"""Pure pieces: configuration from the environment, token choice, finish rules, wire translation."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from services.sampler.config import SamplerConfig
from services.sampler.interface import RequestError
from services.sampler.sampling import Finish, choose_token, finish_reason, trim_text
from services.sampler.translate import to_sequences
from services.sampler.wire import GenerateReqInput, SamplingParams


def test_config_prefers_sampler_prefix_over_shared_prefix() -> None:
    """TINKERD_SAMPLER_<KEY> wins over TINKERD_<KEY>; strings are converted to ints."""
    env = {
        "TINKERD_MODEL_PATH": "/m",
        "TINKERD_PORT": "1234",
        "TINKERD_SAMPLER_PORT": "4321",
        "TINKERD_MAX_BATCH_SIZE": "3",
    }
    config = SamplerConfig.from_env(env)
    assert (config.model_path, config.port, config.max_batch_size) == ("/m", 4321, 3)
    assert config.max_loaded_loras == 16 and config.max_lora_rank == 64 and config.context_length is None


def test_config_names_the_missing_or_bad_variable() -> None:
    """A missing model path or an unparsable value fails with the variable's name."""
    with pytest.raises(ValueError, match="TINKERD_SAMPLER_MODEL_PATH"):
        SamplerConfig.from_env({})
    with pytest.raises(ValueError, match="TINKERD_SAMPLER_MAX_LORA_RANK"):
        SamplerConfig.from_env({"TINKERD_MODEL_PATH": "/m", "TINKERD_SAMPLER_MAX_LORA_RANK": "zero"})
    with pytest.raises(ValueError, match="max_batch_size"):
        SamplerConfig.from_env({"TINKERD_MODEL_PATH": "/m", "TINKERD_MAX_BATCH_SIZE": "0"})


def test_choose_token_greedy_and_top_k_one_pick_the_argmax() -> None:
    """Temperature 0 and top_k=1 both select the most likely token."""
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    for temperature, top_k in ((0.0, -1), (1.0, 1)):
        token = choose_token(
            logits, temperature=temperature, top_k=top_k, top_p=1.0, min_p=0.0, generator=None
        )
        assert token == 1


def test_choose_token_respects_top_k_top_p_min_p_and_seed() -> None:
    """Draws stay inside the top-k / top-p / min-p set, and a seeded generator repeats itself."""
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))

    def draws(seed: int, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return [
            choose_token(logits, temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p, generator=gen)
            for _ in range(200)
        ]

    assert set(draws(0, top_k=2)) == {0, 1}
    assert set(draws(0, top_p=0.65)) == {0, 1}
    assert set(draws(0, min_p=0.6)) == {0, 1}
    assert set(draws(0)) == {0, 1, 2, 3}
    assert draws(5) == draws(5)


def _letters(ids: Sequence[int]) -> str:
    return "".join(chr(96 + t) for t in ids)


def test_finish_reason_follows_sglang_order() -> None:
    """Length beats EOS; ignore_eos disables EOS and stop ids but not stop strings."""

    def check(
        ids: list[int], max_new: int, ignore_eos: bool, stop_ids: set[int], strs: list[str]
    ) -> Finish | None:
        return finish_reason(
            ids,
            max_new_tokens=max_new,
            ignore_eos=ignore_eos,
            stop_token_ids=frozenset(stop_ids),
            stop_strs=strs,
            decode=_letters,
        )

    assert check([5, 2], 2, False, {2}, []) == Finish("length")
    assert check([5, 2], 9, False, {2}, []) == Finish("stop", 2)
    assert check([5, 2], 9, True, {2}, []) is None
    assert check([1, 3, 4], 9, True, set(), ["cd"]) == Finish("stop", "cd")
    assert check([1, 3], 9, True, set(), ["cd"]) is None
    assert trim_text("xxcdyy", Finish("stop", "cd"), no_stop_trim=False) == "xx"
    assert trim_text("xxcdyy", Finish("stop", "cd"), no_stop_trim=True) == "xxcdyy"


def test_translation_orders_outputs_prompt_major_with_per_sample_seeds() -> None:
    """A batch of 2 prompts with n=2 gives 4 sequences; sample j uses sampling_seed + j."""
    req = GenerateReqInput(
        input_ids=[[1, 2], [3]],
        sampling_params=SamplingParams(n=2, sampling_seed=10, stop="x"),
        lora_path=["a", None],
        return_logprob=True,
    )
    planned, as_list = to_sequences(req)
    assert as_list
    assert [(p.sequence.input_ids, p.sequence.seed, p.sequence.lora_name) for p in planned] == [
        ([1, 2], 10, "a"),
        ([1, 2], 11, "a"),
        ([3], 10, None),
        ([3], 11, None),
    ]
    assert planned[0].sequence.stop_strs == ["x"] and planned[0].sequence.logprob_start_len == 1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (GenerateReqInput(input_ids=[1], stream=True), "stream"),
        (GenerateReqInput(text="hi"), "input_ids"),
        (GenerateReqInput(input_ids=[[1], [2]], lora_path=["a"]), "lora_path"),
        (GenerateReqInput(input_ids=[1], sampling_params=SamplingParams(top_k=0)), "top_k"),
        (
            GenerateReqInput(input_ids=[1], sampling_params=SamplingParams(repetition_penalty=1.1)),
            "repetition_penalty",
        ),
        (GenerateReqInput(input_ids=[1, [2]]), "input_ids"),
    ],
)
def test_translation_refuses_what_it_cannot_honour(body: GenerateReqInput, message: str) -> None:
    """Unsupported or malformed requests are refused, naming the field."""
    with pytest.raises(RequestError, match=message):
        to_sequences(body)
