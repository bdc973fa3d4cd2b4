"""The adapter registry under concurrent registrations (pure: loaders are stand-ins)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.sampler.lora import AdapterError, AdapterRegistry, LoadedAdapter

WAIT_S = 30.0


def adapter(name: str) -> LoadedAdapter:
    return LoadedAdapter(name=name, path=f"/a/{name}", rank=4, modules={})


def test_one_adapters_slow_load_does_not_hold_up_another_adapters_registration() -> None:
    """While "slow" is still loading, "fast" registers, is resident and served; "slow" then
    completes too."""
    release = threading.Event()
    started = threading.Event()

    def loader(name: str, path: str) -> LoadedAdapter:
        if name == "slow":
            started.set()
            assert release.wait(WAIT_S), "the test never released the slow load"
        return adapter(name)

    registry = AdapterRegistry(loader, capacity=4)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(registry.register, "slow", "/a/slow")
        assert started.wait(WAIT_S)
        registry.register("fast", "/a/fast")  # returns while "slow" is held in its loader
        assert registry.get("fast").name == "fast"
        assert not slow.done()
        release.set()
        slow.result(WAIT_S)
    assert set(registry.paths()) == {"slow", "fast"}


def test_a_second_registration_of_a_name_being_loaded_waits_for_it_and_then_says_it_is_loaded() -> None:
    release = threading.Event()
    started = threading.Event()
    loads: list[str] = []

    def loader(name: str, path: str) -> LoadedAdapter:
        loads.append(name)
        started.set()
        assert release.wait(WAIT_S)
        return adapter(name)

    registry = AdapterRegistry(loader, capacity=4)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(registry.register, "a", "/a/a")
        assert started.wait(WAIT_S)
        second = pool.submit(registry.register, "a", "/a/a")
        release.set()
        first.result(WAIT_S)
        with pytest.raises(AdapterError, match="already loaded"):
            second.result(WAIT_S)
    assert loads == ["a"], "the name was loaded twice"


def test_a_failed_registration_leaves_nothing_and_the_name_can_be_registered_again() -> None:
    attempts: list[int] = []

    def loader(name: str, path: str) -> LoadedAdapter:
        attempts.append(1)
        if len(attempts) == 1:
            raise AdapterError("bad adapter")
        return adapter(name)

    registry = AdapterRegistry(loader, capacity=4)
    with pytest.raises(AdapterError, match="bad adapter"):
        registry.register("a", "/a/a")
    assert registry.paths() == {}
    registry.register("a", "/a/a")
    assert registry.get("a").name == "a"
