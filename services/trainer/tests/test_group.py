"""The TP group's mechanics (services/trainer/group.py) with real processes: gloo ranks running
a toy engine, and the launcher supervising real rank processes."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from services.trainer.group import BROKEN_EXIT_CODE
from services.trainer.tests.group_worker import run_rank


def run_group(tmp_path: Path, last: str) -> tuple[list[int | None], dict[str, object]]:
    ctx = multiprocessing.get_context("spawn")
    out, store = tmp_path / "seen.json", str(tmp_path / "store")
    ranks = [ctx.Process(target=run_rank, args=(rank, 2, store, str(out), last)) for rank in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(120)
    return [p.exitcode for p in ranks], json.loads(out.read_text()) if out.exists() else {}


def test_calls_reach_every_rank_and_an_error_of_every_rank_is_the_callers(tmp_path: Path) -> None:
    """Rank 0's calls run on both ranks (the all-reduced sums count both), a call the engine makes
    to itself is not broadcast twice, an exception raised on every rank reaches rank 0's caller and
    the group goes on, and rank 0's close lets the follower exit 0."""
    codes, seen = run_group(tmp_path, last="")
    assert codes == [0, 0]
    assert seen == {"total": 4.0, "twice": 4.0, "reject": "bad x 3.0", "after_reject": 2.0}


def test_a_rank_dying_inside_a_call_ends_rank_0_before_the_call_returns(tmp_path: Path) -> None:
    """The follower dies inside a call: rank 0's collective fails and rank 0 exits with
    BROKEN_EXIT_CODE instead of returning (or raising) anything its caller could publish."""
    codes, seen = run_group(tmp_path, last="die_on_follower")
    assert codes == [BROKEN_EXIT_CODE, 9]
    assert "die_on_follower" not in seen and seen["after_reject"] == 2.0


def test_ranks_that_disagree_about_a_call_both_exit(tmp_path: Path) -> None:
    """A call that fails on the follower only (their states may now differ): both ranks exit with
    BROKEN_EXIT_CODE, and rank 0 returns nothing."""
    codes, seen = run_group(tmp_path, last="fail_on_follower")
    assert codes == [BROKEN_EXIT_CODE, BROKEN_EXIT_CODE]
    assert "fail_on_follower" not in seen


def test_an_idle_group_lives_on_and_a_frozen_rank_ends_it_after_the_timeout(tmp_path: Path) -> None:
    """With a 5 s group timeout: rank 0 idle for 12.5 s keeps the follower waiting (its pings),
    the next call succeeds; then the follower freezes inside a call for 15 s, and rank 0 exits with
    BROKEN_EXIT_CODE (its collective timed out) without returning; the follower, when it wakes
    to a gone rank 0, exits the same way."""
    codes, seen = run_group(tmp_path, last="freeze_on_follower")
    assert seen["after_idle"] == 2.0 and "freeze_on_follower" not in seen
    assert codes == [BROKEN_EXIT_CODE, BROKEN_EXIT_CODE]


LAUNCHER = textwrap.dedent(
    """
    import logging, sys
    from services.trainer.group import launch
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    sys.exit(launch(2, argv=[sys.executable, "-c", sys.argv[1]]))
    """
)


def start_launcher(rank_script: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, textwrap.dedent(rank_script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_one_rank_exiting_takes_the_others_down_and_the_launcher_exits_with_its_code() -> None:
    """Rank 1 exits with code 3 while rank 0 would wait forever: the launcher kills rank 0,
    reaps it, and exits with 3 (the supervisor then restarts the whole group)."""
    launcher = start_launcher(
        """
        import os, signal, sys
        if os.environ["RANK"] == "1":
            sys.exit(3)
        signal.pause()
        """
    )
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 3, err
    pids = [int(p) for p in re.search(r"started trainer group of 2 ranks \(pids \[(\d+), (\d+)\]", err).groups()]  # type: ignore[union-attr]
    assert f"rank 1 (pid {pids[1]}) exited with code 3: taking the trainer group down" in err
    assert not Path(f"/proc/{pids[0]}").exists()  # killed and reaped before the launcher exited


def test_killing_the_launcher_kills_every_rank() -> None:
    """kill -9 of the launcher: each rank (which asked for PR_SET_PDEATHSIG) is killed by the
    kernel, so no rank outlives its group."""
    launcher = start_launcher(
        """
        import os, signal
        from services.trainer import group
        group.die_with_parent()
        os.write(1, f"ready {os.getpid()}\\n".encode())  # one write: the two ranks share the pipe
        signal.pause()
        """
    )
    assert launcher.stdout is not None
    lines = [launcher.stdout.readline() for _ in range(2)]
    assert all(line.startswith("ready ") for line in lines), lines
    pids = [int(line.split()[1]) for line in lines]
    fds = [os.pidfd_open(pid) for pid in pids]
    try:
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        for fd in fds:  # a pidfd turns readable when its process has exited
            readable, _, _ = select.select([fd], [], [], 60)
            assert readable == [fd]
    finally:
        for fd in fds:
            os.close(fd)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
