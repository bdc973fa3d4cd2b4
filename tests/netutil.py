"""Test-only network helpers: a port that was free a moment ago, and a port churner.

`unused_port` is for tests that need a number before anything binds it (the rendezvous port
of ranks a test spawns itself, a URL where nothing listens, a cluster's configured route
ports); Tinkerd's own processes never use one (they bind port 0: infra/net.py).
"""

from __future__ import annotations

import socket
import subprocess
import sys


def unused_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (another process may take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


CHURN = """
import socket, sys, time
for _ in range(int(sys.argv[1])):
    time.sleep(0.001)  # pacing: leave the machine's cores to the stack under test
    listeners = []
    for _ in range(64):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        listeners.append(s)
    for s in listeners:
        s.close()
"""


def churn_ports(rounds: int) -> subprocess.Popen[bytes]:
    """Start a process that opens and closes short-lived listeners on 127.0.0.1 (ports of the
    kernel's choice), 64 at a time, `rounds` times (about a millisecond apart): what a busy
    machine does to ephemeral ports. The caller kills it when done."""
    return subprocess.Popen([sys.executable, "-c", CHURN, str(rounds)])
