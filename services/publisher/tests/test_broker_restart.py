"""A broker that stops answering in the middle of a publication is not a full disk: the publisher
publishes again once the broker is back, and the save succeeds (a real nats-server, killed and
started again on its port and store while the publisher is between its disk steps)."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import msgspec
import pytest

from infra.bus import Bus
from infra.natsd import start_nats
from infra.streams import ensure_streams
from libs.checkpoints import layout
from libs.contracts import codec, ids
from libs.contracts import subjects as s
from libs.contracts.common import LoraConfig
from libs.contracts.publish import PublishCommand
from libs.contracts.records import CheckpointRecord
from libs.contracts.results import SaveWeightsResponse
from libs.faults import fired, hits, release
from services.publisher.config import PublisherConfig
from services.publisher.service import PublisherService
from tests.faults.holds import WAIT_S, wait_for

POINT = "publisher.checkpoint_write"  # the test names its process the publisher (TINKERD_SERVICE)
MODEL = "sess-1:train:0"
PATH = ids.tinker_path("run-1", "training", "first")


class Retried(logging.Handler):
    """Set once the publisher logs that the broker did not answer and it will publish again."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "the broker did not answer" in record.getMessage():
            self.seen.set()


def test_a_save_whose_publication_the_broker_interrupted_is_published_once_it_is_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    faults = tmp_path / "faults"
    hold = f"{POINT}@{hits(POINT) + 1}:hold"  # the first staged file this process links
    monkeypatch.setenv("TINKERD_SERVICE", "publisher")
    monkeypatch.setenv("TINKERD_FAULT_POINTS", hold)
    monkeypatch.setenv("TINKERD_FAULT_DIR", str(faults))
    data_dir = tmp_path / "data"
    staging = layout.staging_dir(data_dir, "u1", f"{MODEL}:save")
    staging.mkdir(parents=True)  # the trainer's staged files (written plainly: not a fault point)
    (staging / "adapter.safetensors").write_bytes(b"x" * 64)
    (staging / "state.json").write_bytes(b"{}")
    command = PublishCommand(
        kind="training",
        staging_dir=str(staging),
        base_model="tiny-qwen3",
        lora=LoraConfig(rank=2),
        tinker_path=PATH,
        version="u1",
        model_id=MODEL,
        request_id=f"{MODEL}:1",
        tenant="t",
    )
    retried = Retried()
    logging.getLogger("tinkerd.publisher").addHandler(retried)
    server = start_nats(tmp_path / "nats")
    port = int(server.url.rsplit(":", 1)[1])

    async def main() -> tuple[object, CheckpointRecord]:
        nonlocal server
        bus = await Bus.connect(server.url, "test-publisher")
        stop = asyncio.Event()
        publisher = PublisherService(bus, PublisherConfig(nats_url=server.url, data_dir=str(data_dir)))
        try:
            await ensure_streams(bus.js)
            await publisher.ensure_consumer()
            running = asyncio.create_task(publisher.run(stop))
            await bus.publish(s.publish_subject(MODEL), codec.pack(command), msg_id=command.request_id)
            # the publisher is linking the staged files: the broker goes away, then the disk step ends
            await asyncio.to_thread(wait_for, lambda: fired(hold, faults), "the hold of the publication")
            server.kill()
            release(hold, faults)
            await asyncio.to_thread(wait_for, retried.seen.is_set, "the publisher's retry")
            server = start_nats(tmp_path / "nats", port=port)  # same port and store: clients reconnect
            result = None
            for _ in range(int(WAIT_S / 0.05)):
                try:
                    msg = await bus.js.get_last_msg(s.STREAM_RESULTS, s.result_subject(command.request_id))
                except Exception:  # not there yet, or the client is still reconnecting
                    await asyncio.sleep(0.05)
                    continue
                assert msg.data is not None
                result = codec.result_decoder.decode(msg.data)
                break
            assert result is not None, "the save was never answered"
            entry = await (await bus.kv(s.KV_CHECKPOINTS)).get(ids.TinkerPath.parse(PATH).key)
            assert entry.value is not None
            stop.set()
            await running
            return result.body, codec.from_json(entry.value, CheckpointRecord)
        finally:
            await bus.close()

    try:
        body, record = asyncio.run(main())
    finally:
        server.stop()
        logging.getLogger("tinkerd.publisher").removeHandler(retried)
    assert isinstance(body, SaveWeightsResponse), msgspec.json.encode(body)
    assert body.path == PATH
    assert record.tinker_path == PATH
    public = layout.public_path(data_dir, "run-1", "training", "first")
    assert (public / "adapter.safetensors").read_bytes() == b"x" * 64
