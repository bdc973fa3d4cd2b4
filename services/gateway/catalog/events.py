"""The operation events as the admin views and the console read them: every event the events
stream (`TINKER_EVENTS`) still retains, read on request and handed to `metering`'s folds.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec

from infra.bus import last_seq, replay
from libs.contracts import codec
from libs.contracts import subjects as s
from libs.contracts.events import OperationEvent
from services.gateway.context import Gateway

EVENTS_READ_TIMEOUT_S = 60.0
log = logging.getLogger("tinkerd.gateway.events")


async def read_events(gateway: Gateway) -> list[OperationEvent]:
    """Every operation event still retained, oldest first (kinds this build does not know are skipped)."""
    upto = await last_seq(gateway.bus, s.STREAM_EVENTS)
    events: list[OperationEvent] = []

    def keep(msg: Any) -> None:
        try:
            events.append(codec.event_decoder.decode(msg.data))
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass

    try:
        await asyncio.wait_for(
            replay(gateway.bus, s.STREAM_EVENTS, s.EVENTS_ALL, upto, keep), EVENTS_READ_TIMEOUT_S
        )
    except TimeoutError:  # e.g. the last event expired while being read: answer with what was read
        log.warning("reading the events stream stopped after %.0fs (%d events)", EVENTS_READ_TIMEOUT_S, len(events))
    return events
