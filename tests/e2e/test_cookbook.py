"""tinker-cookbook 0.6.1, unmodified, against the real stack on the tiny model.

The cookbook's supervised loop (bundled example conversations, `role_colon` renderer) trains with
checkpoints and then resumes from its saved state; the RL loop trains on the cookbook's
arithmetic environment with `importance_sampling`, then with `ppo`, and asynchronously with its
default `stable_reinforce`; `recipes/rl_loop` runs with its default `stable_reinforce`. No outbound network: the
cookbook's pricing fetch is switched off the way its own module allows.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def offline_cookbook(stack: Stack) -> None:
    import tinker_cookbook.utils.cost_estimation as cost_estimation

    cost_estimation._pricing_fetched = True  # the cookbook's own switch for "already fetched"
    os.environ["TINKER_API_KEY"] = "tml-cookbook"


def tokenizer_path(stack: Stack) -> str:
    return str(stack.data_dir / "models" / "tiny-qwen3")


def sl_config(stack: Stack, log_path: Path, max_steps: int):  # type: ignore[no-untyped-def]
    import tinker_cookbook
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    model = tokenizer_path(stack)
    conversations = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    builder = FromConversationFileBuilder(
        file_path=str(conversations),
        common_config=ChatDatasetBuilderCommonConfig(
            model_name_for_tokenizer=model, renderer_name="role_colon", max_length=128, batch_size=8
        ),
    )
    return train.Config(
        log_path=str(log_path),
        model_name=model,
        recipe_name="tinkerd_e2e_sl",
        renderer_name="role_colon",
        dataset_builder=builder,
        learning_rate=1e-3,
        lora_rank=8,
        base_url=stack.base_url,
        max_steps=max_steps,
        save_every=2,
        eval_every=0,
        infrequent_eval_every=0,
    )


def read_checkpoints(log_path: Path) -> list[dict[str, object]]:
    lines = (log_path / "checkpoints.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_supervised_train_with_checkpoints_then_resume(stack: Stack, tmp_path: Path) -> None:
    """A run checkpoints every 2 steps; cut back to its step-2 checkpoint (as if it had died
    there), the cookbook resumes from that saved state and finishes the remaining steps; its
    metrics log keeps one row per step (the redone steps' first rows set aside)."""
    from tinker_cookbook.supervised import train

    log_path = tmp_path / "sl"
    asyncio.run(train.main(sl_config(stack, log_path, max_steps=4)))
    first = read_checkpoints(log_path)
    assert first and all(str(c["state_path"]).startswith("tinker://") for c in first if "state_path" in c)
    mid = next(c for c in first if c.get("batch") == 2)
    (log_path / "checkpoints.jsonl").write_text(json.dumps(mid) + "\n")  # the run "died" after step 2

    asyncio.run(train.main(sl_config(stack, log_path, max_steps=4)))  # resumes from the step-2 state
    second = read_checkpoints(log_path)
    assert len(second) > 1 and second[-1]["state_path"] != mid["state_path"]
    # The step column is the cookbook's own (the server's optim_step metrics never overwrite it),
    # so the resume drops the rows the first run logged past its step-2 checkpoint (keeping the
    # file as it was beside it) and logs steps 2 and 3 again; the server's count of applied steps
    # is its own key.
    def trained_rows(name: str) -> list[dict[str, Any]]:
        lines = (log_path / name).read_text().splitlines()
        return [r for r in (json.loads(line) for line in lines if line.strip()) if "train_mean_nll" in r]

    first_run, trained = trained_rows("metrics.jsonl.pre_resume_000002"), trained_rows("metrics.jsonl")
    assert [r["step"] for r in first_run] == [r["step"] for r in trained] == [0, 1, 2, 3]
    assert [r["optimizer_step"] for r in first_run] == [1.0, 2.0, 3.0, 4.0]
    before, after = first_run[2:], trained[2:]
    assert [r["progress"] for r in after] == [0.75, 1.0]
    assert [r["num_tokens"] for r in after] == [r["num_tokens"] for r in before]  # the same batches


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo"])
def test_rl_train_on_arithmetic(stack: Stack, tmp_path: Path, loss_fn: str) -> None:
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train

    model = tokenizer_path(stack)
    config = train.Config(
        learning_rate=1e-3,
        dataset_builder=ArithmeticDatasetBuilder(
            batch_size=2, group_size=2, n_batches=2, model_name_for_tokenizer=model, renderer_name="role_colon"
        ),
        model_name=model,
        recipe_name="tinkerd_e2e_rl",
        renderer_name="role_colon",
        max_tokens=6,
        log_path=str(tmp_path / f"rl-{loss_fn}"),
        eval_every=0,
        save_every=0,
        loss_fn=loss_fn,  # type: ignore[arg-type]
        lora_rank=8,
        base_url=stack.base_url,
        max_steps=2,
    )
    asyncio.run(train.main(config))
    metrics = [json.loads(line) for line in (tmp_path / f"rl-{loss_fn}" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(metrics) >= 2


class ForwardBackwardSpy:
    """Every `TrainingClient.forward_backward` call a recipe makes: its loss and its future
    (the calls go through unchanged)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import tinker

        self.calls: list[tuple[str, Any]] = []
        original = tinker.TrainingClient.forward_backward

        def spy(client: Any, data: Any, loss_fn: str, *args: Any, **kwargs: Any) -> Any:
            future = original(client, data, loss_fn, *args, **kwargs)  # type: ignore[arg-type]
            self.calls.append((loss_fn, future))
            return future

        monkeypatch.setattr(tinker.TrainingClient, "forward_backward", spy)

    def results(self, loss_fn: str) -> list[Any]:
        return [future.result() for name, future in self.calls if name == loss_fn]


def test_rl_loop_recipe_trains_with_its_default_stable_reinforce(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`recipes/rl_loop` as shipped, with its default loss: a recording sampler, provenance on
    every datum, `stable_reinforce` steps. What this machine cannot give it is substituted from
    outside: GSM8K (no network) by a few local rows, the tiny model's renderer (the cookbook's
    model registry does not know it) by `role_colon`, and the GSM8K grader (which the untrained
    tiny model never satisfies) by the response's length, so the groups have advantages."""
    import datasets
    from tinker_cookbook import model_info
    from tinker_cookbook.recipes import rl_loop

    rows = {"question": [f"What is {i} + {i}?" for i in range(4)], "answer": [f"#### {2 * i}" for i in range(4)]}
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}))
    monkeypatch.setattr(model_info, "get_recommended_renderer_name", lambda name: "role_colon")
    monkeypatch.setattr(rl_loop, "get_reward", lambda response, answer: float(len(response)))
    spy = ForwardBackwardSpy(monkeypatch)
    config = rl_loop.Config(
        base_url=stack.base_url,
        log_path=str(tmp_path / "rl-loop"),
        model_name=tokenizer_path(stack),
        batch_size=2,
        group_size=3,
        max_tokens=6,
        lora_rank=8,
        learning_rate=1e-3,
        save_every=0,
        max_steps=2,
    )
    assert config.loss_fn == "stable_reinforce"
    rl_loop.main(config)
    trained = spy.results("stable_reinforce")
    assert len(trained) == 2 and all(r.loss_fn_outputs and "loss:sum" in r.metrics for r in trained)
    assert all(r.metrics["stable_reinforce/masked_sequences:sum"] == 0 for r in trained[:1])  # on-policy
    checkpoints = read_checkpoints(tmp_path / "rl-loop")
    assert checkpoints[-1]["name"] == "final" and str(checkpoints[-1]["state_path"]).startswith("tinker://")


def test_rl_train_async_trains_off_policy_with_its_default_loss(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rl.train` with an `AsyncConfig` (sampling may run one step ahead of training) at its
    default loss, `stable_reinforce`: its samplers record, and every training step it sends is
    accepted and answered."""
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train

    spy = ForwardBackwardSpy(monkeypatch)
    model = tokenizer_path(stack)
    config = train.Config(
        learning_rate=1e-3,
        dataset_builder=ArithmeticDatasetBuilder(
            batch_size=2, group_size=2, n_batches=3, model_name_for_tokenizer=model, renderer_name="role_colon"
        ),
        model_name=model,
        recipe_name="tinkerd_e2e_rl_async",
        renderer_name="role_colon",
        max_tokens=6,
        log_path=str(tmp_path / "rl-async"),
        eval_every=0,
        save_every=0,
        lora_rank=8,
        base_url=stack.base_url,
        max_steps=3,
        async_config=train.AsyncConfig(max_steps_off_policy=1, groups_per_batch=2),
    )
    assert config.training_loss_fn() == "stable_reinforce"
    asyncio.run(train.main(config))
    trained = spy.results("stable_reinforce")
    assert len(trained) >= 3 and all("loss:sum" in r.metrics for r in trained)
    metrics = [json.loads(line) for line in (tmp_path / "rl-async" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(metrics) >= 3
