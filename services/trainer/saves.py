"""Saves written behind the unit path: one tenant's save never waits for another's file write.

The unit path only copies the slot (``state.checkpoints.prepare``); ``BackgroundSaves`` writes
the files on a thread pool and publishes each save's ``PublishCommand`` once its staging
directory is fsynced, so the save's result and its catalogue entry (the publisher's) never come
before its files. Saves of one model are written and published in the order they ran (a later
save of the same name must not be overtaken by an earlier one); saves of different models run
side by side. At most ``limit`` saves hold their host copies at a time: a unit that would start
one more waits for the oldest (memory stays bounded).

An ephemeral export copied into a handover (services/trainer/handover.py) is published twice:
its handover command at once, before any file (the publisher answers the save with it), and its
files' command once they are fsynced, as every save. The ``Shelf`` keeps the handover readable
until then and a while after.

A crash leaves a save whose unit has an outcome but whose command was never published (or, for
a handover, whose files never were); the trainer's recovery redoes it from the replayed state
(services/trainer/recovery.py), and the service takes no snapshot while a save is being written,
so such a unit is always replayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec

from libs.contracts.publish import PublishCommand
from libs.faults import crash_point
from services.trainer.handover import Shelf
from services.trainer.state import checkpoints

log = logging.getLogger("tinkerd.trainer")

Publish = Callable[[PublishCommand], Awaitable[None]]


class BackgroundSaves:
    def __init__(self, publish: Publish, limit: int, shelf: Shelf | None = None) -> None:
        self._publish = publish
        self._limit = max(1, limit)
        self.shelf = shelf if shelf is not None else Shelf(keep_s=0.0, limit=0)
        self._pool = ThreadPoolExecutor(self._limit, thread_name_prefix="save-writer")
        self._lanes: dict[str, asyncio.Task[None]] = {}  # model id -> its newest save
        self._running: list[asyncio.Task[None]] = []  # every save not finished, oldest first

    @property
    def pending(self) -> int:
        """Saves whose command is not yet published."""
        self._running = [t for t in self._running if not t.done()]
        return len(self._running)

    async def submit(self, save: checkpoints.PendingSave) -> None:
        """Start writing ``save`` (after the same model's earlier saves); returns at once unless
        ``limit`` saves are being written already. A handover is published first, at once."""
        if save.handover is not None:
            self.shelf.hold(save.handover)
            await self._publish_until_sent(msgspec.structs.replace(save.command, handover=save.handover.ref))
            crash_point("trainer.handover_published")  # fault tests: answered, its files not written
        while self.pending >= self._limit:
            await asyncio.wait([self._running[0]])
        previous = self._lanes.get(save.model_id)
        task = asyncio.create_task(self._run(previous, save))
        self._lanes[save.model_id] = task
        self._running.append(task)
        task.add_done_callback(functools.partial(self._retire, save.model_id))

    def _retire(self, model_id: str, task: asyncio.Task[None]) -> None:
        if self._lanes.get(model_id) is task:
            del self._lanes[model_id]

    async def _run(self, previous: asyncio.Task[None] | None, save: checkpoints.PendingSave) -> None:
        if previous is not None:
            with contextlib.suppress(Exception):
                await previous
        try:
            command = await asyncio.get_running_loop().run_in_executor(self._pool, checkpoints.write, save)
        except Exception as exc:  # not the disk's doing (that is an error command): still answer it
            log.exception("writing the files of %s failed", save.command.request_id)
            error = f"saving failed: the trainer could not build the checkpoint files ({type(exc).__name__}: {exc})"
            command = msgspec.structs.replace(save.command, error=error)
        finally:
            save.release()  # the copy is written (or never will be): its buffer serves the next save
        await self._publish_until_sent(command)
        if command.error is None:
            self.shelf.durable(command.request_id)  # a failed write keeps its handover readable
        crash_point("trainer.save_handed_off")  # fault tests: published, the unit's outcome before it

    async def _publish_until_sent(self, command: PublishCommand) -> None:
        while True:
            try:
                await self._publish(command)
                return
            except Exception:  # the bus is away: the command must still go out, once it is back
                log.exception("handing %s to the publisher failed; retrying", command.request_id)
                await asyncio.sleep(1.0)

    async def drain(self) -> None:
        """Wait for every save submitted so far to be published."""
        while self.pending:
            await asyncio.wait(list(self._running))

    def close(self) -> None:
        self._pool.shutdown(wait=False)
