"""Typed access to the KV buckets the gateway reads and writes (sessions, models, samplers, ...).

Creation uses KV `create`, which succeeds for exactly one writer: that is how concurrent gateway
replicas agree on identities without a lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol, TypeVar

import msgspec
import nats.js.errors

from infra.bus import Bus, kv_scan
from libs.contracts import codec, ids
from services.gateway.http.errors import NotFound

T = TypeVar("T")

KEPT_RECORDS = 50_000
"""At most this many records are kept by `Store.get(.., kept=True)` (a few hundred bytes each)."""


class HasTenant(Protocol):
    tenant: str


R = TypeVar("R", bound=HasTenant)
S = TypeVar("S", bound=msgspec.Struct)


class Store:
    def __init__(self, bus: Bus) -> None:
        self._bus = bus
        self._kept: OrderedDict[tuple[str, str], object] = OrderedDict()  # (bucket, key) -> record: see `get`

    async def get(self, bucket: str, key: str, type_: type[T], *, kept: bool = False) -> T | None:
        """The record at `key`, or None. With `kept`, a record once found is kept for the process
        and answered without a read: only for records that are never deleted, by callers that
        read only the fields fixed when the record was created (an owner, a base model, a rank),
        never the ones that change later."""
        if kept and (found := self._kept.get((bucket, key))) is not None:
            return found  # type: ignore[return-value]
        kv = await self._bus.kv(bucket)
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        record = codec.from_json(entry.value, type_)
        if kept:
            self._kept[(bucket, key)] = record
            if len(self._kept) > KEPT_RECORDS:
                self._kept.popitem(last=False)  # the oldest is read again when it is next asked for
        return record

    async def owned(
        self, bucket: str, record_id: str, type_: type[R], tenant_id: str, what: str, *, kept: bool = False
    ) -> R:
        """The record if it exists and belongs to `tenant_id`; 404 otherwise (`kept`: see `get`).

        Unknown and foreign are the same answer on purpose: existence is never leaked.
        """
        record = None
        if ids.is_valid_id(record_id):
            record = await self.get(bucket, ids.token(record_id), type_, kept=kept)
        if record is None or record.tenant != tenant_id:
            raise NotFound(f"{what} {record_id!r} not found")
        return record

    async def create(self, bucket: str, key: str, record: T, type_: type[T]) -> tuple[bool, T]:
        """Create `key` if absent. Returns (created, the record now stored)."""
        kv = await self._bus.kv(bucket)
        try:
            await kv.create(key, codec.to_json(record))
            return True, record
        except nats.js.errors.KeyWrongLastSequenceError:
            existing = await self.get(bucket, key, type_)
            if existing is None:  # deleted in between: try once more
                await kv.create(key, codec.to_json(record))
                return True, record
            return False, existing

    async def put(self, bucket: str, key: str, record: msgspec.Struct) -> None:
        kv = await self._bus.kv(bucket)
        await kv.put(key, codec.to_json(record))

    async def delete(self, bucket: str, key: str) -> None:
        kv = await self._bus.kv(bucket)
        try:
            await kv.delete(key)
        except nats.js.errors.KeyNotFoundError:
            pass

    async def keys(self, bucket: str) -> list[str]:
        return list(await kv_scan(self._bus, bucket))

    async def scan(self, bucket: str, type_: type[T], prefix: str = "") -> list[tuple[str, T]]:
        """Every live (key, record) of `bucket` whose key starts with `prefix`, in one pass."""
        entries = await kv_scan(self._bus, bucket)
        return [
            (key, codec.from_json(value, type_)) for key, value in entries.items() if key.startswith(prefix)
        ]

    async def update(
        self, bucket: str, key: str, type_: type[S], change: Callable[[S], S | None]
    ) -> S | None:
        """Read-modify-write with compare-and-set; None when the key is absent (or `change` says so)."""
        kv = await self._bus.kv(bucket)
        while True:
            try:
                entry = await kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                return None
            if entry.value is None:
                return None
            changed = change(codec.from_json(entry.value, type_))
            if changed is None:
                return None
            try:
                await kv.update(key, codec.to_json(changed), last=entry.revision)
                return changed
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
