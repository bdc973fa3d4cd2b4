"""A stack that says it is ready serves: addresses bound by their listeners, bind failures that
end, readiness that includes the sampler, and samples that stop waiting for an engine that cannot
start. Real processes throughout: `tinkerd up`, the supervised stack, the official SDK."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.faults.test_sampler_restart import Watcher
from tests.harness import Stack
from tests.netutil import churn_ports

TINKERD = [sys.executable, "-m", "tinkerd.cli"]
GREEDY = types.SamplingParams(max_tokens=4, temperature=0.0)
PROMPT = types.ModelInput.from_ints([5, 6, 7])


def base_sample(base_url: str, key: str) -> list[int]:
    """One greedy sample of the base model through the SDK."""
    service = tinker.ServiceClient(base_url=base_url, api_key=key)
    sampler = service.create_sampling_client(base_model="tiny-qwen3").result()
    out = sampler.sample(PROMPT, num_samples=1, sampling_params=GREEDY).result(timeout=300)
    return list(out.sequences[0].tokens)


def held_port() -> socket.socket:
    """A listening socket this test holds on a port of the kernel's choice."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_a_taken_gateway_port_makes_tinkerd_up_fail_naming_the_address_and_its_holder(tmp_path: Path) -> None:
    """`tinkerd up --port P` while this test holds P: the gateway cannot bind, the supervisor
    stops after a bounded number of attempts, and `tinkerd up` exits non-zero with a message
    naming the address and this process as its holder."""
    with held_port() as sock:
        port = sock.getsockname()[1]
        done = subprocess.run(
            [*TINKERD, "up", "--services", "gateway", "--port", str(port), "--data-dir", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"cannot bind 127.0.0.1:{port}: address already in use" in done.stderr, done.stderr
    assert f"held by pid {os.getpid()} " in done.stderr, done.stderr
    assert "tried 3 times" in done.stderr, done.stderr
    assert "Tinkerd is ready" not in done.stdout


def test_a_sampler_port_taken_while_it_was_down_is_replaced_and_sampling_follows(tmp_path: Path) -> None:
    """The sampler's port (the kernel's choice, kept across restarts) is taken while the sampler is
    down: the restarted sampler fails to bind it, the supervisor lets it bind another, and the
    gateway samples through the new address it announced."""
    stack = Stack(tmp_path).start()
    try:
        before = base_sample(stack.base_url, "tml-port-moved")
        old = stack.sampler_url
        stack.stop_service("sampler")
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # its old connections linger in TIME_WAIT
            sock.bind(("127.0.0.1", int(old.rsplit(":", 1)[1])))
            sock.listen()
            assert stack.start_service("sampler").wait(240), stack.dump_logs()
            assert stack.sampler_url != old
            assert any("cannot bind" in line for line in stack.logs["sampler"]), stack.dump_logs()
            assert base_sample(stack.base_url, "tml-port-moved") == before
    finally:
        stack.stop()


def test_each_of_three_starts_samples_while_another_process_churns_ephemeral_ports(tmp_path: Path) -> None:
    """A start-up soak: the stack is started and stopped three times while another process opens
    and closes short-lived listeners on ports of the kernel's choice; each start answers healthz
    200 and completes a sample, and every start samples the same tokens."""
    churner = churn_ports(rounds=10_000_000)  # far more than three starts take: killed below
    samples = []
    try:
        for attempt in range(3):
            stack = Stack(tmp_path / f"start-{attempt}").start()
            try:
                health = httpx.get(f"{stack.base_url}/api/v1/healthz", timeout=30)
                assert health.status_code == 200, health.text
                samples.append(base_sample(stack.base_url, f"tml-soak-{attempt}"))
            finally:
                stack.stop()
        assert churner.poll() is None, "the churn ended before the last start"
    finally:
        churner.kill()
        churner.wait()
    assert len(samples) == 3 and samples[0] == samples[1] == samples[2]


def test_a_sampler_that_cannot_start_is_reported_and_its_samples_fail_naming_it(tmp_path: Path) -> None:
    """The sampler is given a model directory that does not exist, so it exits at every start.
    healthz answers 503 naming it and how it exited, `tinkerd status` and the operator status show
    it, a waiting sample's
    queue_state names the engine, and the sample fails (not `try_again` until its 1,800 s
    deadline) once the engine has been failing for the configured bound, naming it and why."""
    missing = tmp_path / "no-such-model"
    exited = threading.Event()

    def on_line(service: str, line: str) -> None:
        if service == "sampler" and line.startswith("exited with code 1"):
            exited.set()

    stack = Stack(
        tmp_path / "stack",
        env_overrides={"TINKERD_GATEWAY_ENGINE_FAILING_S": "5"},
        child_env={"sampler": {"TINKERD_SAMPLER_MODEL_PATH": str(missing)}},
        wait=False,
    )
    stack.listeners.append(on_line)
    stack.start()
    watch: Watcher | None = None
    try:
        stack.wait_ready("gateway", "planner", "publisher", "trainer")
        assert exited.wait(120), stack.dump_logs()
        health = httpx.get(f"{stack.base_url}/api/v1/healthz", timeout=30)
        assert health.status_code == 503
        services = health.json()["services"]
        assert "exited with code 1" in services["sampler"], services
        assert "sampler.addr" in services["engines of tiny-qwen3"], services

        status = subprocess.run(
            [*TINKERD, "status", "--nats", stack.nats_url, "--data-dir", str(stack.data_dir)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        line = next(x for x in status.stdout.splitlines() if x.strip().startswith("sampler "))
        assert "exited with code 1" in line, status.stdout
        operator = httpx.get(f"{stack.base_url}/api/v1/operator/status", timeout=30).json()["services"]
        assert operator["sampler"]["state"] in ("starting", "restarting"), operator
        assert operator["sampler"]["restarts"] >= 1 and operator["sampler"]["failing_since_ns"], operator

        watch = Watcher(stack.nats_url).start()
        with pytest.raises(tinker.RequestFailedError) as failed:
            base_sample(stack.base_url, "tml-no-engine")
        message = str(failed.value)
        assert "no sampling engine of base model 'tiny-qwen3' can serve" in message, message
        assert "sampler.addr" in message and "exited with code 1" in message, message
        reasons = [record.reason for record in watch.paused_ever.values()]
        assert any("sampler.addr" in reason for reason in reasons), reasons
    finally:
        if watch is not None:
            watch.stop()
        stack.stop()
