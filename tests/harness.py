"""A real Tinkerd stack for tests: nats-server plus every service as its own process.

Readiness is event-driven: the harness watches each service's log lines for its ready marker
(the supervisor's `READY_MARKERS`; no sleeps, no polling). Services and nats-server run under the
same `Supervisor` as `tinkerd up` (liveness files, announced addresses and the stack state file
included), so a killed or frozen process is restarted exactly as in production. Every HTTP service
binds a port of the kernel's choice; its URL is the one it announced.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from infra.natsd import NatsCluster, NatsServer
from infra.net import ANNOUNCED
from libs.checkpoints import layout
from tests.netutil import unused_port
from tinkerd.supervisor import (
    NATS,
    READY_MARKERS,
    SERVICES,
    SupervisedNats,
    Supervisor,
    gateway_names,
    service_of,
)

if TYPE_CHECKING:
    import pytest

MARKERS = {**READY_MARKERS, NATS: "nats-server ready on"}
START_TIMEOUT_S = 240.0
STACK_MODEL = "tiny-qwen3"


@functools.cache
def inherited_env() -> dict[str, str]:
    """This process's environment for the processes a test starts, pytest's per-test variable
    aside: the services import their libraries under it, so one preloaded fork server serves all
    of a test process's stacks (tinkerd/launcher.py)."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


def _built_stack_model() -> Path:
    """The stacks' base model, built once per test process.

    The build is byte-reproducible (libs/models/tests/test_tiny.py says so) and takes seconds, so
    each stack's data directory gets a copy of this one (milliseconds) instead of a build of its own.
    """
    from libs.models.registry import ensure_tiny

    root = Path(tempfile.mkdtemp(prefix="tinkerd-stack-model-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return ensure_tiny(root, STACK_MODEL)


@dataclass
class Stack:
    data_dir: Path
    services: tuple[str, ...] = SERVICES
    env_overrides: dict[str, str] = field(default_factory=dict)
    gateways: int = 1
    """Gateway replicas (children `gateway`, `gateway-1`, ...), each on its own port (`base_urls`)."""
    child_env: dict[str, dict[str, str]] = field(default_factory=dict)
    """Variables for one child only, by name (a fault point in one gateway replica)."""
    nats_nodes: int = 1
    """1: one supervised nats-server; 3: a JetStream cluster (`cluster`), streams with 3 replicas."""
    supervised_nats: SupervisedNats | None = None
    cluster: NatsCluster | None = None
    supervisor: Supervisor | None = None
    wait: bool = True
    """Whether `start` returns only once every child is ready (False: once they are started)."""
    logs: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    listeners: list[Callable[[str, str], None]] = field(default_factory=list)  # (service, log line)
    _ready: dict[str, threading.Event] = field(default_factory=dict)
    _thread: threading.Thread | None = None

    def address(self, child: str) -> str:
        """The URL an HTTP child announced (kept across its restarts)."""
        assert self.supervisor is not None
        address = self.supervisor.children[child].state.address
        assert address is not None, f"{child} has announced no address (not ready yet?)"
        return address

    @property
    def base_url(self) -> str:
        return self.base_urls[0]

    @property
    def base_urls(self) -> list[str]:
        """Every gateway replica's URL, in the order of `gateway_names`."""
        return [self.address(name) for name in self.gateway_names]

    @property
    def ports(self) -> list[int]:
        return [int(url.rsplit(":", 1)[1]) for url in self.base_urls]

    @property
    def port(self) -> int:
        return self.ports[0]

    @property
    def gateway_names(self) -> tuple[str, ...]:
        return gateway_names(self.gateways)

    @property
    def sampler_url(self) -> str:
        """The sampling engine, as the gateway reaches it."""
        return self.address("sampler")

    @property
    def nats(self) -> NatsServer | None:
        """The nats-server process running now (a new one after a restart, on the same URL)."""
        return self.supervised_nats.server if self.supervised_nats else None

    @property
    def nats_url(self) -> str:
        """The server's URL, or every cluster node's, comma-separated."""
        if self.cluster is not None:
            return self.cluster.url
        assert self.supervised_nats is not None
        return self.supervised_nats.url

    def _on_line(self, service: str, line: str) -> None:
        self.logs[service].append(line)
        if MARKERS[service_of(service)] in line and service in self._ready:
            self._ready[service].set()
        for listener in self.listeners:
            listener(service, line)

    def start(self) -> Stack:
        from libs.models.registry import resolve_base_model

        self.data_dir.mkdir(parents=True, exist_ok=True)
        target = layout.models_root(self.data_dir) / STACK_MODEL
        if not target.exists():  # a restarted stack keeps its own copy
            shutil.copytree(_built_stack_model(), target)
        model = resolve_base_model(STACK_MODEL, self.data_dir)
        replication: dict[str, str] = {}
        if self.nats_nodes > 1:
            route_ports = [unused_port() for _ in range(self.nats_nodes)]  # configured: known to every node
            self.cluster = NatsCluster(self.data_dir / "nats", route_ports).start()
            replication["TINKERD_NATS_REPLICAS"] = str(self.nats_nodes)
        else:
            self.supervised_nats = SupervisedNats(self.data_dir / "nats")
            self.supervised_nats.start()
        run_dir = layout.run_dir(self.data_dir)
        env = {
            **inherited_env(),
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
            "TINKERD_NATS_URL": self.nats_url,
            "TINKERD_DATA_DIR": str(self.data_dir),
            "TINKERD_BASE_MODEL": STACK_MODEL,
            "TINKERD_SAMPLER_MODEL_PATH": str(model.path),
            "TINKERD_GATEWAY_PORT": "0",  # every HTTP service binds a port of the kernel's choice
            "TINKERD_SAMPLER_PORT": "0",
            "TINKERD_SAMPLER_URL": f"{ANNOUNCED}{layout.announce_file(run_dir, 'sampler')}",
            "TINKERD_LOG_LEVEL": "INFO",
            "TINKER_TELEMETRY": "0",
            "TINKERD_NUM_SLOTS": "16",  # planner and trainer agree on the slot pool
            "TINKERD_MAX_LORA_RANK": "32",
            "TINKERD_TRACE_EXPORTER": "jsonl",
            "TINKERD_TRACE_FILE": str(self.data_dir / "traces-{service}.jsonl"),
            **replication,
            **self.env_overrides,
        }
        names = self.services
        child_env: dict[str, dict[str, str]] = {}
        if "gateway" in self.services and self.gateways > 1:
            names = tuple(n for n in self.services if n != "gateway") + self.gateway_names
        for name, extra in self.child_env.items():
            child_env[name] = {**child_env.get(name, {}), **extra}
        self.services = names
        echo = os.environ.get("TINKERD_TEST_ECHO", "0") == "1"
        self.supervisor = Supervisor(
            env,
            self.services,
            on_line=self._on_line,
            echo=echo,
            nats=self.supervised_nats,
            run_dir=run_dir,
            child_env=child_env,
        )
        # one per child: `trainer` is `trainer@<group>` per group of TINKERD_TRAINER_GROUPS
        self._ready = {name: threading.Event() for name in self.supervisor.children}
        self._thread = threading.Thread(target=self.supervisor.run, name="stack", daemon=True)
        self._thread.start()
        if self.wait:
            self.wait_ready(*self.supervisor.children)
        return self

    def wait_ready(self, *services: str, timeout_s: float = START_TIMEOUT_S) -> None:
        for name in services:
            if not self._ready[name].wait(timeout_s):
                tail = "\n".join(self.logs[name][-40:])
                raise RuntimeError(f"{name} did not become ready in {timeout_s:.0f}s; last log lines:\n{tail}")

    def kill(self, service: str) -> threading.Event:
        """kill -9 one service, or nats-server (`NATS`); returns an event set when the restarted
        process is ready again."""
        return self._signal(service, signal.SIGKILL)

    def stop_service(self, service: str) -> None:
        """kill -9 one service and keep it down (the supervisor does not restart it) until `start_service`."""
        assert self.supervisor is not None
        child = self.supervisor.children[service]
        assert child.process is not None
        self.supervisor.hold(service)
        self._ready[service] = threading.Event()
        os.killpg(child.process.pid, signal.SIGKILL)
        child.process.wait()

    def start_service(self, service: str) -> threading.Event:
        """Let a service stopped by `stop_service` start again; the event is set once it is ready."""
        assert self.supervisor is not None
        self.supervisor.release(service)
        return self._ready[service]

    def freeze(self, service: str) -> threading.Event:
        """SIGSTOP one service (a hang: alive, doing nothing); the event is set when the process
        the supervisor started in its place is ready."""
        return self._signal(service, signal.SIGSTOP)

    def _signal(self, service: str, sig: signal.Signals) -> threading.Event:
        assert self.supervisor is not None
        self._ready[service] = threading.Event()
        if service == NATS:
            assert self.nats is not None
            os.kill(self.nats.process.pid, sig)
        else:
            child = self.supervisor.children[service]
            assert child.process is not None
            os.killpg(child.process.pid, sig)
        return self._ready[service]

    def kill_nats_node(self, index: int) -> None:
        """kill -9 one node of the cluster; it stays down until `restart_nats_node`."""
        assert self.cluster is not None, "kill_nats_node needs a stack with nats_nodes > 1"
        self.cluster.kill(index)

    def restart_nats_node(self, index: int) -> None:
        """Start a killed cluster node again on its ports and store (returns once it is ready)."""
        assert self.cluster is not None
        self.cluster.restart(index)

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stopping.set()
            self.supervisor.stop()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.supervised_nats is not None:
            self.supervised_nats.stop()
        if self.cluster is not None:
            self.cluster.stop()

    def spans(self) -> list[dict[str, object]]:
        """Every span the services have finished so far (they export synchronously)."""
        import json

        out: list[dict[str, object]] = []
        for path in sorted(self.data_dir.glob("traces-*.jsonl")):
            out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return out

    def dump_logs(self) -> str:
        return "\n".join(f"[{name}] {line}" for name, lines in self.logs.items() for line in lines[-60:])


JWT_AUTH = {"TINKERD_GATEWAY_JWT_AUTH": "true"}
"""The settings of the contract modules: JWT auth offered to SDKs."""


class SharedStacks:
    """Running stacks shared across modules, one per set of settings (`env_overrides`).

    Tenants are isolated by design, so every module whose tests only need the default settings
    uses one stack for the whole run, and modules that need the same other settings (the JWT
    offer of the contract tests) share one of their own. Besides the default one, at most one is
    up at a time: asking for other settings stops it (modules of one group sit side by side).
    """

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self._factory = factory
        self._default: Stack | None = None
        self._other: tuple[frozenset[tuple[str, str]], Stack] | None = None

    def get(self, env: dict[str, str] | None = None) -> Stack:
        if not env:
            if self._default is None:
                self._default = Stack(self._factory.mktemp("stack")).start()
            return self._default
        key = frozenset(env.items())
        if self._other is not None and self._other[0] == key:
            return self._other[1]
        self._stop_other()
        running = Stack(self._factory.mktemp("shared"), env_overrides=dict(env)).start()
        self._other = (key, running)
        return running

    def _stop_other(self) -> None:
        if self._other is not None:
            self._other[1].stop()
            self._other = None

    def stop(self) -> None:
        self._stop_other()
        if self._default is not None:
            self._default.stop()
            self._default = None


def groups_live_listener(groups: tuple[str, ...]) -> tuple[dict[str, threading.Event], Callable[[str, str], None]]:
    """A `Stack` listener and, per trainer group, the event it sets once the planner logs that group
    live ("trainer group a (...): N adapter slots, live"). A trainer is ready before the planner has
    read its first heartbeat, so a test that needs placement over every group waits for these."""
    live = {group: threading.Event() for group in groups}

    def on_line(service: str, line: str) -> None:
        for group, seen in live.items():
            if service == "planner" and f"trainer group {group} (" in line and line.rstrip().endswith(", live"):
                seen.set()

    return live, on_line


def python() -> str:
    return sys.executable
