"""`tinkerd up`: one command that runs the whole stack on this machine.

Starts nats-server (unless an existing server is given), then each service as its own process
(`tinkerd serve NAME`, started by `tinkerd/launcher.py`: forked from a process that has already
imported torch and its kin, or on a GPU machine executed afresh). It supervises them all: log
lines are prefixed by service; a process that exits (a crash, kill -9) is restarted with backoff,
nats-server on the same port and store; a service that stops showing signs of life (its liveness
file, touched every few seconds by its event loop, goes stale: a frozen or deadlocked process) is
killed and restarted the same way; and Ctrl-C (or SIGTERM) stops everything, nats-server
included, leaving no process behind.

Addresses: no port is chosen by probing. nats-server picks its own ports; each HTTP service
(gateway, sampler) binds its own socket and announces the bound address in `DATA/run/<child>.addr`
(`infra/net.py`), which is how the gateway finds the samplers (`file://` engine addresses). A port
the supervisor let the kernel choose is kept across restarts, and chosen anew when it was taken
meanwhile; a configured port that cannot be bound fails the stack after `MAX_BIND_FAILURES`
attempts, with the holder named. Each child's state (starting, up, restarting, ...) is written to
`DATA/run/stack.json` (`infra/stack_state.py`) for healthz and `tinkerd status`.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from infra import stack_state as st
from infra.config import DEFAULT_DATA_DIR
from infra.natsd import NatsServer, start_nats
from infra.net import ANNOUNCED, BIND_FAILED_EXIT, BIND_FAILED_PREFIX, BindError, read_announcement
from infra.stack_state import service_of
from libs.checkpoints import layout
from tinkerd import launcher
from tinkerd.launcher import Process

SERVICES = ("trainer", "planner", "publisher", "sampler", "gateway")
COLORS = {"gateway": 36, "planner": 35, "trainer": 33, "publisher": 32, "sampler": 34, "nats": 37}


def gateway_names(replicas: int) -> tuple[str, ...]:
    """The children of `replicas` gateway replicas: `gateway`, then `gateway-1`, `gateway-2`, ..."""
    return ("gateway", *(f"gateway-{i}" for i in range(1, replicas)))


def with_gateway_replicas(
    services: tuple[str, ...], gateways: int, port: int
) -> tuple[tuple[str, ...], dict[str, dict[str, str]]]:
    """`services` with `gateway` replaced by `gateways` replicas on ports `port`, `port + 1`, ...,
    and each replica's port variable (for `Supervisor(child_env=...)`)."""
    if "gateway" not in services or gateways <= 1:
        return services, {}
    names = gateway_names(gateways)
    child_env = {name: {"TINKERD_GATEWAY_PORT": str(port + i)} for i, name in enumerate(names)}
    return tuple(n for n in services if n != "gateway") + names, child_env


READY_MARKERS = {
    "gateway": "gateway serving on",
    "planner": "planner ready",
    "trainer": "tinkerd.trainer: trainer",
    "publisher": "publisher ready",
    "sampler": "sampler serving on",
}
"""The log line that says a service is up (an HTTP service's: it serves on its announced address)."""
PORT_VARS = {"gateway": "TINKERD_GATEWAY_PORT", "sampler": "TINKERD_SAMPLER_PORT"}
"""The HTTP services, by the variable of the port they bind (0: the kernel picks one)."""
MAX_BIND_FAILURES = 3
"""Attempts to bind a configured address before the supervisor gives up and the stack stops."""


def _prefix(name: str) -> str:
    label = f"{name:<9}|"
    if sys.stdout.isatty():
        return f"\033[{COLORS.get(service_of(name), 37)}m{label}\033[0m "
    return label + " "


def trainer_groups(env: dict[str, str]) -> list[tuple[str, str]]:
    """`TINKERD_TRAINER_GROUPS`: comma-separated `group[=base_model]` (e.g. `a,b` or
    `q=tiny-qwen3,w=tiny-wide`): the trainer groups `tinkerd up` starts, one process each. Empty
    (the default): one group, `TINKERD_TRAINER_GROUP` (else "default"), of the deployment's base."""
    spec = env.get("TINKERD_TRAINER_GROUPS", "").strip()
    if not spec:
        return []
    groups = []
    for part in spec.split(","):
        name, _, base = part.strip().partition("=")
        if not name:
            raise SystemExit(f"TINKERD_TRAINER_GROUPS: empty group name in {spec!r}")
        groups.append((name, base))
    return groups


def sampler_bases(env: Mapping[str, str]) -> list[str]:
    """The extra base models that get a CPU sampler of their own (`sampler@<base>`): each one in
    `TINKERD_GATEWAY_EXTRA_BASE_MODELS` that `TINKERD_GATEWAY_BASE_SAMPLER_URLS` does not already
    give engines (an operator's own SGLang, say). The primary base model's sampler is `sampler`."""
    from libs.models.registry import ALIASES

    def canonical(name: str) -> str:  # `tinkerd/tiny-qwen3` and `tiny-qwen3` are one base
        name = name.strip()
        return ALIASES.get(name, name)

    extra = [b.strip() for b in env.get("TINKERD_GATEWAY_EXTRA_BASE_MODELS", "").split(",") if b.strip()]
    listed = {canonical(e.partition("=")[0]) for e in env.get("TINKERD_GATEWAY_BASE_SAMPLER_URLS", "").split(",")}
    primary = env.get("TINKERD_GATEWAY_BASE_MODEL") or env.get("TINKERD_BASE_MODEL", "tiny-qwen3")
    listed.add(canonical(primary))
    unique = dict.fromkeys(canonical(base) for base in extra)
    return [base for base in unique if base not in listed]


def child_label(base: str) -> str:
    """A base model's name as part of a child's name (and its liveness file's)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", base)


def with_base_samplers(env: dict[str, str]) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """(`env` with `TINKERD_GATEWAY_BASE_SAMPLER_URLS` extended, the children `sampler@<base>`):
    a sampler per base of `sampler_bases`, on a port it picks when it binds (announced in its
    `.addr` file, which is the engine address the gateway is given), serving that base's model
    directory (built first when it is an embedded tiny model)."""
    from libs.models.registry import resolve_base_model

    bases = sampler_bases(env)
    if not bases:
        return env, {}
    data_dir = Path(env.get("TINKERD_DATA_DIR", DEFAULT_DATA_DIR)).expanduser()
    children: dict[str, dict[str, str]] = {}
    entries = [e for e in env.get("TINKERD_GATEWAY_BASE_SAMPLER_URLS", "").split(",") if e.strip()]
    for base in bases:
        path = resolve_base_model(base, data_dir).path
        child = f"sampler@{child_label(base)}"
        children[child] = {"TINKERD_SAMPLER_MODEL_PATH": str(path), "TINKERD_SAMPLER_PORT": "0"}
        entries.append(f"{base}={ANNOUNCED}{layout.announce_file(layout.run_dir(data_dir.resolve()), child)}")
    return {**env, "TINKERD_GATEWAY_BASE_SAMPLER_URLS": ",".join(entries)}, children


def expand_services(services: tuple[str, ...], env: dict[str, str]) -> dict[str, dict[str, str]]:
    """Child name -> its environment: `trainer` becomes `trainer@<group>` per configured group,
    and `sampler` is joined by `sampler@<base>` per extra base model (`with_base_samplers`)."""
    children: dict[str, dict[str, str]] = {}
    samplers: dict[str, dict[str, str]] = {}
    if "sampler" in services:
        env, samplers = with_base_samplers(env)
    for name in services:
        groups = trainer_groups(env) if name == "trainer" else []
        if name == "sampler":
            children[name] = env
            children.update({child: {**env, **extra} for child, extra in samplers.items()})
            continue
        if not groups:
            children[name] = env
            continue
        for group, base in groups:
            extra = {"TINKERD_TRAINER_GROUP": group, **({"TINKERD_TRAINER_BASE_MODEL": base} if base else {})}
            children[f"trainer@{group}"] = {**env, **extra}
    return children


LIVENESS_TIMEOUT_S = 60.0
"""A service whose liveness file is older than this is taken as hung (`TINKERD_LIVENESS_TIMEOUT_S`)."""


@dataclass
class Child:
    name: str
    env: dict[str, str]
    process: Process | None = None
    restarts: int = 0
    started_at: float = 0.0
    log_thread: threading.Thread | None = field(default=None, repr=False)
    liveness: Path | None = None  # touched by the service's event loop (infra/runner.py)
    announce: Path | None = None  # where an HTTP service announces its bound address
    chosen_port: bool = False  # its port is the kernel's choice (kept across restarts), not configured
    bind_failures: int = 0  # consecutive starts that could not bind a configured address
    state: st.ServiceState = field(default_factory=lambda: st.ServiceState(state=st.STARTING, since_ns=time.time_ns()))
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=40), repr=False)

    @property
    def port_var(self) -> str | None:
        return PORT_VARS.get(service_of(self.name))

    def last_line(self, containing: str = "") -> str:
        """Its last non-empty log line (that contains `containing`), for a failure's detail."""
        return next((line for line in reversed(self.tail) if line.strip() and containing in line), "")


NATS = "nats"
Exit = tuple[str, "Process | None"]
"""What the supervisor's queue carries: a child (or NATS) and the process of it that ended."""


class SupervisedNats:
    """The embedded nats-server: restarted on the same port and store whenever it exits."""

    def __init__(self, data_dir: Path, log_sink: Path | None = None, port: int = -1) -> None:
        self.data_dir = data_dir
        self.log_sink = log_sink
        self.port = port
        self.server: NatsServer | None = None
        self.restarts = 0
        self.started_at = 0.0
        self.bind_failures = 0

    def start(self) -> NatsServer:
        self.server = start_nats(self.data_dir, port=self.port, log_sink=self.log_sink)
        self.port = int(self.server.url.rsplit(":", 1)[1])  # a restart keeps the clients' URL
        self.started_at = time.monotonic()
        return self.server

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def watch(self, exits: queue.Queue[Exit]) -> None:
        """Report the server's exit (reaping it: no zombie) to the supervisor's queue."""
        server = self.server
        assert server is not None

        def wait() -> None:
            server.process.wait()
            exits.put((NATS, None))

        threading.Thread(target=wait, name="nats-watch", daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()




class Supervisor:
    """Runs services as child processes; `on_line(service, line)` sees every line they log."""

    def __init__(
        self,
        env: dict[str, str],
        services: tuple[str, ...] = SERVICES,
        on_line: Callable[[str, str], None] | None = None,
        echo: bool = True,
        nats: SupervisedNats | None = None,
        run_dir: Path | None = None,
        child_env: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        """`nats`: a started embedded server to keep alive; `run_dir`: where liveness files go
        (None: no liveness checks); `child_env`: variables of one child over `env` (a gateway
        replica's port). A child named `SERVICE-N` runs SERVICE (`service_of`)."""
        self.env = env
        extra = child_env or {}
        self.children = {
            name: Child(name, {**base_env, **extra.get(name, {})})
            for name, base_env in expand_services(services, env).items()
        }
        self.exits: queue.Queue[Exit] = queue.Queue()
        self.stopping = threading.Event()
        self.held: set[str] = set()  # services that stay down when they exit, until `release`
        self.on_line = on_line
        self.echo = echo
        self.nats = nats
        self.liveness_timeout_s = float(env.get("TINKERD_LIVENESS_TIMEOUT_S", LIVENESS_TIMEOUT_S))
        self.failure: str | None = None  # why the supervisor gave up (the stack then stops)
        self.state_file: Path | None = None
        self.nats_state = st.ServiceState(state=st.UP, since_ns=time.time_ns())
        for child in self.children.values():
            child.chosen_port = child.port_var is not None and child.env.get(child.port_var) == "0"
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.state_file = layout.stack_state_file(run_dir)
            for child in self.children.values():
                child.liveness = layout.liveness_file(run_dir, child.name)
                child.env = {
                    **child.env,
                    "TINKERD_LIVENESS_FILE": str(child.liveness),
                    "TINKERD_STACK_STATE_FILE": str(self.state_file),
                }
                if child.port_var is not None:
                    child.announce = layout.announce_file(run_dir, child.name)
                    child.env["TINKERD_ANNOUNCE_FILE"] = str(child.announce)
        self._print_lock = threading.Lock()
        self._state_lock = threading.Lock()

    def _set_state(self, child: Child | None, state: str, detail: str = "") -> None:
        """Record a child's (None: nats-server's) new state and rewrite the stack state file."""
        with self._state_lock:
            old = self.nats_state if child is None else child.state
            failing = state in (st.RESTARTING, st.FAILED)
            new = st.ServiceState(
                state=state,
                since_ns=time.time_ns(),
                restarts=old.restarts + (state == st.RESTARTING),
                detail=detail,
                address=old.address,
                failing_since_ns=(old.failing_since_ns or time.time_ns()) if failing else
                (old.failing_since_ns if state == st.STARTING else None),
            )
            if child is None:
                self.nats_state = new
            else:
                child.state = new
            self._write_state()

    def _write_state(self) -> None:
        if self.state_file is None:
            return
        services = {name: child.state for name, child in self.children.items()}
        if self.nats is not None:
            services = {NATS: self.nats_state, **services}
        st.write_state(self.state_file, st.StackState(supervisor_pid=os.getpid(), services=services))

    def all_up(self) -> bool:
        """Every child has logged ready (and nats-server, when supervised, runs)."""
        children = [child.state.state for child in self.children.values()]
        return all(state == st.UP for state in children) and self.nats_state.state == st.UP

    def _on_ready(self, child: Child) -> None:
        """A child logged its ready line: it serves (on the address it announced, if any)."""
        child.bind_failures = 0
        if child.announce is not None:
            found = read_announcement(child.announce)
            if found is not None:
                with self._state_lock:
                    child.state.address = found.url
                if child.chosen_port and child.port_var is not None:  # a restart binds it again
                    child.env[child.port_var] = found.url.rsplit(":", 1)[1]
        self._set_state(child, st.UP)

    def fail(self, name: str, message: str) -> None:
        """Give up on the stack: record why, and stop (`up` exits non-zero with `message`)."""
        self.failure = message
        self.say(name, f"giving up: {message}")
        self.stopping.set()

    def say(self, name: str, line: str) -> None:
        if self.on_line is not None:
            self.on_line(name, line)
        if not self.echo:
            return
        with self._print_lock:
            sys.stdout.write(_prefix(name) + line + "\n")
            sys.stdout.flush()

    def start(self, child: Child) -> None:
        if child.liveness is not None:
            child.liveness.unlink(missing_ok=True)  # checked once the new process has touched it
        if child.announce is not None:
            child.announce.unlink(missing_ok=True)  # the address of a process that is gone
        child.process = launcher.start("tinkerd.cli", ["serve", service_of(child.name)], child.env)
        child.started_at = time.monotonic()
        self._set_state(child, st.STARTING, child.state.detail)
        child.log_thread = threading.Thread(target=self._pump, args=(child, child.process), daemon=True)
        child.log_thread.start()

    def _pump(self, child: Child, process: Process) -> None:
        assert process.stdout is not None
        marker = READY_MARKERS[service_of(child.name)]
        for raw in process.stdout:
            line = raw.decode(errors="replace").rstrip()
            child.tail.append(line)
            if marker in line and child.process is process:
                self._on_ready(child)
            self.say(child.name, line)
        process.wait()
        self.exits.put((child.name, process))

    def run(self) -> None:
        if self.nats is not None:
            self.nats.watch(self.exits)
        self._write_state()
        for child in self.children.values():
            self.start(child)
        while not self.stopping.is_set():
            try:
                name, ended = self.exits.get(timeout=0.5)
            except queue.Empty:
                self._check_liveness()
                continue
            if self.stopping.is_set():
                break
            if name == NATS:
                self._restart_nats()
                continue
            child = self.children[name]
            assert child.process is not None
            code = child.process.poll()
            if ended is not child.process or code is None:
                continue  # a release of a child that already runs again, or a stale report
            if name in self.held:
                self._set_state(child, st.STOPPED, f"exited with code {code}; held down")
                self.say(name, f"exited with code {code}; held down until released")
                continue
            delay = self._after_exit(child, code)
            if delay is None or self.stopping.wait(delay):
                break
            self.start(child)

    def _after_exit(self, child: Child, code: int) -> float | None:
        """Record how `child` ended; the delay before it starts again (None: the stack stops)."""
        name = child.name
        if code == BIND_FAILED_EXIT and child.port_var is not None:
            detail = child.last_line(BIND_FAILED_PREFIX) or f"exited with code {code}: could not bind its address"
            if child.chosen_port and child.env[child.port_var] != "0":
                child.env[child.port_var] = "0"  # taken while it was down: the kernel picks another
                self._set_state(child, st.RESTARTING, detail)
                self.say(name, f"{detail}; restarting it on another port")
                return 0.0
            child.bind_failures += 1
            if child.bind_failures >= MAX_BIND_FAILURES:
                self._set_state(child, st.FAILED, detail)
                self.fail(name, f"{name}: {detail} (tried {child.bind_failures} times)")
                return None
        else:
            last = child.last_line()
            detail = f"exited with code {code}" + (f": {last}" if last else "")
        delay = self._backoff(child)
        self._set_state(child, st.RESTARTING, detail)
        self.say(name, f"exited with code {code}; restarting in {delay:.1f}s")
        return delay

    def hold(self, name: str) -> None:
        """Keep `name` down the next time it exits (an operator stopping one service for a while)."""
        self.held.add(name)

    def release(self, name: str) -> None:
        """Start a held service again (through the restart path, with its backoff)."""
        if name in self.held:
            self.held.discard(name)
            self.exits.put((name, self.children[name].process))

    @staticmethod
    def _backoff(child: Child | SupervisedNats) -> float:
        """0.5 s doubling to 10 s; back to 0.5 s once a run lasted 30 s."""
        stable = time.monotonic() - child.started_at > 30
        child.restarts = 0 if stable else child.restarts + 1
        return min(10.0, 0.5 * (2 ** min(child.restarts, 5)))

    def _restart_nats(self) -> None:
        """nats-server exited: start it again on the same port and store (clients reconnect).

        Its port is in every service's configuration, so it is not changed: a port taken
        meanwhile is tried `MAX_BIND_FAILURES` times, then the stack stops, naming the holder."""
        assert self.nats is not None and self.nats.server is not None
        code = self.nats.server.process.returncode
        delay = self._backoff(self.nats)
        self._set_state(None, st.RESTARTING, f"nats-server exited with code {code}")
        self.say(NATS, f"nats-server exited with code {code}; restarting in {delay:.1f}s on the same port and store")
        while not self.stopping.wait(delay):
            try:
                server = self.nats.start()
            except BindError as exc:
                self.nats.bind_failures += 1
                self._set_state(None, st.RESTARTING, str(exc))
                if self.nats.bind_failures >= MAX_BIND_FAILURES:
                    self._set_state(None, st.FAILED, str(exc))
                    self.fail(NATS, f"nats-server: {exc} (tried {self.nats.bind_failures} times)")
                    return
                delay = self._backoff(self.nats)
                self.say(NATS, f"nats-server did not start ({exc}); retrying in {delay:.1f}s")
                continue
            except RuntimeError as exc:
                delay = self._backoff(self.nats)
                self._set_state(None, st.RESTARTING, str(exc).splitlines()[0])
                self.say(NATS, f"nats-server did not start ({str(exc).splitlines()[0]}); retrying in {delay:.1f}s")
                continue
            self.nats.bind_failures = 0
            self._set_state(None, st.UP)
            self.say(NATS, f"nats-server ready on {server.url} (restart {self.nats.restarts})")
            self.nats.watch(self.exits)
            return

    def _check_liveness(self) -> None:
        """Kill a service whose event loop stopped touching its liveness file (it is restarted)."""
        now = time.time()
        for child in self.children.values():
            if child.liveness is None or child.process is None or child.process.poll() is not None:
                continue
            try:
                age = now - child.liveness.stat().st_mtime
            except FileNotFoundError:
                continue  # still starting (imports, model load): no file yet
            if age > self.liveness_timeout_s:
                self.say(child.name, f"no sign of life for {age:.0f}s (hung?); killing it to restart it")
                child.liveness.unlink(missing_ok=True)
                _signal_group(child.process, signal.SIGKILL)

    def stop(self, timeout_s: float = 15.0) -> None:
        self.stopping.set()
        for child in self.children.values():
            if child.process is not None and child.process.poll() is None:
                _signal_group(child.process, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in self.children.values():
            if child.process is None:
                continue
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(child.name, "did not stop in time; killing")
            _signal_group(child.process, signal.SIGKILL)  # also reaps anything it left behind
            child.process.wait()
        if self.state_file is not None:
            self.state_file.unlink(missing_ok=True)  # no stack runs any more


def _signal_group(process: Process, sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_ready(supervisor: Supervisor, healthz: str | None, stop: threading.Event) -> bool:
    """Wait until every child is up and, with a gateway, its healthz answers 200."""
    while not stop.is_set():
        if supervisor.all_up():
            if healthz is None:
                return True
            try:
                with urllib.request.urlopen(healthz, timeout=5) as response:
                    if response.status == 200:
                        return True
            except OSError:
                pass
        stop.wait(0.5)  # polling an HTTP endpoint and the children's states, for a console line
    return False


def up(
    data_dir: Path,
    host: str,
    port: int,
    base_model: str,
    nats_url: str | None,
    services: tuple[str, ...] = SERVICES,
    extra_env: dict[str, str] | None = None,
    gateways: int = 1,
) -> int:
    """Run the stack in the foreground until Ctrl-C. Returns the exit code.

    `gateways` > 1 runs that many gateway replicas on ports `port`, `port + 1`, ... (put a load
    balancer in front: any replica answers any request)."""
    from libs.models.registry import resolve_base_model

    data_dir.mkdir(parents=True, exist_ok=True)
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(extra_env or {})}
    launcher.prepare(base_env)  # the fork server imports while the model and nats-server get ready
    model = resolve_base_model(base_model, data_dir)  # builds the embedded tiny model if missing
    nats: SupervisedNats | None = None
    if nats_url is None:
        nats = SupervisedNats(layout.nats_store_dir(data_dir), log_sink=layout.nats_log_file(data_dir))
        server = nats.start()
        nats_url = server.url
        layout.nats_url_file(data_dir).write_text(nats_url)  # for `tinkerd status` / `tinkerd events`
        print(
            f"{_prefix('nats')}nats-server {server.url} (monitor {server.monitor_url}, store {layout.nats_store_dir(data_dir)})"
        )
    run_dir = layout.run_dir(data_dir)
    env = {
        **base_env,
        "TINKERD_NATS_URL": nats_url,
        "TINKERD_DATA_DIR": str(data_dir),
        "TINKERD_BASE_MODEL": base_model,
        "TINKERD_SAMPLER_MODEL_PATH": str(model.path),
        "TINKERD_GATEWAY_HOST": host,
        "TINKERD_GATEWAY_PORT": str(port),
        "TINKERD_SAMPLER_PORT": "0",  # the sampler binds a port of the kernel's choice and announces it
        "TINKERD_SAMPLER_URL": f"{ANNOUNCED}{layout.announce_file(run_dir, 'sampler')}",
        **(extra_env or {}),
    }
    extra = sorted({base for _, base in trainer_groups(env) if base and base != base_model})
    if extra and "TINKERD_GATEWAY_EXTRA_BASE_MODELS" not in env:
        env["TINKERD_GATEWAY_EXTRA_BASE_MODELS"] = ",".join(extra)  # the gateway serves every group's base
    services, child_env = with_gateway_replicas(services, gateways, port)
    supervisor = Supervisor(env, services, nats=nats, run_dir=run_dir, child_env=child_env)

    def on_signal(signum: int, _frame: object) -> None:
        supervisor.stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    base_url = f"http://{host}:{port}"

    healthz = f"{base_url}/api/v1/healthz" if "gateway" in services else None

    def announce() -> None:
        if wait_ready(supervisor, healthz, supervisor.stopping):
            print(f"\nTinkerd is ready: {base_url}  (base model {model.name})\n", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    try:
        supervisor.run()
    finally:
        print("stopping…", flush=True)
        supervisor.stop()
        if nats is not None:
            nats.stop()
    if supervisor.failure is not None:
        print(f"tinkerd up failed: {supervisor.failure}", file=sys.stderr, flush=True)
        return 1
    return 0
