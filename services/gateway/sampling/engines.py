"""The sampling engines as the gateway sees them: which one serves a sample, and what it holds.

Adapters reach the engines on demand. A sampler export is a directory on disk; nothing is
pushed to an engine when it is saved. An ephemeral export whose files are not recorded yet has a
handover instead (the trainer's memory, libs/contracts/publish.py), which the engine loads
through `/load_lora_adapter_from_tensors`; once the directory is recorded, it serves. The sample
path makes sure the engine that serves the sample holds the export's adapter
(`/load_lora_adapter` when it is missing), so an engine that restarted, or a new one, serves
every existing export without anyone re-publishing it:

- `Residency` tracks the adapters one engine holds on this replica's behalf, least recently used
  first. It loads a missing adapter once however many samples ask for it at the same time, and
  keeps at most `capacity` adapters on the engine: past that it unloads the least recently used
  one that no sample of this replica is using (`/unload_lora_adapter`). Adapters the engine
  reports that lie under the data root but that this replica did not load (left by a replica that
  restarted, or loaded by another one) count against the same limit and go first.
- `EnginePool` picks the engine for an adapter by rendezvous hashing (the same engine for the
  same adapter while it is up, another one when it is not), answers "the engine does not hold this
  adapter" by loading it and trying again, and, when no engine can be reached, lets callers wait
  for one to come back (a single probe loop shared by every waiter).

Engines are checked before use (`Engine`): an address (a URL, or `file://PATH` of the address a
local engine announces: infra/net.py) gets work only once it answered `/health` and its
`/get_model_info` names the pool's base model; anything else (nothing there, a process that
does not speak HTTP, another server, another model) counts as unavailable, with that reason. An
engine that keeps failing has a `failing_for_s` the sample path bounds its wait with.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from infra.net import announced_path, resolve_address
from infra.stack_state import UP, ServiceState, describe, read_state
from libs.contracts.publish import AdapterHandover
from services.gateway.sampling import sglang

log = logging.getLogger("tinkerd.gateway.engines")
MISSING_RETRIES = 3
"""How often one sample loads its adapter again after the engine said it does not hold it."""
PROBE_FIRST_S = 0.25
PROBE_MAX_S = 1.0


@dataclass(frozen=True, slots=True)
class Adapter:
    """A sampler export as the engines know it: its engine-side name, its directory, and, before
    the directory is recorded, its handover."""

    name: str
    directory: str | None  # None: not recorded yet, or only the name is known
    handover: AdapterHandover | None = None


def rendezvous(urls: list[str], key: str) -> list[str]:
    """`urls` in the order `key` prefers them (highest random weight first); stable per key."""

    def weight(url: str) -> bytes:
        return hashlib.sha256(f"{url}\0{key}".encode()).digest()

    return sorted(urls, key=weight, reverse=True)


class Engine:
    """One sampling engine: where it is, whether that address was checked, since when it fails.

    `address` is a URL or `file://PATH` (resolved on every use: a restarted engine may announce
    another address). `names` are the base model's names its `/get_model_info` must match (empty:
    any generation model). `state_file`: the supervisor's stack state, whose record of the child
    that announces at PATH (`sampler` for `run/sampler.addr`) adds how that child fails and
    since when."""

    def __init__(
        self,
        address: str,
        names: tuple[str, ...] = (),
        probe_timeout_s: float = sglang.HEALTH_TIMEOUT_S,
        state_file: Path | None = None,
    ) -> None:
        self.address = address
        self.names = names
        self.probe_timeout_s = probe_timeout_s
        self.state_file = state_file
        self.checked: str | None = None  # the URL that passed the check (re-checked when it changes)
        self.failing_since: float | None = None  # time.time() of the first failure in a row
        self.reason = ""
        self._lock = asyncio.Lock()

    def url(self) -> str:
        """Where the engine is now.

        Raises:
            sglang.EngineUnavailable: a local engine that has announced no address (not started).
        """
        url = resolve_address(self.address)
        if url is None:
            raise sglang.EngineUnavailable(
                self.address, f"no address announced at {announced_path(self.address)} (not started)"
            )
        return url

    async def ready_url(self, client: httpx.AsyncClient, recheck: bool = False) -> str:
        """The engine's URL, once checked to answer as a sampling engine of the base model.

        Raises:
            sglang.EngineUnavailable: it does not (the reason is kept, see `failed`).
        """
        try:
            url = self.url()
            if self.checked == url and not recheck:
                return url
            async with self._lock:
                if self.checked != url or recheck:
                    await sglang.check_engine(client, url, self.names, self.probe_timeout_s)
                    if self.checked != url:
                        log.info("sampling engine %s answers as a sampling engine at %s", self.address, url)
                    self.checked = url
        except sglang.EngineUnavailable as exc:
            self.failed(exc)
            raise
        self.succeeded()
        return url

    def failed(self, exc: sglang.EngineUnavailable) -> None:
        """A call or a check failed: check the address again before the next work."""
        self.checked = None
        self.reason = exc.reason
        if self.failing_since is None:
            self.failing_since = time.time()

    def succeeded(self) -> None:
        self.failing_since = None
        self.reason = ""

    def _child(self) -> tuple[str, ServiceState] | None:
        """(name, state) of the supervised child that announces this engine's address, if any."""
        path = announced_path(self.address)
        stack = read_state(self.state_file) if path is not None and self.state_file is not None else None
        if stack is None or path is None:
            return None
        service = stack.services.get(path.stem)
        return (path.stem, service) if service is not None else None

    def failing_for_s(self) -> float:
        """How long it has been failing (0: it is not), counting from when its supervisor first
        saw it fail, when that was earlier."""
        if self.failing_since is None:
            return 0.0
        since = self.failing_since
        child = self._child()
        if child is not None and child[1].state != UP and child[1].failing_since_ns:
            since = min(since, child[1].failing_since_ns / 1e9)
        return max(0.0, time.time() - since)

    def describe_failure(self) -> str:
        """`ADDRESS: reason` (and the supervisor's account of its process, when it has one)."""
        text = f"{self.address}: {self.reason or 'unavailable'}"
        child = self._child()
        if child is not None and child[1].state != UP:
            text += f"; supervisor: {describe(*child)}"
        return text


class Residency:
    """The adapters one engine holds for this replica, LRU-bounded (see the module docstring)."""

    def __init__(self, client: httpx.AsyncClient, engine: Engine, capacity: int, data_root: Path) -> None:
        self.client = client
        self.engine = engine
        self.capacity = capacity
        self.data_root = data_root
        self.resident: OrderedDict[str, str] = OrderedDict()  # name -> directory, least recent first
        self.foreign: dict[str, str] = {}  # ours by directory, on the engine, not loaded by this replica
        self.users: Counter[str] = Counter()  # samples of this replica using each adapter now
        self._loading: dict[str, asyncio.Future[None]] = {}
        self._trimming: asyncio.Task[None] | None = None
        self.loads = 0
        self.unloads = 0

    @contextlib.asynccontextmanager
    async def use(self, adapter: Adapter) -> AsyncIterator[None]:
        """Hold `adapter` on the engine for the duration of one `/generate`."""
        self.users[adapter.name] += 1
        try:
            if adapter.directory is not None or adapter.handover is not None:
                await self._ensure(adapter)
            yield
        finally:
            self.users[adapter.name] -= 1
            if self.users[adapter.name] <= 0:
                del self.users[adapter.name]
            self._schedule_trim()

    def forget(self, name: str) -> None:
        """The engine said it does not hold `name` (it restarted or evicted it)."""
        self.resident.pop(name, None)

    async def _ensure(self, adapter: Adapter) -> None:
        name = adapter.name
        if name in self.resident:
            self.resident.move_to_end(name)
            return
        pending = self._loading.get(name)
        if pending is None:
            pending = asyncio.ensure_future(self._load(adapter))
            self._loading[name] = pending
        await asyncio.shield(pending)  # a cancelled sample does not cancel a load others wait for

    @property
    def url(self) -> str:
        return self.engine.url()

    async def _load(self, adapter: Adapter) -> None:
        started = time.perf_counter()
        name = adapter.name
        try:
            if adapter.directory is not None:
                reported = await sglang.load_adapter(self.client, self.url, name, adapter.directory)
            else:
                assert adapter.handover is not None
                reported = await sglang.load_adapter_from_tensors(self.client, self.url, name, adapter.handover)
            self.loads += 1
            self.resident[name] = adapter.directory or ""
            self.resident.move_to_end(name)
            if reported is not None and name in reported:  # a report without it cannot be trusted
                self._reconcile(reported)
            log.info(
                "loaded adapter %s into %s %s in %.0f ms (%d held)",
                name,
                self.engine.address,
                "from its files" if adapter.directory is not None else "from the trainer's memory",
                (time.perf_counter() - started) * 1e3,
                len(self.resident),
            )
        finally:
            del self._loading[name]

    def _reconcile(self, reported: dict[str, str]) -> None:
        """Align with what the engine says it holds after a load."""
        for name in [n for n in self.resident if n not in reported]:
            del self.resident[name]  # gone from the engine (restart, or SGLang's own eviction)
        self.foreign = {
            name: path for name, path in reported.items() if name not in self.resident and self._ours(path)
        }

    def _ours(self, path: str) -> bool:
        try:
            return Path(path).resolve().is_relative_to(self.data_root)
        except (OSError, ValueError):
            return False

    async def settled(self) -> None:
        """Return once no unload is in progress (tests; shutdown)."""
        while self._trimming is not None and not self._trimming.done():
            await asyncio.shield(self._trimming)

    def _schedule_trim(self) -> None:
        if len(self.resident) + len(self.foreign) <= self.capacity:
            return
        if self._trimming is None or self._trimming.done():
            self._trimming = asyncio.create_task(self._trim())

    def _victim(self) -> str | None:
        if self.foreign:
            return next(iter(self.foreign))
        return next((n for n in self.resident if not self.users[n] and n not in self._loading), None)

    async def _trim(self) -> None:
        """Unload until at most `capacity` are held; adapters in use here are never chosen."""
        while len(self.resident) + len(self.foreign) > self.capacity:
            victim = self._victim()
            if victim is None:
                return  # every adapter is in use: the next release trims again
            self.resident.pop(victim, None)
            self.foreign.pop(victim, None)
            try:
                await sglang.unload_adapter(self.client, self.url, victim)
            except (sglang.EngineError, sglang.EngineUnavailable) as exc:
                log.warning("could not unload adapter %s from %s: %s", victim, self.engine.address, exc)
                return
            self.unloads += 1
            log.info("unloaded adapter %s from %s (least recently used)", victim, self.engine.address)


class EnginePool:
    """Every engine this gateway samples through (see the module docstring)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        urls: list[str],
        capacity: int,
        data_root: Path,
        model_names: tuple[str, ...] = (),
        probe_timeout_s: float = sglang.HEALTH_TIMEOUT_S,
        state_file: Path | None = None,
    ) -> None:
        """`urls`: engine addresses (URLs or `file://PATH`); `model_names`: the base model's
        names their `/get_model_info` must match (see `Engine`)."""
        if not urls:
            raise ValueError("at least one sampling engine URL is needed")
        if capacity < 1:
            raise ValueError(f"max_loaded_adapters must be >= 1, got {capacity}")
        self.client = client
        self.urls = urls
        self.engines = {url: Engine(url, model_names, probe_timeout_s, state_file) for url in urls}
        self.residency = {url: Residency(client, self.engines[url], capacity, data_root) for url in urls}
        self.waiting = 0  # samples waiting for an engine to come back, for metrics
        self._back = asyncio.Event()
        self._probe: asyncio.Task[None] | None = None
        self._delay = PROBE_FIRST_S  # grows while engines stay unusable; reset by a served sample

    def order(self, adapter: Adapter | None) -> list[str]:
        return rendezvous(self.urls, adapter.name if adapter else "")

    async def generate(self, body: dict[str, Any], adapter: Adapter | None) -> list[sglang.Output]:
        """`/generate` on the first engine (in the adapter's order) that can be reached.

        Raises:
            sglang.EngineUnavailable: no engine could be reached (the last one's reason).
            sglang.EngineError: an engine refused the request.
        """
        unavailable: sglang.EngineUnavailable | None = None
        for address in self.order(adapter):
            engine = self.engines[address]
            try:
                url = await engine.ready_url(self.client)
                outputs = await self._generate_on(address, url, body, adapter)
            except sglang.EngineUnavailable as exc:
                engine.failed(exc)
                unavailable = exc
                continue
            self._delay = PROBE_FIRST_S
            return outputs
        assert unavailable is not None
        raise unavailable

    def failing_for_s(self) -> float:
        """How long every engine of the pool has been failing (0: one of them is not)."""
        return min(engine.failing_for_s() for engine in self.engines.values())

    def describe_failures(self) -> str:
        return "; ".join(engine.describe_failure() for engine in self.engines.values())

    async def check(self) -> str | None:
        """Check every engine now; None when one serves, else why none does."""
        for engine in self.engines.values():
            with contextlib.suppress(sglang.EngineUnavailable):
                await engine.ready_url(self.client, recheck=True)
                return None
        return self.describe_failures()

    async def _generate_on(
        self, address: str, url: str, body: dict[str, Any], adapter: Adapter | None
    ) -> list[sglang.Output]:
        if adapter is None:
            return await sglang.generate(self.client, url, body)
        residency = self.residency[address]
        request = {**body, "lora_path": adapter.name}
        for attempt in range(MISSING_RETRIES + 1):
            async with residency.use(adapter):
                try:
                    return await sglang.generate(self.client, url, request)
                except sglang.EngineError as exc:
                    loadable = adapter.directory is not None or adapter.handover is not None
                    if not sglang.adapter_missing(exc) or not loadable or attempt == MISSING_RETRIES:
                        raise
                    residency.forget(adapter.name)
                    log.info("%s does not hold adapter %s: loading it again", url, adapter.name)
        raise AssertionError("unreachable")

    async def wait_available(self, timeout_s: float) -> bool:
        """Wait until some engine passes its check (`Engine.ready_url`); False after `timeout_s`."""
        if self._probe is None or self._probe.done():
            self._back = asyncio.Event()
            self._probe = asyncio.create_task(self._probe_until_back(self._back))
        self.waiting += 1
        try:
            await asyncio.wait_for(self._back.wait(), max(0.0, timeout_s))
            return True
        except TimeoutError:
            return False
        finally:
            self.waiting -= 1

    async def _probe_until_back(self, back: asyncio.Event) -> None:
        """Check every engine, with backoff, until one passes.

        The backoff is not reset when an engine answers: one that is healthy but still cannot
        serve (502/503 from `/generate`) is retried ever more slowly, not in a tight loop.
        """
        while True:
            await asyncio.sleep(self._delay)  # backoff between probes of engines that are down
            self._delay = min(PROBE_MAX_S, self._delay * 1.5)
            if await self.check() is None:
                log.info("a sampling engine of %s answers again", ", ".join(self.urls))
                back.set()
                return

    async def close(self) -> None:
        tasks = [self._probe] if self._probe is not None else []
        tasks += [r._trimming for r in self.residency.values() if r._trimming is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
