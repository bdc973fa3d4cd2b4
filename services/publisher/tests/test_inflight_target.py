"""A model's inflight target only moves forward: a save with a lower seq_id (a publication
redelivered after a newer one) never replaces a newer one, on a real nats-server."""

from __future__ import annotations

import asyncio
from pathlib import Path

from infra.bus import Bus
from infra.natsd import start_nats
from infra.streams import ensure_streams
from libs.contracts import codec, ids
from libs.contracts import subjects as s
from libs.contracts.records import InflightTarget
from services.publisher.service import advance_inflight

MODEL = "sess-1:train:0"


def target(seq_id: int) -> InflightTarget:
    return InflightTarget(
        model_id=MODEL,
        seq_id=seq_id,
        sampler_id=f"sess-1:sample:{seq_id}",
        adapter_name=f"adapter-{seq_id}",
        adapter_dir=f"/data/samplers/{seq_id}",
    )


def test_the_inflight_target_moves_only_to_newer_saves(tmp_path: Path) -> None:
    server = start_nats(tmp_path / "nats")

    async def main() -> tuple[list[bool], InflightTarget]:
        bus = await Bus.connect(server.url, "test-inflight")
        try:
            await ensure_streams(bus.js)
            moved = [await advance_inflight(bus, target(seq)) for seq in (3, 7, 5, 7)]
            entry = await (await bus.kv(s.KV_INFLIGHT)).get(ids.token(MODEL))
            assert entry.value is not None
            return moved, codec.from_json(entry.value, InflightTarget)
        finally:
            await bus.close()

    try:
        moved, stored = asyncio.run(main())
    finally:
        server.stop()
    assert moved == [True, True, False, True]  # the second 7 is the same save again
    assert (stored.seq_id, stored.adapter_name) == (7, "adapter-7")
