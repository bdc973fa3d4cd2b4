"""`answer` appends a future's one result and its event; a second answer of the same future (a
replay, a redelivered job) changes nothing, not even the event log."""

from __future__ import annotations

import asyncio

from infra.answers import Announce, answer
from infra.bus import Bus, last_seq
from infra.natsd import NatsServer
from infra.streams import ensure_streams
from libs.contracts import codec
from libs.contracts import subjects as s
from libs.contracts.results import Failure, OptimStepResponse, RequestResult, ResultBody


async def answer_step(bus: Bus, seq_id: int, body: ResultBody, announce: Announce) -> bool:
    return await answer(
        bus,
        kind="optim_step",
        body=body,
        tenant="t1",
        model_id="m",
        request_id=f"m:{seq_id}",
        seq_id=seq_id,
        announce=announce,
    )


def test_a_future_is_answered_once_with_one_event_and_a_second_answer_has_no_effect(
    nats_server: NatsServer,
) -> None:
    async def main() -> tuple[list[bool], RequestResult, list[str | None]]:
        bus = await Bus.connect(nats_server.url, "test-answers")
        try:
            await ensure_streams(bus.js)
            appended = [
                await answer_step(bus, 1, OptimStepResponse(metrics={"n": 1.0}), "now"),
                await answer_step(bus, 1, Failure(error="late", category="server"), "now"),
                await answer_step(bus, 2, Failure(error="cancelled", category="user"), "none"),
            ]
            stored = await bus.js.get_last_msg(s.STREAM_RESULTS, s.result_subject("m:1"))
            events = [
                (await bus.js.get_msg(s.STREAM_EVENTS, seq)).subject
                for seq in range(1, await last_seq(bus, s.STREAM_EVENTS) + 1)
            ]
            return appended, codec.result_decoder.decode(stored.data or b""), events
        finally:
            await bus.close()

    appended, first, events = asyncio.run(main())
    assert appended == [True, False, True]
    assert first.body == OptimStepResponse(metrics={"n": 1.0}) and first.request_id == "m:1"
    assert events == [s.event_subject("completed", "m")]  # none for the refused answer, none asked for m:2
