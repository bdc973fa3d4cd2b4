"""The directory transaction: a writer killed at any point leaves the old or the new version whole."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import pytest

from libs.checkpoints import layout

WRITER = """
import sys
from pathlib import Path
from libs.checkpoints import layout
data, version, payload = Path(sys.argv[1]), sys.argv[2], sys.argv[3].encode()
target = layout.versions_dir(data, "s-1:train:0", "training") / f"ckpt@{version}"
layout.write_dir_atomically(target, {"adapter.safetensors": payload * 1000, "state.json": b'{"v": "' + version.encode() + b'"}'})
layout.switch_link(layout.public_path(data, "s-1:train:0", "training", "ckpt"), target)
"""


def write(data: Path, version: str, payload: str, fault: str | None = None) -> int:
    env = {**os.environ, "TINKERD_FAULT_MARKER": str(data / f"fired-{version}")}
    if fault:
        env["TINKERD_FAULT_POINT"] = fault
    return subprocess.run([sys.executable, "-c", WRITER, str(data), version, payload], env=env).returncode


def read_public(data: Path) -> bytes:
    resolved = layout.resolve(layout.public_path(data, "s-1:train:0", "training", "ckpt"))
    assert resolved is not None
    return (resolved / "state.json").read_bytes() + (resolved / "adapter.safetensors").read_bytes()[:1]


def test_a_complete_write_switches_the_name(tmp_path: Path) -> None:
    assert write(tmp_path, "v1", "a") == 0
    assert write(tmp_path, "v2", "b") == 0
    assert read_public(tmp_path) == b'{"v": "v2"}b'


@pytest.mark.parametrize("fault", ["write.before_rename", "link.before_replace"])
def test_a_writer_killed_mid_way_leaves_the_old_version_whole(tmp_path: Path, fault: str) -> None:
    assert write(tmp_path, "v1", "a") == 0
    code = write(tmp_path, "v2", "b", fault)
    assert code == -9  # killed like kill -9
    assert read_public(tmp_path) == b'{"v": "v1"}a'  # the old complete checkpoint is reachable
    layout.clean_temporaries(tmp_path / "checkpoints")
    assert not list((tmp_path / "checkpoints").rglob(".tmp-*")) and not list((tmp_path / "checkpoints").rglob(".link-*"))
    assert write(tmp_path, "v3", "c") == 0  # and the next save succeeds
    assert read_public(tmp_path) == b'{"v": "v3"}c'


def test_versions_are_immutable(tmp_path: Path) -> None:
    target = tmp_path / "v"
    layout.write_dir_atomically(target, {"f": b"first"})
    layout.write_dir_atomically(target, {"f": b"second"})
    assert (target / "f").read_bytes() == b"first"


def test_link_from_places_the_staged_files_without_a_second_copy(tmp_path: Path) -> None:
    """`link_from` puts every staged file into the version as the same file on disk (one inode,
    so no second write), readable by other users, and the version stays whole once the staging
    directory is removed."""
    staging = layout.write_dir_atomically(tmp_path / "staging" / "u-1", {"adapter.safetensors": b"w" * 4096, "c.json": b"{}"})
    target = layout.write_dir_atomically(tmp_path / "versions" / "ckpt@1", link_from=staging)
    for name in ("adapter.safetensors", "c.json"):
        assert os.stat(target / name).st_ino == os.stat(staging / name).st_ino, name
        assert (target / name).stat().st_mode & 0o777 == 0o644, name
    shutil.rmtree(staging)
    assert sorted(p.name for p in target.iterdir()) == ["adapter.safetensors", "c.json"]
    assert (target / "adapter.safetensors").read_bytes() == b"w" * 4096


class _FullDisk:
    """A file whose write fails half way, as on a full disk."""

    def __len__(self) -> int:
        return 8

    def write_to(self, handle: BinaryIO, midway: Callable[[], None] = lambda: None) -> None:
        handle.write(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_version_of_several_files_is_written_whole_and_readable_and_one_failing_write_leaves_nothing(tmp_path: Path) -> None:
    files = {f"f{i}": bytes([i]) * (1000 + i) for i in range(4)}
    target = layout.write_dir_atomically(tmp_path / "ok", files)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == files
    assert all((target / name).stat().st_mode & 0o777 == 0o644 for name in files)

    with pytest.raises(OSError) as failed:
        layout.write_dir_atomically(tmp_path / "full", {**files, "g": _FullDisk()})
    assert failed.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]  # no version, no temporary left
