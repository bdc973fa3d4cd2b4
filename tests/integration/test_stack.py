"""The stack as an operator sees it: bootstrap through the real SDK, events, supervision."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
import tinker

from infra.bus import Bus
from libs.contracts import subjects as s
from tests.harness import Stack


def test_healthz_answers_200_once_every_service_is_up(stack: Stack) -> None:
    """healthz is readiness: the harness returns once every service (the sampler included) logged
    ready, and then healthz answers 200."""
    response = httpx.get(f"{stack.base_url}/api/v1/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_official_sdk_completes_its_bootstrap(stack: Stack) -> None:
    """client/config, dynamic_config and create_session, as ServiceClient does them."""
    client = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-bootstrap")
    capabilities = client.get_server_capabilities()
    assert capabilities.supported_models[0].model_name == "tiny-qwen3"
    session_id = client.holder.get_session_id()
    assert session_id.startswith("s-")


def test_events_show_a_line_for_a_request(stack: Stack) -> None:
    """`tinker.events.>` carries a readable event for every request made through the gateway."""

    async def scenario() -> list[str]:
        bus = await Bus.connect(stack.nats_url, "test-events")
        seen: list[str] = []
        got = asyncio.Event()

        async def on_event(msg) -> None:  # type: ignore[no-untyped-def]
            seen.append(msg.subject)
            if msg.subject.startswith("tinker.events.session."):
                got.set()

        await bus.nc.subscribe(s.EVENTS_ALL, cb=on_event)
        await bus.nc.flush()
        async with httpx.AsyncClient(base_url=stack.base_url, headers={"X-API-Key": "tml-events"}) as http:
            response = await http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "test"})
            assert response.status_code == 200
        await asyncio.wait_for(got.wait(), 30)
        await bus.close()
        return seen

    subjects = asyncio.run(scenario())
    assert any(subject.startswith("tinker.events.session.") for subject in subjects)


def test_events_command_formats_one_readable_line() -> None:
    from libs.contracts import codec
    from libs.contracts.events import RequestAccepted, describe

    event = RequestAccepted(kind="forward_backward", num_datums=2, num_tokens=40, model_id="s-1:train:0", seq_id=3, request_id="s-1:train:0:3")
    line = describe(codec.event_decoder.decode(codec.to_json(event)))
    assert line.startswith("accepted")
    assert "model=s-1:train:0" in line and "seq=3" in line and "num_tokens=40" in line


@pytest.mark.parametrize("service", ["planner", "publisher"])
def test_a_killed_service_is_restarted(stack: Stack, service: str) -> None:
    """kill -9 a service: the supervisor restarts it and it becomes ready again."""
    assert stack.supervisor is not None
    before = stack.supervisor.children[service].process
    assert before is not None
    ready_again = stack.kill(service)
    assert ready_again.wait(120), stack.dump_logs()
    after = stack.supervisor.children[service].process
    assert after is not None and after.pid != before.pid and after.poll() is None


def test_stopping_leaves_no_process_behind(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Stopping the stack ends every service process group and nats-server."""
    small = Stack(tmp_path, services=("planner", "publisher")).start()
    assert small.supervisor is not None and small.nats is not None
    pids = [c.process.pid for c in small.supervisor.children.values() if c.process]
    nats_pid = small.nats.process.pid
    small.stop()
    for pid in [*pids, nats_pid]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
