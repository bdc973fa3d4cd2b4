"""What the streams of a faulted stack say: applied twice or not, and a trigger on the n-th event.

`exactly_once` reads the streams back: no result appended twice (the results stream replaces a
subject's message, so a second append shows as a gap between its last sequence and its message
count), no unit planned twice, no unit with two outcomes (a unit the trainer ran twice live).
`EventTrigger` runs a fault action when the n-th operation event of a kind is published.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from infra.bus import Bus, replay
from libs.contracts import codec
from libs.contracts import subjects as s


@dataclass
class ExactlyOnce:
    """What the streams of a run say was applied twice (every field must be 0)."""

    results_replaced: int  # a request's result appended again (results keep one per subject)
    units_planned_twice: int  # a unit id appended to the work stream more than once
    units_with_two_outcomes: int  # a unit the trainer ran (and reported) twice
    examples: dict[str, list[int]] = field(default_factory=dict)  # "stream unit_id" -> sequences

    @property
    def clean(self) -> bool:
        return not (self.results_replaced or self.units_planned_twice or self.units_with_two_outcomes)


async def _exactly_once(nats_url: str, injected: set[tuple[str, int]]) -> ExactlyOnce:
    bus = await Bus.connect(nats_url, "fault-check")
    try:
        results = await bus.js.stream_info(s.STREAM_RESULTS)
        counts: dict[str, Counter[str]] = {s.STREAM_WORK: Counter(), s.STREAM_OUTCOMES: Counter()}
        where: dict[str, list[int]] = {}
        for stream, subject in ((s.STREAM_WORK, s.WORK_ALL), (s.STREAM_OUTCOMES, s.OUTCOMES_ALL)):
            info = await bus.js.stream_info(stream)

            def count(msg, stream: str = stream) -> None:  # type: ignore[no-untyped-def]
                if (stream, msg.metadata.sequence.stream) in injected:
                    return  # a copy the test appended on purpose
                decoder = codec.unit_decoder if stream == s.STREAM_WORK else codec.outcome_decoder
                unit_id = decoder.decode(msg.data).unit_id
                counts[stream][unit_id] += 1
                where.setdefault(f"{stream} {unit_id}", []).append(msg.metadata.sequence.stream)

            await replay(bus, stream, subject, info.state.last_seq, count)
        twice = {name: sum(1 for n in c.values() if n > 1) for name, c in counts.items()}
        return ExactlyOnce(
            results_replaced=results.state.last_seq - results.state.messages,
            units_planned_twice=twice[s.STREAM_WORK],
            units_with_two_outcomes=twice[s.STREAM_OUTCOMES],
            examples={key: seqs for key, seqs in where.items() if len(seqs) > 1},
        )
    finally:
        await bus.close()


def exactly_once(nats_url: str, injected: set[tuple[str, int]] | None = None) -> ExactlyOnce:
    return asyncio.run(_exactly_once(nats_url, injected or set()))


@dataclass
class EventTrigger:
    """Calls `action` once, from a background thread, when the n-th event of `kind` is seen."""

    nats_url: str
    kind: str
    n: int
    action: Callable[[], None]
    fired: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    counts: Counter[str] = field(default_factory=Counter)
    error: BaseException | None = None
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> EventTrigger:
        subscribed = threading.Event()

        async def main() -> None:
            bus = await Bus.connect(self.nats_url, "fault-trigger")

            async def on_event(msg) -> None:  # type: ignore[no-untyped-def]
                kind = msg.subject.split(".")[2]
                self.counts[kind] += 1
                if kind == self.kind and self.counts[kind] == self.n:
                    threading.Thread(target=self._fire, daemon=True).start()

            await bus.nc.subscribe(s.EVENTS_ALL, cb=on_event)
            await bus.nc.flush()
            subscribed.set()
            await asyncio.get_running_loop().run_in_executor(None, self._stop.wait)
            await bus.close()

        self._thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
        self._thread.start()
        subscribed.wait(30)
        return self

    def _fire(self) -> None:
        self.fired.set()
        try:
            self.action()
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)
