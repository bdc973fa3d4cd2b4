"""``Store.owned``: a kept record is read from the bus once, and still answers only its owner; an
unknown one is not kept, so it is found once it exists; without ``kept`` every call reads."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import nats.js.errors
import pytest

from libs.contracts import codec, ids
from libs.contracts.common import LoraConfig
from libs.contracts.records import ModelRecord
from services.gateway.http.errors import NotFound
from services.gateway.store import Store

MODEL = "sess-1:train:0"


@dataclass
class Entry:
    value: bytes


@dataclass
class Bucket:
    """The part of a JetStream KV bucket ``Store.get`` uses, counting its reads."""

    values: dict[str, bytes] = field(default_factory=dict)
    reads: int = 0

    async def get(self, key: str) -> Entry:
        self.reads += 1
        if key not in self.values:
            raise nats.js.errors.KeyNotFoundError
        return Entry(self.values[key])


@dataclass
class Bus:
    bucket: Bucket

    async def kv(self, name: str) -> Bucket:
        return self.bucket


def _record(tenant: str) -> ModelRecord:
    return ModelRecord(
        model_id=MODEL,
        tenant=tenant,
        session_id="sess-1",
        base_model="tiny",
        lora=LoraConfig(rank=8),
        created_ns=1,
        create_request_id="r",
    )


def _owned(store: Store, tenant: str, kept: bool) -> Any:
    return asyncio.run(store.owned("tinker_models", MODEL, ModelRecord, tenant, "model", kept=kept))


def test_a_kept_record_is_read_once_and_answers_only_its_owner() -> None:
    assert ids.is_valid_id(MODEL)
    bucket = Bucket({ids.token(MODEL): codec.to_json(_record("alice"))})
    store = Store(Bus(bucket))  # type: ignore[arg-type]
    assert _owned(store, "alice", kept=True).tenant == "alice"
    assert _owned(store, "alice", kept=True).base_model == "tiny"
    assert bucket.reads == 1
    with pytest.raises(NotFound):
        _owned(store, "mallory", kept=True)
    assert bucket.reads == 1


def test_an_unknown_record_is_not_kept_and_unkept_calls_read_every_time() -> None:
    bucket = Bucket()
    store = Store(Bus(bucket))  # type: ignore[arg-type]
    with pytest.raises(NotFound):
        _owned(store, "alice", kept=True)
    bucket.values[ids.token(MODEL)] = codec.to_json(_record("alice"))
    assert _owned(store, "alice", kept=True).tenant == "alice"
    assert bucket.reads == 2
    _owned(store, "alice", kept=False)
    _owned(store, "alice", kept=False)
    assert bucket.reads == 4
