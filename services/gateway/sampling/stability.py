"""Sequence records and provenance: what `stable_reinforce` trains on.

A sample from a sampler created with `record_stability_info=True` appends one `SequenceRecord`
per sampled sequence to `tinker.stability.<sequence_id>` before its result is answered: the
prompt, the sampled tokens and the engine's float32 logprob of each of them. The stream is the
store: it keeps the last record of each subject, and the gateway reads one by a direct get of its
subject, so every replica sees a record the moment it is appended and a restart loses nothing.

A `stable_reinforce` datum names its sources in `model_input_spans` and `loss_fn_input_spans`.
`resolve` checks them against the records (docs/semantics.md, "Provenance") and turns them into
the loss's resolved inputs: `sampler_logprobs` (the recorded logprob at each position a sampled
span covers, 0 elsewhere) and `sampled_sequence` (the index, within the datum, of the sampled
sequence covering each position; -1 where none does). Each use re-appends the record with a new
`touched_ns`, which restarts its one day.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import nats.js.errors
import numpy as np

from libs.contracts import codec, ids
from libs.contracts import subjects as s
from libs.contracts.common import BusDatum, BusTensor, now_ns
from libs.contracts.results import SampleResult
from libs.contracts.sampling import SampleJob, SequenceRecord
from services.gateway.context import Gateway
from services.gateway.http.errors import BadRequest
from services.gateway.wire import proto

log = logging.getLogger("tinkerd.gateway.stability")

LIFETIME_NS = 86_400 * 10**9
"""A record can be trained on for one day after it was sampled or last used by a training request."""

Spans = Sequence[proto.ProvenanceSpan]


async def record(
    gateway: Gateway, job: SampleJob, prompt: Sequence[int], snapshot: str, body: SampleResult
) -> None:
    """Append one record per sampled sequence of `body` (before its result is appended)."""
    now = now_ns()
    prompt_bytes = np.asarray(prompt, dtype="<i4").tobytes()
    entries = []
    for index, sequence in enumerate(body.sequences):
        sequence_id = ids.sequence_id(job.request_id, index)
        entry = SequenceRecord(
            sequence_id=sequence_id,
            session_id=job.session_id,
            sampler_id=job.sampler_id,
            snapshot=snapshot,
            prompt=prompt_bytes,
            tokens=sequence.tokens,
            logprobs=sequence.logprobs,
            sampled_ns=now,
            touched_ns=now,
            tenant=job.tenant,
            model_id=job.sampler_id,
            request_id=job.request_id,
            seq_id=job.seq_id,
            at_ns=now,
        )
        entries.append(gateway.bus.publish(s.stability_subject(sequence_id), codec.pack(entry)))
    await asyncio.gather(*entries)  # every record is durable before the result is appended


async def _lookup(gateway: Gateway, sequence_id: str) -> SequenceRecord | None:
    if not ids.is_valid_id(sequence_id):
        return None
    try:
        raw = await gateway.bus.js.get_last_msg(
            s.STREAM_STABILITY, s.stability_subject(sequence_id), direct=True
        )
    except nats.js.errors.NotFoundError:
        return None
    return None if raw.data is None else codec.sequence_record_decoder.decode(raw.data)


@dataclass(frozen=True)
class _Recorded:
    record: SequenceRecord
    prompt: np.ndarray  # int32
    tokens: np.ndarray  # int32
    logprobs: np.ndarray  # float32


async def _records(gateway: Gateway, sequence_ids: set[str]) -> dict[str, _Recorded]:
    names = sorted(sequence_ids)
    found = await asyncio.gather(*(_lookup(gateway, name) for name in names))
    out = {}
    for name, entry in zip(names, found, strict=True):
        if entry is not None:
            out[name] = _Recorded(
                entry,
                np.frombuffer(entry.prompt, dtype="<i4"),
                np.frombuffer(entry.tokens, dtype="<i4"),
                np.frombuffer(entry.logprobs, dtype="<f4"),
            )
    return out


def _source(
    where: str, span: proto.ProvenanceSpan, records: dict[str, _Recorded], session_id: str, now: int
) -> tuple[_Recorded, np.ndarray, str]:
    """(the record, the tokens the span claims, what they are) or a 400 naming the span."""
    found = records.get(span.sequence_id)
    if found is None:
        raise BadRequest(
            f"{where}: sequence {span.sequence_id!r} is unknown: it was not sampled with "
            "record_stability_info=True, or its record is gone"
        )
    entry = found.record
    if entry.session_id != session_id:
        raise BadRequest(
            f"{where}: sequence {span.sequence_id!r} belongs to another session; a training request "
            "can name only sequences its own session sampled"
        )
    if entry.touched_ns + LIFETIME_NS < now:
        raise BadRequest(
            f"{where}: sequence {span.sequence_id!r} has expired (a record lives one day after "
            "sampling or its last use by a training request)"
        )
    sampled = isinstance(span, proto.SampledProvenanceSpan)
    source, what = (found.tokens, "sampled tokens") if sampled else (found.prompt, "prompt")
    if span.offset < 0 or span.length < 0 or span.offset + span.length > source.size:
        raise BadRequest(
            f"{where} covers [{span.offset}, {span.offset + span.length}) of sequence "
            f"{span.sequence_id!r}'s {what}, which has {source.size} tokens"
        )
    return found, source[span.offset : span.offset + span.length], what


def _tiles(where: str, spans: Spans, length: int, field: str) -> None:
    covered = sum(span.length for span in spans)
    if covered != length:
        raise BadRequest(f"{where} cover {covered} positions; {field} has {length}")


def _resolve_datum(
    index: int,
    datum: BusDatum,
    input_spans: Spans,
    target_spans: Spans,
    records: dict[str, _Recorded],
    session_id: str,
    now: int,
) -> BusDatum:
    at = f"data[{index}]"
    if not input_spans and not target_spans:
        raise BadRequest(
            f"{at} has no provenance: stable_reinforce needs model_input_spans and loss_fn_input_spans "
            "naming the sampled sequences (sample with record_stability_info=True and attach them with "
            "Datum.with_provenance)"
        )
    tokens = datum.token_array()
    targets = datum.inputs["target_tokens"].numpy()
    _tiles(f"{at}.model_input_spans", input_spans, tokens.size, "model_input")
    _tiles(f"{at}.loss_fn_input_spans", target_spans, targets.shape[0], "loss_fn_inputs.target_tokens")
    position = 0
    for j, span in enumerate(input_spans):
        where = f"{at}.model_input_spans[{j}]"
        _, claimed, what = _source(where, span, records, session_id, now)
        got = tokens[position : position + span.length]
        if not np.array_equal(got, claimed):
            raise BadRequest(
                f"{where}: model_input tokens at [{position}, {position + span.length}) differ from "
                f"sequence {span.sequence_id!r}'s recorded {what} at [{span.offset}, {span.offset + span.length})"
            )
        position += span.length
    n = targets.shape[0]
    recorded = np.zeros(n, dtype=np.float32)
    sequence = np.full(n, -1.0, dtype=np.float32)
    numbering: dict[str, int] = {}
    position = 0
    for j, span in enumerate(target_spans):
        where = f"{at}.loss_fn_input_spans[{j}]"
        found, claimed, what = _source(where, span, records, session_id, now)
        end = position + span.length
        if isinstance(span, proto.SampledProvenanceSpan):  # prompt targets carry no advantage: unchecked
            if not np.array_equal(targets[position:end], claimed):
                raise BadRequest(
                    f"{where}: target_tokens at [{position}, {end}) differ from sequence "
                    f"{span.sequence_id!r}'s recorded {what} at [{span.offset}, {span.offset + span.length})"
                )
            recorded[position:end] = found.logprobs[span.offset : span.offset + span.length]
            if span.length:  # numbered only where it covers a position: every index stays below n
                sequence[position:end] = numbering.setdefault(span.sequence_id, len(numbering))
        position = end
    advantages = datum.inputs["advantages"].numpy()
    stray = np.flatnonzero((advantages != 0) & (sequence < 0))
    if stray.size:
        p = int(stray[0])
        raise BadRequest(
            f"{at}.loss_fn_inputs.advantages is {float(advantages[p])} at position {p}, which no sampled "
            "span of loss_fn_input_spans covers; stable_reinforce takes nonzero advantages only on sampled tokens"
        )
    inputs = dict(datum.inputs)
    inputs["sampler_logprobs"] = BusTensor.of(recorded)
    inputs["sampled_sequence"] = BusTensor.of(sequence)
    return BusDatum(tokens=datum.tokens, inputs=inputs)


@dataclass(frozen=True)
class Resolved:
    datums: list[BusDatum]
    records: list[SequenceRecord]  # every record used, to touch once the request is accepted


async def resolve(
    gateway: Gateway, session_id: str, datums: Sequence[BusDatum], spans: Sequence[tuple[Spans, Spans]]
) -> Resolved:
    """The datums with their resolved inputs, or a 400 naming the first bad datum and span."""
    wanted = {span.sequence_id for pair in spans for group in pair for span in group}
    records = await _records(gateway, wanted)
    now = now_ns()
    out = [
        _resolve_datum(i, datum, inputs, targets, records, session_id, now)
        for i, (datum, (inputs, targets)) in enumerate(zip(datums, spans, strict=True))
    ]
    return Resolved(out, [records[name].record for name in sorted(wanted)])


async def touch(gateway: Gateway, records: Sequence[SequenceRecord]) -> None:
    """Restart each record's day: re-append it with `touched_ns` now (the stream keeps the last)."""
    now = now_ns()

    async def renew(entry: SequenceRecord) -> None:
        renewed = msgspec.structs.replace(entry, touched_ns=now, at_ns=now)
        try:
            await gateway.bus.publish(s.stability_subject(entry.sequence_id), codec.pack(renewed))
        except Exception as exc:  # the request stands; the record still lives a day past its last touch
            log.warning("could not renew the record of sequence %s: %s", entry.sequence_id, exc)

    await asyncio.gather(*(renew(entry) for entry in records))
