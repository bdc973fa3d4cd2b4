"""The publisher: materializes checkpoints (training states and sampler exports) and registers them.

For each PublishCommand (from a trainer, once its staged files are fsynced): place the staging directory's files into an immutable
version directory (atomic: hard links in a temporary directory, fsync, rename; the trainer wrote
and fsynced the staged files, so the adapter is written to disk once), switch the public name to it (atomic symlink swap),
record the checkpoint in the catalogue (or the ephemeral sampler's adapter), answer the request's
future and emit CheckpointPublished. Every step is idempotent, and the message is acked last, so a
publisher killed at any point redoes the work on restart with the same result.

A save completes once its directory is durable, with one exception: an ephemeral sampler export
handed over from the trainer's memory (libs/contracts/publish.py) is answered by its handover
command, which records the handover on its sampler; its files' command follows and records the
directory (`adapter_dir`), after which the handover is no longer offered. A handover never
replaces a directory already recorded, whatever order the two commands arrive in.

The publisher makes no call to a sampling engine:
engines get adapters on demand from the gateway's sample path (services/gateway/sampling/engines.py), so
no state of an engine (down, restarting, replaced) can fail or delay a save.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from pathlib import Path

import nats.js.errors
from nats.aio.msg import Msg

from infra import tracing
from infra.answers import answer
from infra.bus import BUS_UNAVAILABLE, Bus, ensure_durable, fetch_loop, has_message, kv_scan
from infra.streams import ensure_streams, publisher_durable
from libs.checkpoints import age, layout
from libs.contracts import codec, ids
from libs.contracts import subjects as s
from libs.contracts.common import now_ns
from libs.contracts.events import CheckpointPublished
from libs.contracts.ids import TinkerPath
from libs.contracts.publish import AdapterHandover, PublishCommand
from libs.contracts.records import CheckpointRecord, InflightTarget, SamplerRecord
from libs.contracts.results import (
    Failure,
    ResultBody,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)
from libs.faults import crash_point
from services.publisher.config import PublisherConfig

log = logging.getLogger("tinkerd.publisher")

BUS_RETRY_S = 0.5
"""How long the publisher waits before publishing again after the broker did not answer."""


def _encrypted_dir(staging: Path) -> Path:
    """Where the encrypted files of an encrypted export are built, beside its staging directory."""
    return staging.with_name(f"{staging.name}{age.SUFFIX}")


def _encrypted(staging: Path, recipients: list[str]) -> Path:
    """The staged files encrypted to `recipients` (`<name>.age`), in a fresh directory; a copy
    left by a publisher that died mid-way is built again."""
    target = _encrypted_dir(staging)
    shutil.rmtree(target, ignore_errors=True)
    return age.encrypt_dir(staging, target, recipients)


def _remove_staged(p: PublishCommand) -> None:
    """The staged files of a publication that is over, and their encrypted copies if any. A
    handover command has none of its own: its staging directory is its files' command's, which
    may be being written now."""
    if p.handover is not None:
        return
    staging = Path(p.staging_dir)
    shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(_encrypted_dir(staging), ignore_errors=True)


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


class PublisherService:
    def __init__(self, bus: Bus, config: PublisherConfig) -> None:
        self.bus = bus
        self.config = config
        self.data_dir = Path(config.data_dir).expanduser().resolve()

    async def ensure_consumer(self) -> None:
        durable = publisher_durable()
        await ensure_durable(self.bus, durable.stream, durable.config)

    async def run(self, stop: asyncio.Event) -> None:
        layout.clean_temporaries(layout.checkpoints_root(self.data_dir))
        layout.clean_temporaries(layout.samplers_root(self.data_dir))
        sub = await self.bus.pull(s.PUBLISH_ALL, s.DURABLE_PUBLISHER, s.STREAM_PUBLISH)
        log.info("publisher ready (data dir %s)", self.data_dir)
        reaper = asyncio.create_task(self._reap(stop))
        try:
            await fetch_loop(sub, self._on_messages, stop, batch=8)
        finally:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper

    async def _on_messages(self, msgs: list[Msg]) -> None:
        for msg in msgs:
            publish = codec.publish_decoder.decode(msg.data)
            while True:
                try:
                    await self._handle(msg, publish)
                    break
                except BUS_UNAVAILABLE as exc:
                    if self.bus.nc.is_closed:
                        raise
                    # The broker is restarting: every step is idempotent, so this publication
                    # starts again, in place, before the next one (a name never moves back).
                    log.warning(
                        "publishing %s: the broker did not answer (%s: %s); again in %.1f s",
                        publish.request_id,
                        type(exc).__name__,
                        exc,
                        BUS_RETRY_S,
                    )
                    await asyncio.sleep(BUS_RETRY_S)

    async def _handle(self, msg: Msg, publish: PublishCommand) -> None:
        answered = await has_message(self.bus, s.STREAM_RESULTS, s.result_subject(publish.request_id))
        # an ephemeral export's files, after its handover answered the save: still to be placed
        files_after_handover = (
            publish.sampling_session_id is not None and publish.handover is None and publish.error is None
        )
        if answered and not files_after_handover:
            # Answered already: a redelivery, or a trainer that redid the save after a crash.
            # Redoing it could switch a name back to an older version: only ack it.
            _remove_staged(publish)
            await msg.ack()
            return
        if publish.error is not None:  # the trainer could not write the files: nothing to publish
            _remove_staged(publish)
            await self._answer(publish, Failure(error=publish.error, category="server"))
            await msg.ack()
            return
        started = time.perf_counter()
        try:
            with tracing.span(
                "publisher.publish", publish.traceparent, request_id=publish.request_id, kind=publish.kind
            ):
                body = await self.publish(publish)
            log.info(
                "published %s (%s) in %.0f ms, %.0f ms after the trainer wrote its files",
                publish.request_id,
                publish.kind,
                (time.perf_counter() - started) * 1e3,
                (now_ns() - publish.at_ns) / 1e6,
            )
        except BUS_UNAVAILABLE:
            raise  # not the disk: the caller publishes again once the broker is back
        except OSError as exc:  # a full disk: the writer removed its temporary directory
            log.exception("publishing %s failed", publish.request_id)
            _remove_staged(publish)  # this publication is over
            kept = f"; {publish.tinker_path} still holds its previous version" if publish.tinker_path else ""
            body = Failure(
                error=f"saving failed: the server could not write the checkpoint ({exc.strerror or exc}); "
                f"nothing was published{kept}. Free disk space on the server, then save again",
                category="server",
            )
        except Exception as exc:
            log.exception("publishing %s failed", publish.request_id)
            body = Failure(
                error=f"publishing the checkpoint failed: {type(exc).__name__}: {exc}", category="server"
            )
        if not answered:
            await self._answer(publish, body)
        crash_point("publisher.answered")  # fault tests: result appended, publication not acked
        await msg.ack()

    async def publish(self, p: PublishCommand) -> ResultBody:
        staging = Path(p.staging_dir)
        if p.tinker_path is not None:
            # the path's segment names the catalogue kind (save_weights_external arrives as a
            # sampler export to external_weights/)
            path = TinkerPath.parse(p.tinker_path)
            run, kind, name = path.run, path.kind, path.name
            version_dir = layout.version_dir(self.data_dir, run, kind, name, p.version)
            source = staging if staging.exists() else None
            if source is not None and p.age_recipients and not version_dir.exists():
                source = await asyncio.to_thread(_encrypted, staging, p.age_recipients)
            await asyncio.to_thread(layout.write_dir_atomically, version_dir, link_from=source)
            crash_point("publisher.version_written")  # fault tests: die between the two atomic steps
            await asyncio.to_thread(
                layout.switch_link, layout.public_path(self.data_dir, run, kind, name), version_dir
            )
            engine_name = ids.adapter_name(run, name, p.version)
            record = CheckpointRecord(
                tinker_path=p.tinker_path,
                training_run_id=run,
                kind=kind,
                name=name,
                tenant=p.tenant,
                base_model=p.base_model,
                lora=p.lora,
                directory=str(version_dir),
                created_ns=now_ns(),
                size_bytes=dir_size(version_dir),
                expires_ns=now_ns() + p.ttl_s * 1_000_000_000 if p.ttl_s else None,
                user_metadata=dict(p.user_metadata) if p.user_metadata else None,
                adapter_name=engine_name if kind == "sampler" else None,
            )
            kv = await self.bus.kv(s.KV_CHECKPOINTS)
            await kv.put(path.key, codec.to_json(record))
            await self._event(p, engine_name, version_dir)
            body = named_save_result(kind, p.tinker_path, record.size_bytes)
        else:
            assert p.sampling_session_id is not None
            directory: str | None = None
            if p.handover is None:
                version_dir = layout.ephemeral_dir(self.data_dir, p.sampling_session_id, p.version)
                if not staging.exists() and not version_dir.exists():  # never record an empty export
                    raise RuntimeError(f"the staged files of {p.request_id} are missing ({staging})")
                await asyncio.to_thread(
                    layout.write_dir_atomically, version_dir, link_from=staging if staging.exists() else None
                )
                directory = str(version_dir)
            engine_name = ids.adapter_name(p.sampling_session_id, "ephemeral", p.version)
            sampler = await record_export(self.bus, p.sampling_session_id, engine_name, directory, p.handover)
            if sampler.inflight_model_id and sampler.save_seq_id is not None:
                # before the save answers: its completion means the target has moved
                await advance_inflight(
                    self.bus,
                    InflightTarget(
                        model_id=sampler.inflight_model_id,
                        seq_id=sampler.save_seq_id,
                        sampler_id=p.sampling_session_id,
                        adapter_name=engine_name,
                        adapter_dir=directory,
                        handover=p.handover if directory is None else None,
                        updated_ns=now_ns(),
                    ),
                )
            if directory is not None:
                await self._event(p, engine_name, Path(directory))
            body = SaveWeightsForSamplerResponse(sampling_session_id=p.sampling_session_id)
        _remove_staged(p)
        return body

    async def _event(self, p: PublishCommand, engine_name: str, directory: Path) -> None:
        await self.bus.emit(
            CheckpointPublished(
                tinker_path=p.tinker_path or p.sampling_session_id or "",
                adapter_name=engine_name,
                directory=str(directory),
                model_id=p.model_id,
                request_id=p.request_id,
                seq_id=p.seq_id,
                tenant=p.tenant,
                at_ns=now_ns(),
            )
        )

    async def _answer(self, p: PublishCommand, body: ResultBody) -> None:
        await answer(  # a redelivered or repeated publication was answered before: no effect
            self.bus,
            kind="save_weights" if p.kind == "training" else "save_weights_for_sampler",
            body=body,
            tenant=p.tenant,
            model_id=p.model_id,
            request_id=p.request_id,
            seq_id=p.seq_id,
            traceparent=p.traceparent,
            announce="now",
        )

    async def _reap(self, stop: asyncio.Event) -> None:
        """Delete checkpoints whose ttl_seconds passed (catalogue entry, public name, versions)."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.reap_interval_s)
            with contextlib.suppress(Exception):
                await reap_expired(self.bus, self.data_dir, time.time_ns())


async def record_export(
    bus: Bus, sampler_id: str, adapter_name: str, directory: str | None, handover: AdapterHandover | None
) -> SamplerRecord:
    """Record an ephemeral export on its sampler: its directory (which ends any handover), or its
    handover while no directory is recorded; compare-and-set, so the two commands of one save
    agree in any order."""
    kv = await bus.kv(s.KV_SAMPLERS)
    key = ids.token(sampler_id)
    while True:
        entry = await kv.get(key)
        sampler = codec.from_json(entry.value or b"{}", SamplerRecord)
        if directory is not None:
            sampler.adapter_name, sampler.adapter_dir, sampler.handover = adapter_name, directory, None
        elif sampler.adapter_dir is None:
            sampler.adapter_name, sampler.handover = adapter_name, handover
        else:
            return sampler  # its files' command came first: nothing to add
        try:
            await kv.update(key, codec.to_json(sampler), last=entry.revision)
            return sampler
        except nats.js.errors.KeyWrongLastSequenceError:
            continue  # another writer got there first: look again


async def advance_inflight(bus: Bus, target: InflightTarget) -> bool:
    """Make `target` its model's inflight target unless a newer save's (a higher seq_id) is
    there already (a redelivered older publication never moves it back); compare-and-set, so
    concurrent publishers agree. True when it is the target now."""
    kv = await bus.kv(s.KV_INFLIGHT)
    key, value = ids.token(target.model_id), codec.to_json(target)
    while True:
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            entry = None
        try:
            if entry is None or entry.value is None:
                await kv.create(key, value)
                return True
            current = codec.from_json(entry.value, InflightTarget)
            if current.seq_id > target.seq_id:
                return False
            same_save = current.seq_id == target.seq_id and current.adapter_name == target.adapter_name
            if same_save and (current.adapter_dir is not None or target.adapter_dir is None):
                return True  # recorded already (a handover never replaces its files)
            await kv.update(key, value, last=entry.revision)
            return True
        except nats.js.errors.KeyWrongLastSequenceError:
            continue  # another writer got there first: look again


async def reap_expired(bus: Bus, data_dir: Path, now: int) -> int:
    kv = await bus.kv(s.KV_CHECKPOINTS)
    removed = 0
    for key, value in (await kv_scan(bus, s.KV_CHECKPOINTS)).items():
        record = codec.from_json(value, CheckpointRecord)
        if record.expires_ns is not None and record.expires_ns <= now:
            await delete_checkpoint_files(data_dir, record)
            await kv.delete(key)
            removed += 1
    return removed


async def delete_checkpoint_files(data_dir: Path, record: CheckpointRecord) -> None:
    public = layout.public_path(data_dir, record.training_run_id, record.kind, record.name)
    versions = layout.versions_dir(data_dir, record.training_run_id, record.kind)
    if public.is_symlink():
        public.unlink()
    for version in versions.glob(f"{record.name}@*") if versions.exists() else []:
        shutil.rmtree(version, ignore_errors=True)


async def serve(config: PublisherConfig, stop: asyncio.Event) -> None:
    bus = await Bus.connect(config.nats_url, "publisher")
    try:
        await ensure_streams(bus.js)
        service = PublisherService(bus, config)
        await service.ensure_consumer()
        await service.run(stop)
    finally:
        await bus.close()


def named_save_result(kind: str, path: str, size_bytes: int) -> ResultBody:
    """The future's result of a named save: the SDK's response type for that save."""
    match kind:
        case "training":
            return SaveWeightsResponse(path=path)
        case "sampler":
            return SaveWeightsForSamplerResponse(path=path)
        case _:
            return SaveWeightsExternalResponse(path=path, size_bytes=size_bytes)
