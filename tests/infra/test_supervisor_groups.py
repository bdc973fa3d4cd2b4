"""`TINKERD_TRAINER_GROUPS` turns the supervisor's one `trainer` into one child per group, each
with its group (and base model, when given) in its environment; other services are unchanged."""

from __future__ import annotations

import pytest

from infra.supervisor import expand_services, service_of


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
