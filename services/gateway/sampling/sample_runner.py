"""Runs accepted sample jobs: every gateway replica pulls from one shared work queue.

A job is acked only after its result is on the results stream. A replica killed mid-generation
never acks, so after the ack wait the job is redelivered to a live replica (or the restarted one)
and runs again under the same request id; the result is appended with that id as `Nats-Msg-Id`,
so the future still resolves exactly once.

A job whose engine cannot be used (down, restarting, 502/503/504, or an address that does not
answer as a sampling engine of the base model: engines.py) waits for it instead of failing: its
future answers `try_again` with `queue_state: paused_capacity` and the engines' reason (a
`QueueRecord` in `tinker_queue`), the job is kept alive with in-progress acks, and it runs as soon
as an engine passes its check again. It fails, naming the engines and why, once every engine of
its base model has been failing for `engine_failing_s`, and in any case past `sample_deadline_s`
after it was accepted.
The adapter it samples with is loaded into the engine on demand (see `engines.py`): from its files,
or, for an ephemeral export whose files are not recorded yet, from the trainer's memory; when the
engine cannot read that handover, the sample waits for the files (within its deadline). The engines
are those of the sampler's base model (`Gateway.pool`). An inflight sampler samples with its
model's inflight target when that is its own save or a newer one (`InflightTarget`); a
generation runs on the adapter it started with.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from infra.answers import answer
from infra.bus import BUS_UNAVAILABLE, fetch_failed
from infra.streams import sample_runner_durable
from libs.contracts import codec, ids
from libs.contracts import subjects as s
from libs.contracts.common import now_ns
from libs.contracts.events import RequestCompleted
from libs.contracts.records import InflightTarget, QueueRecord, SamplerRecord
from libs.contracts.results import Failure, ResultBody, SampleResult
from libs.contracts.sampling import SampleJob
from libs.faults import crash_point
from services.gateway.context import Gateway
from services.gateway.sampling import sglang, stability
from services.gateway.sampling.engines import Adapter

log = logging.getLogger("tinkerd.gateway.samples")
ACK_WAIT_S = 15.0
PROGRESS_EVERY_S = 5.0
BUS_RETRY_S = 1.0
"""How long a job whose run the broker interrupted waits before it is delivered again."""
TRANSIENT: tuple[type[Exception], ...] = (httpx.TransportError, *BUS_UNAVAILABLE)


class SampleRunner:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.slots = asyncio.Semaphore(gateway.config.sampling_capacity)
        self.tasks: set[asyncio.Task[None]] = set()
        self.running: dict[str, asyncio.Task[ResultBody]] = {}  # request id -> the job's generation
        self.cancelled: set[str] = set()
        self._cancels: Subscription | None = None
        self.stop = asyncio.Event()
        self.loop_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        js = self.gateway.bus.js
        durable = sample_runner_durable(ACK_WAIT_S)
        try:
            await js.consumer_info(s.STREAM_SAMPLES, s.DURABLE_SAMPLE_RUNNERS)
        except nats.js.errors.NotFoundError:
            await js.add_consumer(durable.stream, durable.config)
        sub = await self.gateway.bus.pull(s.SAMPLES_ALL, s.DURABLE_SAMPLE_RUNNERS, s.STREAM_SAMPLES)
        self._cancels = await self.gateway.bus.nc.subscribe(s.CANCEL_ALL, cb=self._on_cancel)
        self.loop_task = asyncio.create_task(self._loop(sub))

    async def _on_cancel(self, msg: Msg) -> None:
        """A sample was cancelled (on any replica): stop it here if this replica runs it."""
        request_id = s.cancel_request_id(msg.subject)
        task = self.running.get(request_id)
        if task is not None:
            self.cancelled.add(request_id)
            task.cancel()  # closes its engine request: the engine drops the rows

    async def close(self) -> None:
        self.stop.set()
        if self._cancels is not None:
            with contextlib.suppress(Exception):
                await self._cancels.unsubscribe()
        if self.loop_task is not None:
            self.loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.loop_task
        for task in list(self.tasks):
            task.cancel()  # unacked: another replica runs these jobs

    async def _loop(self, sub) -> None:  # type: ignore[no-untyped-def]
        while not self.stop.is_set():
            await self.slots.acquire()  # fetch only what this replica can run now
            try:
                msgs = await sub.fetch(1, timeout=5.0)
            except (nats.errors.TimeoutError, TimeoutError):
                self.slots.release()
                continue
            except nats.errors.ConnectionClosedError:
                self.slots.release()
                return
            except (nats.errors.Error, nats.js.errors.Error) as exc:  # a leader moving, a reconnect
                self.slots.release()
                await fetch_failed(exc, self.stop)
                continue
            for msg in msgs:
                task = asyncio.create_task(self._handle(msg))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    async def _handle(self, msg: Msg) -> None:
        progress = asyncio.create_task(_report_progress(msg))
        job: SampleJob | None = None
        try:
            job = codec.sample_job_decoder.decode(msg.data)
            if await self.gateway.board.lookup(job.request_id) is not None:
                await msg.ack()  # a redelivered or re-enqueued job that already has its result
                return
            crash_point("gateway.sample_started")  # fault tests: die holding an unacked job
            try:
                body = await self._run_cancellable(job)
            except _Cancelled:
                await msg.ack()  # its result (cancelled) is on the results stream already
                log.info("sample %s cancelled by its client; generation stopped", job.request_id)
                return
            except httpx.TransportError as exc:  # the engine is down or restarting (killed mid-sample)
                waited = (now_ns() - job.at_ns) / 1e9
                if waited < self.gateway.config.sample_deadline_s:  # the sample's own deadline
                    attempt = msg.metadata.num_delivered or 1
                    log.warning("sample %s: engine unreachable (%s); retrying", job.request_id, exc)
                    await msg.nak(delay=min(5.0, 0.5 * attempt))  # run it again once the engine is back
                    return
                body = Failure(
                    error=f"the sampling engine was unreachable for {waited:.0f}s: {type(exc).__name__}: {exc}",
                    category="server",
                )
            if isinstance(body, SampleResult):  # metered before it is answered (counted once per id)
                await self.gateway.bus.emit(usage_event(job, body))
            await answer(  # a job that ran twice (redelivered) still has one result: the first
                self.gateway.bus,
                kind="sample",
                body=body,
                tenant=job.tenant,
                model_id=job.sampler_id,
                request_id=job.request_id,
                seq_id=job.seq_id,
                traceparent=job.traceparent,
                announce="none",  # its `completed` is the metered usage event above
            )
            await msg.ack()
            if msg.metadata.num_delivered > 1:  # a replica that died waiting may have left a record
                await self._resumed(job)
        except BUS_UNAVAILABLE as exc:
            # The broker is restarting (reading the sampler's adapter, recording the sequences,
            # appending the result): the job runs again once it is back. A result that did land
            # is found by the lookup above, and `answer` appends one result per request at most.
            what = job.request_id if job is not None else msg.subject
            log.warning("sample %s: the broker did not answer (%s); running it again", what, exc)
            with contextlib.suppress(nats.errors.Error):  # unacked, it comes back after its ack wait anyway
                await msg.nak(delay=BUS_RETRY_S)
        finally:
            progress.cancel()
            self.slots.release()

    async def _run_cancellable(self, job: SampleJob) -> ResultBody:
        """`run` in a task of its own, which `_on_cancel` cancels; raises `_Cancelled` then."""
        task: asyncio.Task[ResultBody] = asyncio.ensure_future(self.run(job))
        self.running[job.request_id] = task
        try:
            return await task
        except asyncio.CancelledError:
            if job.request_id in self.cancelled and task.cancelled():
                raise _Cancelled() from None
            raise
        finally:
            self.running.pop(job.request_id, None)
            self.cancelled.discard(job.request_id)

    async def run(self, job: SampleJob) -> ResultBody:
        paused = False
        try:
            request = codec.from_json(job.engine_request, dict)
            adapter, base = await self._adapter(job.sampler_id)
            engines = self.gateway.pool(base)
            if engines is None:  # the gateway was restarted without this base's engines
                return Failure(
                    error=f"base model {base!r} has no sampling engine in this deployment "
                    "(TINKERD_GATEWAY_BASE_SAMPLER_URLS)",
                    category="user",
                )
            config = self.gateway.config
            deadline_ns = job.at_ns + int(config.sample_deadline_s * 1e9)
            reason = ""
            while True:
                try:
                    outputs = await engines.generate(request, adapter)
                    break
                except sglang.HandoverUnreadable as exc:
                    adapter = await self._files_of(job.sampler_id, deadline_ns, str(exc))
                except sglang.EngineUnavailable as exc:
                    left_s = (deadline_ns - now_ns()) / 1e9
                    if left_s <= 0:
                        return Failure(
                            error=f"no sampling engine could be reached within the sample's deadline "
                            f"({config.sample_deadline_s:.0f}s after it was accepted): {exc}",
                            category="server",
                        )
                    failing_s = engines.failing_for_s()
                    if failing_s >= config.engine_failing_s:
                        return Failure(
                            error=f"no sampling engine of base model {base!r} can serve: every one has been "
                            f"failing for over {config.engine_failing_s:.0f}s "
                            f"(TINKERD_GATEWAY_ENGINE_FAILING_S): {engines.describe_failures()}",
                            category="server",
                        )
                    if engines.describe_failures() != reason:  # the first wait, or a new reason
                        reason = engines.describe_failures()
                        paused = True
                        await self._pause(job, reason)
                    await engines.wait_available(min(left_s, config.engine_failing_s - failing_s))
            body = sglang.to_sample_result(
                outputs,
                job.prompt_len,
                job.want_prompt_logprobs,
                job.topk_prompt,
                job.topk_sample,
                job.prompt_logprobs_last_n,
            )
            if job.record:  # recorded before it is answered, so a training request can name it
                snapshot = adapter.name if adapter is not None else ""
                await stability.record(self.gateway, job, request["input_ids"], snapshot, body)
            return body
        except sglang.EngineError as exc:
            category = "user" if exc.status == 400 else "server"
            return Failure(error=f"sampling engine refused the request: {exc}", category=category)
        except TRANSIENT:
            raise  # the engine or the broker is away for a moment: the job is delivered again (see _handle)
        except Exception as exc:
            log.exception("sample %s failed", job.request_id)
            return Failure(error=f"sampling failed: {type(exc).__name__}: {exc}", category="server")
        finally:
            if paused:
                await self._resumed(job)

    async def _pause(self, job: SampleJob, why: str) -> None:
        """Tell the SDK (through try_again) why this sample waits."""
        config = self.gateway.config
        reason = (
            f"the sampling engine is unavailable ({why}); the sample waits for it and runs when it is "
            f"back (it fails once the engines have been failing for {config.engine_failing_s:.0f}s, "
            f"and at most {config.sample_deadline_s:.0f}s after it was accepted)"
        )
        log.warning("sample %s waits: %s", job.request_id, why)
        record = QueueRecord(
            request_id=job.request_id, queue_state="paused_capacity", reason=reason, since_ns=now_ns()
        )
        with contextlib.suppress(Exception):  # the wait itself does not depend on the record
            await self.gateway.store.put(s.KV_QUEUE, ids.token(job.request_id), record)

    async def _resumed(self, job: SampleJob) -> None:
        with contextlib.suppress(Exception):
            await self.gateway.store.delete(s.KV_QUEUE, ids.token(job.request_id))

    async def _files_of(self, sampler_id: str, deadline_ns: int, why: str) -> Adapter | None:
        """The sampler's adapter once its files are recorded (its handover could not be read:
        `why`). Their command follows the handover's by one write and fsync, and the sampler record
        is the only place that says when it has been published: polled, with backoff."""
        log.info("sampler %s: the engine could not read its handover (%s); waiting for its files", sampler_id, why)
        delay = 0.02
        while True:
            adapter, _ = await self._adapter(sampler_id)
            if adapter is None or adapter.directory is not None:
                return adapter
            if now_ns() >= deadline_ns:
                raise RuntimeError(
                    f"the engine could not load this sampler's adapter from the trainer's memory ({why}), "
                    "and its files were not saved within the sample's deadline"
                )
            await asyncio.sleep(delay)  # backoff between reads of the sampler record
            delay = min(1.0, delay * 2)

    async def _adapter(self, sampler_id: str) -> tuple[Adapter | None, str]:
        """(the adapter to sample with (None: the base model), the sampler's base model), waiting
        for a pending save."""
        store = self.gateway.store
        sampler = await store.get(s.KV_SAMPLERS, ids.token(sampler_id), SamplerRecord)
        if sampler is None:
            raise RuntimeError(f"sampler {sampler_id} is gone")
        if sampler.pending_request_id and not sampler.adapter_name:
            result = await self.gateway.board.wait(sampler.pending_request_id, 24 * 3600)
            if result is None or isinstance(result.body, Failure):
                raise RuntimeError("the sampler export this sampler was created for failed to save")
            sampler = await store.get(s.KV_SAMPLERS, ids.token(sampler_id), SamplerRecord) or sampler
        if not sampler.adapter_name:
            return None, sampler.base_model
        if sampler.inflight_model_id:  # the model's inflight target: this client's save or a newer one
            target = await store.get(s.KV_INFLIGHT, ids.token(sampler.inflight_model_id), InflightTarget)
            if target is not None and target.seq_id >= (sampler.save_seq_id or 0):
                adapter = Adapter(target.adapter_name, target.adapter_dir, target.handover)
                return adapter, sampler.base_model
        return Adapter(sampler.adapter_name, sampler.adapter_dir, sampler.handover), sampler.base_model


class _Cancelled(Exception):
    """The job's client cancelled it (cancel_future) while it ran."""


def usage_event(job: SampleJob, body: SampleResult) -> RequestCompleted:
    """What one answered sample cost: the metering (billing usage) folds these."""
    return RequestCompleted(
        kind="sample",
        duration_ms=(now_ns() - job.at_ns) / 1e6 if job.at_ns else 0.0,
        prompt_tokens=job.prompt_len,
        sampled_tokens=sum(len(seq.tokens) // 4 for seq in body.sequences),  # int32 tokens
        cached_tokens=min(job.prompt_len, body.prompt_cache_hit_tokens),
        tenant=job.tenant,
        model_id=job.sampler_id,
        request_id=job.request_id,
        seq_id=job.seq_id,
        at_ns=now_ns(),
    )


async def _report_progress(msg: Msg) -> None:
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)  # keep-alive for a long generation, not synchronisation
        with contextlib.suppress(Exception):
            await msg.in_progress()
