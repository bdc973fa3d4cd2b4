"""Appending an accepted command exactly once per SDK coordinate: `claim_and_append`.

One protocol for training commands ((model, seq_id) in KV `tinker_seq`, appended to the model's
request subject) and sample jobs ((sampler, seq_id) in `tinker_sample_seq`, appended to the sample
work queue). The identity is claimed with a create-only write before the append:
- admission is decided first (429 before anything is claimed or held), except for a retry of a
  request already claimed, which a full queue never refuses (the claim is read only then);
- a new identity is claimed; only the call that made the claim holds admission resources
  (requests in flight, sampling permits), taken before the append (the result may beat the ack);
- the append is made; if it fails, what this call holds is given back and the error reaches the
  client, whose retry finds the claim and appends again;
- an identical retry finds its own claim (same fingerprint) and gets the same request id; the
  append is repeated (unless the result already exists), closing the window where a gateway died
  between claim and append. The repeat has no second effect: JetStream's `Nats-Msg-Id` dedupe
  drops it within the duplicate window, and past it the planner's seq dedupe (training) or the
  sample runner's result check and conditional result append (sampling) do;
- the same identity with different content is 422;
- training content the gateway refuses still consumes its seq_id (a `Rejected` command is
  appended), so a later seq_id never waits on it, and the client gets the 400 — the same 400 on
  every retry.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec

from infra import tracing
from libs.contracts import codec, ids
from libs.contracts import subjects as s
from libs.contracts.common import now_ns
from libs.contracts.events import RequestAccepted, RequestRejected
from libs.contracts.records import ModelRecord, SeqClaim
from libs.contracts.requests import ForwardBackward, ModelCommand, Rejected, UnloadModel
from libs.faults import crash_point
from services.gateway.accounts.auth import Tenant
from services.gateway.context import Gateway
from services.gateway.http.errors import (
    BadRequest,
    Conflict,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    TinkerError,
)

_background: set[asyncio.Task[None]] = set()


def fingerprint_bytes(kind: str, body: bytes) -> str:
    """A digest of a (decompressed) protobuf body: SDK retries resend identical bytes."""
    return hashlib.sha256(kind.encode() + b"|" + body).hexdigest()


def fingerprint_json(kind: str, body: object, exclude: tuple[str, ...] = ()) -> str:
    """A digest of a JSON body, minus fields the SDK regenerates on every attempt.

    (save_weights_for_sampler's `sampling_session_seq_id` is drawn anew per HTTP attempt.)
    """
    fields = dict(body) if isinstance(body, dict) else {"body": body}
    for name in exclude:
        fields.pop(name, None)
    canonical = msgspec.json.encode(fields, order="sorted")
    return hashlib.sha256(kind.encode() + b"|" + canonical).hexdigest()


async def owned_model(
    gateway: Gateway, tenant: Tenant, model_id: str, *, current: bool = False
) -> ModelRecord:
    """The model if it exists and belongs to the caller; 404 otherwise (existence is not leaked).
    A run made by copy_weights only holds its copy: any training call on it is a 400.

    Model records are never deleted, and their owner, base model, rank and `copy_of` never
    change: the record a gateway once found answers the next calls without a read. `current`
    reads it again, for a caller that needs a field that changes (`unloaded`)."""
    model = await gateway.store.owned(
        s.KV_MODELS, model_id, ModelRecord, tenant.id, "model", kept=not current
    )
    if model.copy_of is not None:
        raise BadRequest(
            f"training run {model_id} holds a copy of {model.copy_of} and cannot be trained on; "
            "create_training_client_from_state(its tinker path) starts a trainable run from it"
        )
    return model


def check_seq(seq_id: int | None, first: int = 1) -> int:
    if seq_id is None or isinstance(seq_id, bool) or not isinstance(seq_id, int) or seq_id < first:
        raise BadRequest(f"seq_id must be an integer >= {first}, got {seq_id!r}")
    return seq_id


class Reservation(Protocol):
    """What a new claim holds from the gateway's admission control, and how it is given back."""

    def reserve(self) -> None:
        """Before claiming: raise Overloaded (429), or take what the request needs."""

    def cancel(self) -> None:
        """The claim was not made by this call (a concurrent retry won, or the write failed)."""

    def commit(self, claim: SeqClaim) -> None:
        """This call made `claim`: hold the resources until the request's result is appended."""

    def rollback(self) -> None:
        """The append after `commit` failed: give back what `commit` holds."""


async def claim_and_append(
    gateway: Gateway,
    bucket: str,
    key: str,
    claim: SeqClaim,
    reservation: Reservation,
    publish: Callable[[SeqClaim], Awaitable[object]],
    conflict: Callable[[SeqClaim], TinkerError],
    answered: Callable[[], Awaitable[bool]] | None = None,
    fault_point: str = "gateway.claimed",
) -> tuple[SeqClaim, bool]:
    """Claim `key` for `claim` and append (see the module docstring). Returns (the stored claim,
    whether this call made it). `publish` appends given the stored claim; `answered` says the
    request's result already exists (a retry then appends nothing)."""
    # The claim is tried first (the common case: a new identity, one KV write); only a refused
    # admission reads the claim first, since a retry of a request already claimed is never 429.
    try:
        reservation.reserve()
    except Overloaded:
        found = await gateway.store.get(bucket, key, SeqClaim)
        if found is None:
            raise
        existing, fresh = found, False
    else:
        try:
            fresh, existing = await gateway.store.create(bucket, key, claim, SeqClaim)
        except BaseException:
            reservation.cancel()
            raise
        if not fresh:
            reservation.cancel()
    if existing.fingerprint != claim.fingerprint:
        raise conflict(existing)
    if not fresh and answered is not None and await answered():
        return existing, False
    if fresh:
        reservation.commit(existing)
    crash_point(fault_point)  # fault tests: die between the claim and the append
    try:
        await publish(existing)
    except BaseException:
        if fresh:
            reservation.rollback()
        raise
    return existing, fresh


class TrainingReservation:
    """A training request counts against its model's queue depth and its tenant's in-flight
    requests from its claim until its result; a refused one (a `Rejected`) counts nowhere."""

    def __init__(self, gateway: Gateway, tenant: str, model_id: str, seq_id: int, request_id: str) -> None:
        self.admission = gateway.admission
        self.tenant, self.model_id, self.seq_id, self.request_id = tenant, model_id, seq_id, request_id
        self.held = False

    def reserve(self) -> None:
        self.admission.check_training(self.tenant, self.model_id, self.seq_id)

    def cancel(self) -> None:
        pass  # the check takes nothing

    def commit(self, claim: SeqClaim) -> None:
        if claim.error is None:
            self.admission.admitted(self.tenant, self.model_id, self.seq_id, self.request_id)
            self.held = True

    def rollback(self) -> None:
        if self.held:
            self.admission.finished(self.tenant, self.model_id, self.request_id)
            self.held = False


async def append(
    gateway: Gateway,
    tenant: Tenant,
    model_id: str,
    seq_id: int,
    kind: str,
    digest: str,
    command: ModelCommand | None,
    refused: TinkerError | None = None,
) -> str:
    """Claim (model, seq_id) and append `command` (or a `Rejected` for `refused`). Returns the request id.

    Raises `refused` after consuming the seq_id, Conflict on a different payload for a claimed
    seq_id, and Overloaded (before claiming anything) when the model or tenant is at its limit.
    """
    request_id = ids.request_id(model_id, seq_id)  # every replica agrees without talking
    traceparent = tracing.current_traceparent()
    claim = SeqClaim(
        request_id=request_id,
        fingerprint=digest,
        kind=kind,
        tenant=tenant.id,
        accepted_ns=now_ns(),
        error=refused.message if refused else None,
        status=refused.status if refused else 200,
    )

    async def publish(stored: SeqClaim) -> None:
        envelope: dict[str, object] = {
            "tenant": tenant.id,
            "request_id": request_id,
            "at_ns": stored.accepted_ns,
            "traceparent": traceparent,
        }
        to_append: ModelCommand
        if stored.error is not None or command is None:
            error = stored.error or "request refused"
            to_append = Rejected(kind=kind, error=error, model_id=model_id, seq_id=seq_id, **envelope)  # type: ignore[arg-type]
        else:
            to_append = msgspec.structs.replace(command, **envelope)
        await gateway.bus.publish(
            s.request_subject(model_id), codec.pack(to_append), msg_id=request_id, traceparent=traceparent
        )

    def conflict(stored: SeqClaim) -> TinkerError:
        return Conflict(
            f"seq_id {seq_id} of model {model_id} was already used for a different {stored.kind} request; "
            "a retry must resend the same content (use the next seq_id for new work)"
        )

    existing, fresh = await claim_and_append(
        gateway,
        s.KV_SEQ,
        ids.seq_key(model_id, seq_id),
        claim,
        TrainingReservation(gateway, tenant.id, model_id, seq_id, request_id),
        publish,
        conflict,
        fault_point="gateway.command_claimed",
    )
    if existing.error is None and command is None:
        existing = msgspec.structs.replace(existing, error="request refused")
    if existing.error is not None:
        gateway.metrics.rejected[kind] += fresh
        _emit(
            gateway,
            RequestRejected(
                kind=kind,
                status=existing.status,
                error=existing.error,
                tenant=tenant.id,
                model_id=model_id,
                request_id=request_id,
                seq_id=seq_id,
                at_ns=now_ns(),
            ),
        )
        raise (refused or error_for(existing.status, existing.error))
    assert command is not None
    gateway.metrics.accepted[kind] += fresh
    datums = len(command.data) if isinstance(command, ForwardBackward) else 0
    tokens = sum(d.num_tokens for d in command.data) if isinstance(command, ForwardBackward) else 0
    _emit(
        gateway,
        RequestAccepted(
            kind=kind,
            num_datums=datums,
            num_tokens=tokens,
            tenant=tenant.id,
            model_id=model_id,
            request_id=request_id,
            seq_id=seq_id,
            at_ns=existing.accepted_ns,  # the claim's time, which the command carries: before it is planned
            traceparent=traceparent,  # the console finds a request's path by its trace id
        ),
    )
    return request_id


def error_for(status: int, message: str) -> TinkerError:
    """The error a claim was refused with, for a retry that reaches the claim without re-validating."""
    for cls in (BadRequest, NotFound, PayloadTooLarge, Conflict):
        if cls.status == status:
            return cls(message)
    return BadRequest(message)


def _emit(gateway: Gateway, event: RequestAccepted | RequestRejected) -> None:
    """Operation events are off the request's critical path."""
    task = asyncio.create_task(gateway.bus.emit(event))
    _background.add(task)
    task.add_done_callback(_background.discard)


async def sequenced(
    gateway: Gateway,
    tenant: Tenant,
    model_id: str,
    seq_id: int,
    kind: str,
    digest: str,
    build: Callable[[], Awaitable[ModelCommand]],
) -> str:
    """Build the command, then append it; a refusal while building still consumes the seq_id."""
    try:
        command = await build()
    except TinkerError as refused:
        await append(gateway, tenant, model_id, seq_id, kind, digest, None, refused)
        raise
    return await append(gateway, tenant, model_id, seq_id, kind, digest, command)


async def unload(gateway: Gateway, model: ModelRecord) -> str:
    """Queue the model's unload after everything already sequenced; returns its request id.

    Not a client seq_id: the planner runs it once the model's queue drains, then frees the
    adapter slot (checkpoints stay). Idempotent (`Nats-Msg-Id`, and the planner's own dedupe).
    """
    request_id = ids.unload_request_id(model.model_id)
    command = UnloadModel(
        model_id=model.model_id,
        seq_id=-1,
        tenant=model.tenant,
        request_id=request_id,
        at_ns=now_ns(),
        traceparent=tracing.current_traceparent(),
        reason="unload",
    )
    await gateway.bus.publish(s.request_subject(model.model_id), codec.pack(command), msg_id=request_id)
    if not model.unloaded:
        model.unloaded = True
        await gateway.store.put(s.KV_MODELS, ids.token(model.model_id), model)
    return request_id
