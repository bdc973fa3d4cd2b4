"""tinkerd/launcher.py: a service started by fork from the preloaded server, or executed afresh,
runs as `python -m MODULE ARGS` would, with exactly its environment, in a session of its own, its
output on one pipe and its exit reported once; a fork server that dies takes its children with it
(reported as killed, so a supervisor restarts them and none runs twice), and the next start brings
up a new server. Real processes throughout; the fork server imports torch, so the first start in a
test process takes a few seconds."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.harness import inherited_env
from tinkerd import launcher

CHILD = "tests.infra.launched_child"


def _env(**extra: str) -> dict[str, str]:
    return {**inherited_env(), **extra}


def _first_line(process: launcher.Process) -> dict[str, Any]:
    assert process.stdout is not None
    return json.loads(process.stdout.readline())


def _gone(pid: int) -> bool:
    """Ended: no such process, or a zombie nobody has reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("mode", launcher.MODES)
def test_a_started_process_has_exactly_its_environment_its_own_session_and_its_exit_code(mode: str) -> None:
    first = launcher.start(CHILD, ["3", "x y"], _env(TINKERD_LAUNCH=mode, TINKERD_ONLY_FIRST="1"))
    seen = _first_line(first)
    assert first.wait() == 3 and first.poll() == 3
    second = launcher.start(CHILD, ["0"], _env(TINKERD_LAUNCH=mode))
    again = _first_line(second)
    assert second.wait() == 0

    assert seen["argv"] == ["3", "x y"] and seen["cwd"] == os.getcwd()
    assert seen["pid"] == first.pid and seen["sid"] == first.pid  # its own session: its pid is its group
    assert seen["env"]["TINKERD_ONLY_FIRST"] == "1" and "TINKERD_ONLY_FIRST" not in again["env"]
    assert again["env"] == _env(TINKERD_LAUNCH=mode)


@pytest.mark.parametrize("mode", launcher.MODES)
def test_a_running_process_shows_its_command_and_killed_by_a_signal_reports_minus_that_signal(mode: str) -> None:
    process = launcher.start(CHILD, ["wait"], _env(TINKERD_LAUNCH=mode))
    try:
        _first_line(process)
        assert process.poll() is None
        shown = Path(f"/proc/{process.pid}/cmdline").read_text().replace("\0", " ")
        assert f"-m {CHILD} wait" in shown  # what `ps` shows, forked or executed
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # never left behind, whatever failed above
    assert process.wait() == -signal.SIGKILL


def test_when_the_fork_server_dies_its_children_are_killed_and_the_next_start_brings_up_another() -> None:
    env = _env(TINKERD_LAUNCH="fork")
    running = launcher.start(CHILD, ["wait"], env)
    _first_line(running)
    server = launcher.fork_server(env)
    server.process.kill()

    assert running.wait() == -signal.SIGKILL
    assert _gone(running.pid)
    after = launcher.start(CHILD, ["0"], env)
    assert _first_line(after)["pid"] == after.pid and after.wait() == 0
    assert launcher.fork_server(env) is not server


def test_an_unknown_launch_mode_is_refused_naming_the_variable() -> None:
    with pytest.raises(ValueError, match="TINKERD_LAUNCH"):
        launcher.start(CHILD, ["0"], _env(TINKERD_LAUNCH="spawn"))
