"""The preloaded fork server: `python -m tinkerd.zygote FD`, started by `tinkerd/launcher.py`.

Most of a service's start-up is importing torch, transformers and megatron-core (measured on a
2-core machine: about 8 CPU-seconds for the five services of a stack, against half a second
once those are imported). This process imports them once (`PRELOAD`: third-party packages
only, never Tinkerd's own modules) and then forks one child per request; a child has nothing
left to import but Tinkerd itself.

The protocol, over the SOCK_SEQPACKET socket `FD` (one JSON object per message):
- request: `{"module", "args", "env", "cwd"}` with one file descriptor attached, the child's
  stdout and stderr; the child then runs as `python -m MODULE ARGS` would, with exactly `env`,
  in `cwd`, in a session of its own (its pid is its process group);
- reply, in request order: `{"pid": N}`;
- later, once per child: `{"ended": N, "code": C}`, C as `subprocess.Popen.returncode` gives it
  (negative: killed by that signal).
The server exits when its socket closes (the launcher's process is gone). Its children do not
depend on it to run, only to have their exit reported.

Everything read from the environment while importing (`HF_HUB_OFFLINE`, `OMP_NUM_THREADS`,
`PYTHONHASHSEED`, ...) is fixed when this process starts, so the launcher runs one server per
environment, Tinkerd's own `TINKERD_*` variables aside (`launcher.preload_key`).

Children share what the server drew before forking, except what resets itself at a fork: Python's
`random` reseeds in every child, and no service draws from a global generator it has not seeded
(sampling and adapter initialisation use their own seeded `torch.Generator`s).

Hand-written, not `multiprocessing`'s forkserver: that one re-imports the parent's main module in
every child, and any thread that starts a process may read another child's exit code (it polls
every child on each start), where the supervisor needs each exit exactly once.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import warnings
from typing import Any

PRELOAD = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.qwen3.modeling_qwen3",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.packed_seq_params",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.transformer_config",
    "megatron.core.fusions.fused_bias_dropout",
    "safetensors.torch",
    "tokenizers",
    "numpy",
    "msgspec",
    "nats",
    "litestar",
    "uvicorn",
    "httpx",
    "opentelemetry.sdk.trace",
)
"""What services import at start-up and that costs time to import; a name that is missing here is
skipped (the service that needs it reports that itself)."""

MAX_MESSAGE = 1 << 20


def _preload() -> None:
    with warnings.catch_warnings():
        # Import-time notes of the libraries (megatron-core: "Transformer Engine and Apex are not
        # installed", expected without a GPU) would print here, attributed to no service; forked
        # services do not repeat them (their imports are done), executed ones still print them.
        warnings.simplefilter("ignore")
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except ImportError:
                pass


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"ended": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(sock: socket.socket) -> tuple[dict[str, Any], int] | None:
    """Fork a child per request until the socket closes (None). Returns only in a child: its
    request and its output descriptor."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)  # SIGCHLD wakes the select below
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's to handle
    while True:
        ready, _, _ = select.select([sock.fileno(), wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)  # what is left makes the next select return at once: harmless
            _reap(sock)
        if sock.fileno() not in ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
        if not data:
            return None
        request = json.loads(data)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.close(wake_r)
            os.close(wake_w)
            sock.close()
            return request, fds[0]
        os.close(fds[0])
        _send(sock, {"pid": pid})


def become(request: dict[str, Any], out: int) -> None:
    """Turn this freshly forked process into `python -m MODULE ARGS` (never returns)."""
    from setproctitle import setproctitle

    # as `ps` shows an executed one; first, while the environment still lies where the title's room is
    setproctitle(" ".join([sys.executable, "-m", request["module"], *request["args"]]))
    os.setsid()
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # a pipe: a line at a time, as the supervisor reads
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.argv = [request["module"], *request["args"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    _preload()
    child = serve(sock)
    if child is not None:
        become(*child)


if __name__ == "__main__":
    main()
