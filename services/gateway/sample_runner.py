"""Runs accepted sample jobs: every gateway replica pulls from one shared work queue.

A job is acked only after its result is on the results stream. A replica killed mid-generation
never acks, so after the ack wait the job is redelivered to a live replica (or the restarted one)
and runs again under the same request id; the result is appended with that id as `Nats-Msg-Id`,
so the future still resolves exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from infra.faults import crash_point
from libs.contracts import codec
from libs.contracts import subjects as s
from libs.contracts.common import now_ns
from libs.contracts.records import SamplerRecord
from libs.contracts.results import Failure, RequestResult, ResultBody
from libs.contracts.sampling import SampleJob
from services.gateway import sglang
from services.gateway.context import Gateway

log = logging.getLogger("tinkerd.gateway.samples")
ACK_WAIT_S = 15.0
PROGRESS_EVERY_S = 5.0
ENGINE_WAIT_S = 600.0  # how long an accepted sample waits for an unreachable engine (SGLang restarts)


class SampleRunner:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=10.0), limits=httpx.Limits(max_connections=256)
        )
        self.slots = asyncio.Semaphore(gateway.config.sampling_capacity)
        self.tasks: set[asyncio.Task[None]] = set()
        self.stop = asyncio.Event()
        self.loop_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        js = self.gateway.bus.js
        config = ConsumerConfig(
            durable_name=s.DURABLE_SAMPLE_RUNNERS,
            filter_subject=s.SAMPLES_ALL,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=ACK_WAIT_S,
            max_ack_pending=10_000,
        )
        try:
            await js.consumer_info(s.STREAM_SAMPLES, s.DURABLE_SAMPLE_RUNNERS)
        except nats.js.errors.NotFoundError:
            await js.add_consumer(s.STREAM_SAMPLES, config)
        sub = await self.gateway.bus.pull(s.SAMPLES_ALL, s.DURABLE_SAMPLE_RUNNERS, s.STREAM_SAMPLES)
        self.loop_task = asyncio.create_task(self._loop(sub))

    async def close(self) -> None:
        self.stop.set()
        if self.loop_task is not None:
            self.loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.loop_task
        for task in list(self.tasks):
            task.cancel()  # unacked: another replica runs these jobs
        await self.client.aclose()

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
            for msg in msgs:
                task = asyncio.create_task(self._handle(msg))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    async def _handle(self, msg: Msg) -> None:
        progress = asyncio.create_task(_report_progress(msg))
        try:
            job = codec.sample_job_decoder.decode(msg.data)
            if await self.gateway.board.lookup(job.request_id) is not None:
                await msg.ack()  # a redelivered or re-enqueued job that already has its result
                return
            crash_point("gateway.sample_started")  # fault tests: die holding an unacked job
            try:
                body = await self.run(job)
            except httpx.TransportError as exc:  # the engine is down or restarting (killed mid-sample)
                waited = (now_ns() - job.at_ns) / 1e9
                if waited < ENGINE_WAIT_S:
                    attempt = msg.metadata.num_delivered or 1
                    log.warning("sample %s: engine unreachable (%s); retrying", job.request_id, exc)
                    await msg.nak(delay=min(5.0, 0.5 * attempt))  # run it again once the engine is back
                    return
                body = Failure(
                    error=f"the sampling engine was unreachable for {waited:.0f}s: {type(exc).__name__}: {exc}",
                    category="server",
                )
            result = RequestResult(
                kind="sample",
                body=body,
                tenant=job.tenant,
                model_id=job.sampler_id,
                request_id=job.request_id,
                seq_id=job.seq_id,
                at_ns=now_ns(),
                traceparent=job.traceparent,
            )
            await self.gateway.bus.publish_once(
                s.result_subject(job.request_id), codec.pack(result), msg_id=job.request_id
            )  # a job that ran twice (redelivered) still has one result: the first
            await msg.ack()
        finally:
            progress.cancel()
            self.slots.release()

    async def run(self, job: SampleJob) -> ResultBody:
        try:
            request = codec.from_json(job.engine_request, dict)
            adapter = await self._adapter(job.sampler_id)
            if adapter:
                request["lora_path"] = adapter
            outputs = await sglang.generate(self.client, self.gateway.config.sampler_url, request)
            return sglang.to_sample_result(
                outputs,
                job.prompt_len,
                job.want_prompt_logprobs,
                job.topk_prompt,
                job.topk_sample,
                job.prompt_logprobs_last_n,
            )
        except sglang.EngineError as exc:
            category = "user" if exc.status == 400 else "server"
            return Failure(error=f"sampling engine refused the request: {exc}", category=category)
        except httpx.TransportError:
            raise  # transient: the job is delivered again (see _handle)
        except Exception as exc:
            log.exception("sample %s failed", job.request_id)
            return Failure(error=f"sampling failed: {type(exc).__name__}: {exc}", category="server")

    async def _adapter(self, sampler_id: str) -> str | None:
        """The engine adapter to sample with (None: the base model), waiting for a pending save."""
        store = self.gateway.store
        sampler = await store.get(s.KV_SAMPLERS, s.token(sampler_id), SamplerRecord)
        if sampler is None:
            raise RuntimeError(f"sampler {sampler_id} is gone")
        if sampler.pending_request_id and not sampler.adapter_name:
            result = await self.gateway.board.wait(sampler.pending_request_id, 24 * 3600)
            if result is None or isinstance(result.body, Failure):
                raise RuntimeError("the snapshot this sampler was created for failed to save")
            sampler = await store.get(s.KV_SAMPLERS, s.token(sampler_id), SamplerRecord) or sampler
        if sampler.adapter_name and sampler.adapter_dir:
            # Idempotent: an engine that restarted (or evicted it) gets it back before sampling.
            await sglang.load_adapter(
                self.client, self.gateway.config.sampler_url, sampler.adapter_name, sampler.adapter_dir
            )
        return sampler.adapter_name


async def _report_progress(msg: Msg) -> None:
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)  # keep-alive for a long generation, not synchronisation
        with contextlib.suppress(Exception):
            await msg.in_progress()
