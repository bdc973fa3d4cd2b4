"""Every path under the data root, and the atomic file and directory writes.

    DATA/checkpoints/<run>/<segment>/<name>           -> a relative symlink to a version
    DATA/checkpoints/<run>/<segment>/.versions/<name>@<version>/   immutable contents
    DATA/samplers/<sampler>/<version>/                 an ephemeral sampler export
    DATA/staging/<unit>-<request>/                     a save's files, before the publisher takes them
    DATA/trainer/<group>/paged/<model>.safetensors     a group's page store (paged-out models)
    DATA/trainer/<group>/snapshots/<work_seq>/         a group's internal snapshots
    DATA/trainer/exports/<model>/<unit>.safetensors    a page-out's export (another group may page it in)
    DATA/trainer/adopted/<model>/<unit>.safetensors    a takeover's rebuilt state
    DATA/traces/<session>-<digest>.pftrace             a session's exported trace (a signed download)
    DATA/models/<name>/                                named base models (the embedded tiny ones are built here)
    DATA/run/                                          `tinkerd up`: stack.json, <child>.addr, <child>.alive
    DATA/nats/, DATA/nats.log, DATA/nats.url           `tinkerd up`: the embedded nats-server's store, log and URL

Ids in names go through `ids.token` (`:` becomes `=`) and the segment is `ids.SEGMENT_OF_KIND`'s.
Nothing else builds these paths (`tests/infra/test_vocabulary.py` checks it).

A version directory is written under a temporary name, every file and the directory are fsynced,
then it is renamed into place; only then is the public name switched, by renaming a fresh symlink
over the old one. A crash at any moment leaves the old or the new complete version reachable, and
older versions stay on disk for readers that already resolved them.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, Protocol

from libs.contracts.ids import SEGMENT_OF_KIND, token
from libs.faults import crash_point, service_point


class StreamedFile(Protocol):
    """A file's contents produced while it is written (``tensor_file.TensorFile``)."""

    def __len__(self) -> int: ...

    def write_to(self, handle: BinaryIO, midway: Callable[[], None]) -> None: ...


FileData = bytes | StreamedFile


def checkpoints_root(data_dir: Path) -> Path:
    """Every named checkpoint of every run (the publisher cleans its leftovers on start)."""
    return data_dir / "checkpoints"


def public_path(data_dir: Path, run_id: str, kind: str, name: str) -> Path:
    return checkpoints_root(data_dir) / token(run_id) / SEGMENT_OF_KIND[kind] / name


def versions_dir(data_dir: Path, run_id: str, kind: str) -> Path:
    return checkpoints_root(data_dir) / token(run_id) / SEGMENT_OF_KIND[kind] / ".versions"


def version_dir(data_dir: Path, run_id: str, kind: str, name: str, version: str) -> Path:
    """One immutable version of a named checkpoint (`version`: the save's, or `copy` for copy_weights)."""
    return versions_dir(data_dir, run_id, kind) / f"{name}@{version}"


def samplers_root(data_dir: Path) -> Path:
    """Every ephemeral sampler export (the publisher cleans its leftovers on start)."""
    return data_dir / "samplers"


def ephemeral_dir(data_dir: Path, sampler_id: str, version: str) -> Path:
    return samplers_root(data_dir) / token(sampler_id) / version


def staging_dir(data_dir: Path, unit_id: str, request_id: str) -> Path:
    return data_dir / "staging" / f"{unit_id}-{token(request_id)}"


def page_store_dir(data_dir: Path, group: str) -> Path:
    return data_dir / "trainer" / group / "paged"


def paged_file(page_store: Path, model_id: str) -> Path:
    """A paged-out model's file in a group's page store (`page_store_dir`)."""
    return page_store / f"{token(model_id)}.safetensors"


def trainer_snapshots_dir(data_dir: Path, group: str) -> Path:
    return data_dir / "trainer" / group / "snapshots"


def trainer_snapshot_dir(data_dir: Path, group: str, work_seq: int) -> Path:
    """The internal snapshot of a group taken after work-stream sequence `work_seq`."""
    return trainer_snapshots_dir(data_dir, group) / f"{work_seq:012d}"


def snapshot_paged_name(model_id: str) -> str:
    """The name, within one internal snapshot, of a paged-out model's state."""
    return f"paged-{token(model_id)}.safetensors"


def export_file(model_id: str, unit_id: str) -> str:
    """Where a page-out exports a model's state, relative to the data root (it travels in the
    unit): one file per page-out, so a later page-in on another group, and its replay, read
    exactly that one."""
    return f"trainer/exports/{token(model_id)}/{unit_id}.safetensors"


def adopted_file(data_dir: Path, model_id: str, unit_id: str) -> Path:
    """The state a takeover unit rebuilt for `model_id`, written before its outcome."""
    return data_dir / "trainer" / "adopted" / token(model_id) / f"{unit_id}.safetensors"


def trace_file(session_id: str, digest: str) -> str:
    """A session's exported trace, relative to the data root (a signed download URL names it)."""
    return f"traces/{token(session_id)}-{digest}.pftrace"


def models_root(data_dir: Path | str) -> Path:
    """Directory that holds named base models (one directory each, by short name)."""
    return Path(data_dir) / "models"


def run_dir(data_dir: Path) -> Path:
    """Where `tinkerd up` keeps liveness files, address announcements and the stack state."""
    return data_dir / "run"


def announce_file(run: Path, child: str) -> Path:
    """The file where child `child` of `tinkerd up` announces the address it bound (in `run_dir`)."""
    return run / f"{child}.addr"


def liveness_file(run: Path, child: str) -> Path:
    """The file child `child` of `tinkerd up` touches while it is alive (in `run_dir`)."""
    return run / f"{child}.alive"


def stack_state_file(run: Path) -> Path:
    """The supervisor's view of its stack (`infra/stack_state.py`), in `run_dir`."""
    return run / "stack.json"


def nats_store_dir(data_dir: Path) -> Path:
    """The JetStream store of the nats-server `tinkerd up` starts."""
    return data_dir / "nats"


def nats_log_file(data_dir: Path) -> Path:
    """That nats-server's log."""
    return data_dir / "nats.log"


def nats_url_file(data_dir: Path) -> Path:
    """That nats-server's client URL, for `tinkerd status` and `tinkerd events`."""
    return data_dir / "nats.url"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_dir_atomically(
    final: Path,
    files: Mapping[str, FileData] | None = None,
    copy_from: Path | None = None,
    links: dict[str, Path] | None = None,
    link_from: Path | None = None,
) -> Path:
    """Create `final` with the given contents, all or nothing. Returns `final`.

    `links` are existing files to include under a new name: hard-linked (no copy) where the
    file system allows, copied otherwise. `link_from` is a directory whose files are all
    included that way (the publisher's hand-off: the trainer's staged files, already fsynced,
    become the version's files without a second write; the staging names are removed after).
    Linked files must never be written again under either name. If `final` already exists
    (a retried write), it is kept as it is: versions are immutable.
    """
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if copy_from is not None:
            for src in sorted(copy_from.iterdir()):
                if src.is_file():
                    _copy_file(src, tmp / src.name)
        _write_files(tmp, files or {})
        for name, src in (links or {}).items():
            _link_or_copy(src, tmp / name)
        for src in sorted(link_from.iterdir()) if link_from is not None else []:
            if src.is_file():
                service_point("checkpoint_write")  # fault tests: kill -9 or ENOSPC mid-way through the files
                _link_or_copy(src, tmp / src.name)
        for child in tmp.iterdir():
            if files is None or child.name not in files:  # the written ones are synced already
                child.chmod(0o644)
                with open(child, "rb") as handle:
                    os.fsync(handle.fileno())
        fsync_dir(tmp)
        crash_point("write.before_rename")
        try:
            os.rename(tmp, final)
        except OSError:
            if final.exists():  # another writer won the race with the same immutable content
                shutil.rmtree(tmp, ignore_errors=True)
                return final
            raise
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def write_file_atomically(path: Path, data: FileData, sync: bool = True) -> Path:
    """Write one file whole or not at all: under a temporary name in the same directory, then
    renamed over ``path``. With ``sync`` the file and its directory are fsynced before the
    function returns (the file must survive a crash); a cache file that nothing needs after a
    crash passes ``sync=False``. Returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        _write_file(tmp, data, sync=sync)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync:
        fsync_dir(path.parent)
    return path


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or one without hard links
        _copy_file(src, dst)


def _write_files(directory: Path, files: Mapping[str, FileData]) -> None:
    """Write and fsync every file of ``files`` into ``directory``, each on its own thread: a
    disk writes and flushes several files faster than one after another (a training state's
    adapter and optimizer files). The first error is raised once every write has ended."""
    if len(files) <= 1:
        for name, data in files.items():
            _write_file(directory / name, data, sync=True)
        return
    with ThreadPoolExecutor(max_workers=len(files), thread_name_prefix="file-write") as pool:
        writes = [pool.submit(_write_file, directory / name, data, True) for name, data in files.items()]
    for write in writes:
        write.result()


def _write_file(path: Path, data: FileData, sync: bool = False) -> None:
    """Write `data` (fsynced with ``sync``, readable by every user: sampling engines may run as
    another one); the fault point sits mid-file, where a full disk or a crash would strike."""
    with open(path, "wb") as handle:
        os.fchmod(handle.fileno(), 0o644)
        if not isinstance(data, bytes):
            data.write_to(handle, lambda: service_point("checkpoint_write"))
        else:
            half = len(data) // 2
            handle.write(data[:half])
            service_point("checkpoint_write")  # fault tests: kill -9 or ENOSPC with half a file written
            handle.write(data[half:])
        if sync:
            handle.flush()
            os.fsync(handle.fileno())


def _copy_file(src: Path, dst: Path, chunk: int = 1 << 22) -> None:
    """A streaming copy with the same mid-file fault point as `_write_file`."""
    with open(src, "rb") as source, open(dst, "wb") as target:
        left = src.stat().st_size // 2
        while left > 0 and (block := source.read(min(chunk, left))):
            target.write(block)
            left -= len(block)
        service_point("checkpoint_write")
        shutil.copyfileobj(source, target, chunk)


def switch_link(public: Path, target: Path) -> None:
    """Atomically point `public` at `target` (a relative symlink, swapped by rename)."""
    public.parent.mkdir(parents=True, exist_ok=True)
    link = public.parent / f".link-{public.name}-{uuid.uuid4().hex[:8]}"
    os.symlink(os.path.relpath(target, public.parent), link)
    crash_point("link.before_replace")
    os.replace(link, public)
    fsync_dir(public.parent)


def resolve(public: Path) -> Path | None:
    """The version directory a public name points at, or None."""
    if not public.is_symlink() and not public.is_dir():
        return None
    target = public.resolve()
    return target if target.is_dir() else None


def clean_temporaries(root: Path) -> int:
    """Remove `.tmp-*` / `.link-*` leftovers of writers that died mid-way (never reachable by a name)."""
    removed = 0
    if not root.exists():
        return 0
    for tmp in root.rglob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
        removed += 1
    for link in root.rglob(".link-*"):
        link.unlink(missing_ok=True)
        removed += 1
    return removed
