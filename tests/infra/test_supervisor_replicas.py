"""`tinkerd up --gateways N`: the supervisor's children for N gateway replicas (pure logic)."""

from __future__ import annotations

from tinkerd.cli import parser
from tinkerd.supervisor import SERVICES, Supervisor, service_of, with_gateway_replicas


def test_gateway_replicas_are_children_on_consecutive_ports_running_the_gateway() -> None:
    """Three replicas become `gateway`, `gateway-1`, `gateway-2` on ports 8000-8002, each running
    `serve gateway`, the other services unchanged and on the shared environment."""
    services, child_env = with_gateway_replicas(SERVICES, 3, 8000)
    assert services == ("trainer", "planner", "publisher", "sampler", "gateway", "gateway-1", "gateway-2")
    supervisor = Supervisor({"TINKERD_GATEWAY_PORT": "8000", "X": "1"}, services, echo=False, child_env=child_env)
    ports = {name: child.env["TINKERD_GATEWAY_PORT"] for name, child in supervisor.children.items()}
    assert [ports[n] for n in ("gateway", "gateway-1", "gateway-2")] == ["8000", "8001", "8002"]
    assert all(child.env["X"] == "1" for child in supervisor.children.values())
    assert {service_of(name) for name in services} == set(SERVICES)


def test_one_gateway_or_none_leaves_the_services_alone() -> None:
    assert with_gateway_replicas(SERVICES, 1, 8000) == (SERVICES, {})
    assert with_gateway_replicas(("planner",), 3, 8000) == (("planner",), {})


def test_up_takes_a_gateway_count() -> None:
    assert parser().parse_args(["up", "--gateways", "2"]).gateways == 2
    assert parser().parse_args(["up"]).gateways == 1
