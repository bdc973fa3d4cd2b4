"""`TINKERD_TRAINER_GROUPS` turns the supervisor's one `trainer` into one child per group, each
with its group (and base model, when given) in its environment; each extra base model gets a
sampler child of its own; other services are unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tinkerd.supervisor import expand_services, service_of


def test_each_configured_group_is_one_trainer_child_with_its_group_and_base_model() -> None:
    env = {"TINKERD_TRAINER_GROUPS": "a, n=tiny-qwen3-narrow", "TINKERD_BASE_MODEL": "tiny-qwen3"}
    children = expand_services(("trainer", "planner"), env)
    assert list(children) == ["trainer@a", "trainer@n", "planner"]
    assert children["trainer@a"]["TINKERD_TRAINER_GROUP"] == "a"
    assert "TINKERD_TRAINER_BASE_MODEL" not in children["trainer@a"]  # the deployment's base
    assert children["trainer@n"]["TINKERD_TRAINER_BASE_MODEL"] == "tiny-qwen3-narrow"
    assert children["planner"] == env
    assert [service_of(name) for name in children] == ["trainer", "trainer", "planner"]


def test_without_groups_the_trainer_is_one_child_and_an_empty_group_name_is_refused() -> None:
    assert list(expand_services(("trainer",), {})) == ["trainer"]
    with pytest.raises(SystemExit, match="empty group name"):
        expand_services(("trainer",), {"TINKERD_TRAINER_GROUPS": "a,,b"})


def test_each_extra_base_model_gets_a_sampler_child_the_gateway_is_told_about(tmp_path: Path) -> None:
    """`sampler` is joined by `sampler@<base>` for every extra base model that
    `TINKERD_GATEWAY_BASE_SAMPLER_URLS` does not already list, with its own model directory, binding
    a port of the kernel's choice (0) whose address it announces in its own file (not the primary
    base, whose sampler is `sampler`); every child (the gateway too) sees the extended
    `TINKERD_GATEWAY_BASE_SAMPLER_URLS`, naming that file. Without the sampler among the services
    nothing changes."""
    model = tmp_path / "models" / "other"
    model.mkdir(parents=True)
    config = {"model_type": "qwen3", "vocab_size": 512, "max_position_embeddings": 256}
    (model / "config.json").write_text(json.dumps(config))
    env = {
        "TINKERD_DATA_DIR": str(tmp_path),
        "TINKERD_BASE_MODEL": "tiny-qwen3",
        "TINKERD_GATEWAY_EXTRA_BASE_MODELS": "other, external, tiny-qwen3",
        "TINKERD_GATEWAY_BASE_SAMPLER_URLS": "external=http://10.0.0.1:30000",
    }
    children = expand_services(("sampler", "gateway"), env)
    assert list(children) == ["sampler", "sampler@other", "gateway"]
    extra = children["sampler@other"]
    assert Path(extra["TINKERD_SAMPLER_MODEL_PATH"]).resolve() == model.resolve()
    assert extra["TINKERD_SAMPLER_PORT"] == "0"
    announced = tmp_path.resolve() / "run" / "sampler@other.addr"
    listed = f"external=http://10.0.0.1:30000,other=file://{announced}"
    assert {child["TINKERD_GATEWAY_BASE_SAMPLER_URLS"] for child in children.values()} == {listed}
    assert "TINKERD_SAMPLER_PORT" not in children["sampler"]  # the primary sampler keeps its own
    assert [service_of(name) for name in children] == ["sampler", "sampler", "gateway"]
    assert expand_services(("gateway",), env) == {"gateway": env}


def test_an_alias_of_a_served_base_gets_no_sampler_of_its_own() -> None:
    """An extra base spelled as an alias of the primary (or of another extra) is the same base:
    no second sampler for it, so the gateway never sees an engine entry naming the primary."""
    from tinkerd.supervisor import sampler_bases

    env = {"TINKERD_GATEWAY_EXTRA_BASE_MODELS": "tinkerd/tiny-qwen3,tiny-qwen3-narrow,tinkerd/tiny-qwen3-narrow"}
    assert sampler_bases(env) == ["tiny-qwen3-narrow"]
    # the gateway's own setting names the primary too: then tiny-qwen3 is the extra one
    assert sampler_bases({**env, "TINKERD_GATEWAY_BASE_MODEL": "tinkerd/tiny-qwen3-narrow"}) == ["tiny-qwen3"]
