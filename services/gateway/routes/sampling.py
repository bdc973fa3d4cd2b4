"""Sampling: create_sampling_session, GET samplers/{id}, asample, join_sampling_session.

Sampling never enters the training path. An accepted asample is claimed by
(sampling_session_id, seq_id) — retries get the same future — and appended to the sample work queue;
a gateway replica's `SampleRunner` sends `/generate` to an SGLang-compatible engine (loading the
sampler's adapter into it on demand) and appends the result to the results stream, where any
replica's `retrieve_future` finds it.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import numpy as np
from litestar import get, post

from infra import tracing
from libs.contracts import codec, ids
from libs.contracts import subjects as s
from libs.contracts.common import now_ns
from libs.contracts.records import CheckpointRecord, SamplerRecord, SeqClaim
from libs.contracts.sampling import SampleJob
from services.gateway.accounts.auth import Tenant
from services.gateway.catalog.catalog import resolve_checkpoint
from services.gateway.context import Gateway
from services.gateway.http.errors import BadRequest, Conflict
from services.gateway.http.ownership import owned_session
from services.gateway.sampling.sampleable import check_sampleable
from services.gateway.submit import claim_and_append, fingerprint_json
from services.gateway.wire import tinker_wire as w

log = logging.getLogger("tinkerd.gateway.sampling")


async def owned_sampler(gateway: Gateway, tenant: Tenant, sampler_id: str) -> SamplerRecord:
    return await gateway.store.owned(s.KV_SAMPLERS, sampler_id, SamplerRecord, tenant.id, "sampler")


@post("/api/v1/create_sampling_session", status_code=200, operation_id="create_sampling_session")
async def create_sampling_session(
    data: w.CreateSamplingSessionRequest, gateway: Gateway, tenant: Tenant
) -> w.CreateSamplingSessionResponse:
    await owned_session(gateway, tenant, data.session_id)
    sampler_id = ids.sampler_id(data.session_id, data.sampling_session_seq_id)
    record = SamplerRecord(
        sampler_id=sampler_id,
        tenant=tenant.id,
        session_id=data.session_id,
        base_model=gateway.model.name,
        created_ns=now_ns(),
    )
    if data.model_path:  # the checkpoint's base model, whatever base_model says
        checkpoint: CheckpointRecord = await resolve_checkpoint(
            gateway, tenant, data.model_path, kind="sampler"
        )
        record.model_path, record.adapter_name, record.adapter_dir = (
            data.model_path,
            checkpoint.adapter_name,
            checkpoint.directory,
        )
        record.base_model = checkpoint.base_model
    elif data.base_model:
        served = gateway.served(data.base_model)
        if served is None:
            names = ", ".join(repr(m.name) for m in gateway.models)
            raise BadRequest(f"base_model {data.base_model!r} is not served here; this deployment serves {names}")
        record.base_model = served.name
    check_sampleable(gateway, record.base_model)
    created, existing = await gateway.store.create(s.KV_SAMPLERS, ids.token(sampler_id), record, SamplerRecord)
    if not created and (
        existing.tenant != tenant.id
        or existing.model_path != record.model_path
        or existing.base_model != record.base_model
    ):
        raise Conflict(
            f"sampling_session_seq_id {data.sampling_session_seq_id} was already used for another sampler"
        )
    return w.CreateSamplingSessionResponse(sampling_session_id=sampler_id)


@get("/api/v1/samplers/{sampler_id:str}", operation_id="get_sampler")
async def get_sampler(sampler_id: str, gateway: Gateway, tenant: Tenant) -> w.GetSamplerResponse:
    record = await owned_sampler(gateway, tenant, sampler_id)
    return w.GetSamplerResponse(
        sampler_id=record.sampler_id, base_model=record.base_model, model_path=record.model_path
    )


@post("/api/v1/join_sampling_session", status_code=200, operation_id="join_sampling_session")
async def join_sampling_session(
    data: w.JoinSamplingSessionRequest, gateway: Gateway, tenant: Tenant
) -> w.JoinSamplingSessionResponse:
    await owned_sampler(gateway, tenant, data.sampling_session_id)
    kv = await gateway.bus.kv(s.KV_SAMPLE_SEQ)
    revision = await kv.put(ids.clones_key(data.sampling_session_id), b"1")
    return w.JoinSamplingSessionResponse(client_counter=int(revision))


def _stop_params(stop: object) -> dict[str, Any]:
    if stop is None:
        return {}
    if isinstance(stop, str):
        return {"stop": [stop]}
    if isinstance(stop, list) and not stop:
        return {"ignore_eos": True}  # [] disables every stop, EOS included
    if isinstance(stop, list) and all(isinstance(x, int) for x in stop):
        # SGLang adds stop_token_ids to EOS (ignore_eos would disable both), so EOS still stops.
        return {"stop_token_ids": list(stop)}
    return {"stop": [str(x) for x in stop]}  # type: ignore[attr-defined]


def _checked_prompt(data: w.SampleRequest, gateway: Gateway, base: str) -> tuple[np.ndarray, int]:
    """(prompt token ids, max_tokens), or a 400 naming what is wrong; the limits (vocabulary,
    context length) are those of the sampler's base model `base`."""
    try:
        prompt = np.asarray(data.prompt.token_ids(), dtype=np.int64)
    except ValueError as exc:
        raise BadRequest(f"prompt: text only ({exc})") from exc
    model = gateway.model_named(base)
    vocab, context = model.vocab_size, model.max_context
    if prompt.size == 0:
        raise BadRequest("prompt has no tokens")
    if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
        bad = int(prompt[(prompt < 0) | (prompt >= vocab)][0])
        raise BadRequest(
            f"prompt contains token id {bad}; ids must be in [0, {vocab}) for base model {model.name!r}"
        )
    most = min(
        gateway.config.max_num_samples, gateway.config.sampling_capacity
    )  # more could never be admitted
    if not 1 <= data.num_samples <= most:
        raise BadRequest(f"num_samples must be in [1, {most}], got {data.num_samples}")
    max_tokens = data.sampling_params.max_tokens
    max_tokens = max_tokens if max_tokens is not None else context - int(prompt.size)
    if max_tokens < 1 or prompt.size + max_tokens > context:
        raise BadRequest(
            f"prompt ({prompt.size} tokens) + max_tokens ({max_tokens}) exceeds the context length {context} "
            f"of base model {model.name!r}"
        )
    return prompt, max_tokens


def _engine_body(
    data: w.SampleRequest, prompt: np.ndarray, max_tokens: int, namespace: str | None = None
) -> dict[str, Any]:
    """SGLang's `/generate` body; `namespace` (SGLang's `extra_key`) keeps the engine's prefix
    cache of one client apart from every other's."""
    params = data.sampling_params
    return {
        **({"extra_key": namespace} if namespace is not None else {}),
        "input_ids": prompt.tolist(),
        "sampling_params": {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "max_new_tokens": max_tokens,
            "n": data.num_samples,
            **({"sampling_seed": params.seed} if params.seed is not None else {}),
            **_stop_params(params.stop),
        },
        "return_logprob": True,
        "logprob_start_len": 0 if (data.prompt_logprobs or data.topk_prompt_logprobs) else -1,
        "top_logprobs_num": max(data.topk_prompt_logprobs, data.topk_sample_logprobs),
    }


class SamplingReservation:
    """An accepted sample holds `permits` sampling permits (its num_samples) from its claim until
    its result is appended (`Admission.finished`, called for every result on the stream)."""

    def __init__(self, gateway: Gateway, tenant: Tenant, sampler_id: str, request_id: str, permits: int) -> None:
        self.admission = gateway.admission
        self.tenant, self.sampler_id, self.request_id, self.permits = tenant.id, sampler_id, request_id, permits

    def reserve(self) -> None:
        self.admission.acquire_sampling(self.permits)  # 429 before anything is claimed

    def cancel(self) -> None:
        self.admission.release_sampling(self.permits)

    def commit(self, claim: SeqClaim) -> None:
        self.admission.hold_sampling(self.request_id, self.permits)

    def rollback(self) -> None:
        self.admission.finished(self.tenant, self.sampler_id, self.request_id)


def _sample_job(
    tenant: Tenant, sampler: SamplerRecord, seq: int, data: w.SampleRequest, prompt: np.ndarray, max_tokens: int
) -> SampleJob:
    return SampleJob(
        sampler_id=sampler.sampler_id,
        engine_request=msgspec.json.encode(
            # an inflight client is its own KV namespace, across every update of its weights
            _engine_body(data, prompt, max_tokens, sampler.sampler_id if sampler.inflight_model_id else None)
        ),
        num_samples=data.num_samples,
        prompt_len=int(prompt.size),
        want_prompt_logprobs=bool(data.prompt_logprobs or data.topk_prompt_logprobs),
        topk_prompt=data.topk_prompt_logprobs,
        topk_sample=data.topk_sample_logprobs,
        prompt_logprobs_last_n=data.prompt_logprobs_last_n,
        record=bool(data.record_stability_info),
        session_id=sampler.session_id,
        tenant=tenant.id,
        model_id=sampler.sampler_id,
        request_id=ids.request_id(sampler.sampler_id, seq),
        seq_id=seq,
        at_ns=now_ns(),
        traceparent=tracing.current_traceparent(),
    )


@post("/api/v1/asample", status_code=200, operation_id="asample")
async def asample(data: w.SampleRequest, gateway: Gateway, tenant: Tenant) -> w.UntypedAPIFuture:
    if data.sampling_session_id is None:
        raise BadRequest("sampling_session_id is required")
    sampler = await owned_sampler(gateway, tenant, data.sampling_session_id)
    seq = data.seq_id if data.seq_id is not None else 0
    if seq < 0:
        raise BadRequest(f"seq_id must be >= 0, got {seq}")
    check_sampleable(gateway, sampler.base_model)
    prompt, max_tokens = _checked_prompt(data, gateway, sampler.base_model)
    request_id = ids.request_id(sampler.sampler_id, seq)
    claim = SeqClaim(
        request_id=request_id,
        fingerprint=fingerprint_json("sample", msgspec.to_builtins(data)),
        kind="sample",
        tenant=tenant.id,
        accepted_ns=now_ns(),
    )
    job = _sample_job(tenant, sampler, seq, data, prompt, max_tokens)

    async def enqueue(_stored: SeqClaim) -> None:
        """Onto the shared work queue; any gateway replica runs it (see sample_runner)."""
        await gateway.bus.publish(s.sample_subject(sampler.sampler_id), codec.pack(job), msg_id=request_id)

    async def answered() -> bool:
        return await gateway.board.lookup(request_id) is not None

    def conflict(_stored: SeqClaim) -> Conflict:
        return Conflict(
            f"seq_id {seq} of sampler {sampler.sampler_id} was already used for a different sample request"
        )

    _, fresh = await claim_and_append(
        gateway,
        s.KV_SAMPLE_SEQ,
        ids.seq_key(sampler.sampler_id, seq),
        claim,
        SamplingReservation(gateway, tenant, sampler.sampler_id, request_id, data.num_samples),
        enqueue,
        conflict,
        answered,
        fault_point="gateway.sample_claimed",
    )
    gateway.metrics.accepted["sample"] += fresh
    sequence_ids = [ids.sequence_id(request_id, i) for i in range(data.num_samples)]
    return w.UntypedAPIFuture(request_id=request_id, sample_sequence_ids=sequence_ids)


ROUTES = [create_sampling_session, get_sampler, join_sampling_session, asample]
