"""One encoder/decoder per message family.

Commands, units, outcomes and results travel as msgpack (token arrays stay raw bytes); operation
events and KV records as JSON so that people can read them with `nats sub` and `nats kv get`.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from libs.contracts.events import OperationEvent
from libs.contracts.outcomes import Outcome
from libs.contracts.publish import PublishCommand
from libs.contracts.requests import ModelCommand
from libs.contracts.results import RequestResult
from libs.contracts.sampling import SampleJob, SequenceRecord
from libs.contracts.work import Unit

T = TypeVar("T")

_msgpack = msgspec.msgpack.Encoder()
_json = msgspec.json.Encoder()

command_decoder = msgspec.msgpack.Decoder(ModelCommand)
unit_decoder = msgspec.msgpack.Decoder(Unit)
outcome_decoder = msgspec.msgpack.Decoder(Outcome)
result_decoder = msgspec.msgpack.Decoder(RequestResult)
event_decoder = msgspec.json.Decoder(OperationEvent)
publish_decoder = msgspec.msgpack.Decoder(PublishCommand)
sample_job_decoder = msgspec.msgpack.Decoder(SampleJob)
sequence_record_decoder = msgspec.msgpack.Decoder(SequenceRecord)


def pack(message: Any) -> bytes:
    """Encode a command, unit, outcome or result for the bus."""
    return _msgpack.encode(message)


def to_json(message: Any) -> bytes:
    """Encode an operation event or a KV record."""
    return _json.encode(message)


def from_json(data: bytes, type_: type[T]) -> T:
    return msgspec.json.decode(data, type=type_)
