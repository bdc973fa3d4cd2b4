"""The public surface of the official SDK, found by introspection, and a recorder of what was called
and what was checked.

`public_methods(cls)` lists every public callable of a client class (sync methods, their `_async`
variants, static methods). `Recorder.install` wraps each one so that a call, however it is made
(directly or from another SDK method), is recorded as "Class.method" and then runs unchanged.
`Recorder.verify(method, condition)` asserts a condition on what one call returned or changed and
records that `method` was checked: the suite's last test requires every public method to have been
both called and verified, so a method a newer SDK adds fails the suite until a test checks it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest


def public_methods(cls: type) -> list[str]:
    return sorted(
        name for name, value in inspect.getmembers(cls) if not name.startswith("_") and callable(value)
    )


class Recorder:
    def __init__(self, classes: list[type]) -> None:
        self.classes = classes
        self.called: set[str] = set()
        self.verified: set[str] = set()

    def verify(self, method: str, condition: object, what: str = "") -> None:
        """Assert `condition` about a result (or effect) of `method`, and record the check."""
        assert condition, f"{method}: {what or 'the result is not what the call should return'}"
        self.verified.add(method)

    def surface(self) -> set[str]:
        return {f"{cls.__name__}.{name}" for cls in self.classes for name in public_methods(cls)}

    def _wrap(self, qualified: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
                self.called.add(qualified)
                return await fn(*args, **kwargs)

            return wrapped_async

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.called.add(qualified)
            return fn(*args, **kwargs)

        return wrapped

    @contextmanager
    def install(self) -> Iterator[Recorder]:
        with pytest.MonkeyPatch.context() as patch:
            for cls in self.classes:
                for name in public_methods(cls):
                    raw = inspect.getattr_static(cls, name)
                    qualified = f"{cls.__name__}.{name}"
                    if isinstance(raw, staticmethod):
                        patch.setattr(cls, name, staticmethod(self._wrap(qualified, raw.__func__)))
                    elif isinstance(raw, classmethod):
                        patch.setattr(cls, name, classmethod(self._wrap(qualified, raw.__func__)))
                    else:
                        patch.setattr(cls, name, self._wrap(qualified, getattr(cls, name)))
            yield self
