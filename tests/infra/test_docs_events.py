"""docs/events.md stays in step with the bus message Structs in libs/contracts/.

- every tagged Struct of requests, work, outcomes, results, events and publish commands is mentioned by
  its tag, in a section headed ``### `tag` · ClassName``;
- every Struct of those modules, of common.py and of records.py has a section listing each of its
  own fields (envelope fields are listed once, under Envelope);
- no heading names a tag or a class that no longer exists.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import msgspec
import pytest

from libs.contracts.common import Envelope

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "events.md"
TAGGED_MODULES = ("requests", "work", "outcomes", "results", "events", "publish", "sampling")
"""The message families: every tagged Struct in them must be documented by its tag."""
FIELD_MODULES = ("common", *TAGGED_MODULES, "records")
"""Modules whose every Struct (tagged or not) has a section listing all its fields."""
HEADING = re.compile(r"^(#{2,4}) (.+?)\s*$", re.MULTILINE)
TAGGED_HEADING = re.compile(r"^`([a-z_]+)` · (\w+)$")


def structs(module_name: str) -> list[type[msgspec.Struct]]:
    module = importlib.import_module(f"libs.contracts.{module_name}")
    return [
        cls
        for cls in vars(module).values()
        if inspect.isclass(cls) and issubclass(cls, msgspec.Struct) and cls.__module__ == module.__name__
    ]


def tag_of(cls: type[msgspec.Struct]) -> str | None:
    tag = cls.__struct_config__.tag
    return None if tag is None else str(tag)


def sections() -> dict[str, str]:
    """Heading text -> the text up to the next heading."""
    text = DOC.read_text()
    found: dict[str, str] = {}
    matches = list(HEADING.finditer(text))
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        found[match.group(2)] = text[match.end() : end]
    return found


def section_of(cls: type[msgspec.Struct], docs: dict[str, str]) -> str | None:
    tag = tag_of(cls)
    title = f"`{tag}` · {cls.__name__}" if tag is not None else cls.__name__
    return docs.get(title)


def own_fields(cls: type[msgspec.Struct]) -> list[str]:
    inherited = (
        set(Envelope.__struct_fields__) if issubclass(cls, Envelope) and cls is not Envelope else set()
    )
    return [name for name in cls.__struct_fields__ if name not in inherited]


@pytest.mark.parametrize(
    "cls",
    [cls for module in TAGGED_MODULES for cls in structs(module) if tag_of(cls) is not None],
    ids=lambda cls: cls.__name__,
)
def test_every_tagged_struct_is_documented_by_its_tag(cls: type[msgspec.Struct]) -> None:
    tag = tag_of(cls)
    assert f"`{tag}`" in DOC.read_text(), f"docs/events.md never mentions the tag `{tag}` of {cls.__name__}"
    assert section_of(cls, sections()) is not None, (
        f"docs/events.md needs a section headed: ### `{tag}` · {cls.__name__}"
    )


@pytest.mark.parametrize(
    "cls",
    [cls for module in FIELD_MODULES for cls in structs(module)],
    ids=lambda cls: cls.__name__,
)
def test_documented_structs_list_all_their_fields(cls: type[msgspec.Struct]) -> None:
    body = section_of(cls, sections())
    title = f"`{tag_of(cls)}` · {cls.__name__}" if tag_of(cls) is not None else cls.__name__
    assert body is not None, f"docs/events.md needs a section headed: ### {title}"
    missing = [name for name in own_fields(cls) if f"`{name}`" not in body]
    assert not missing, f"docs/events.md, section of {cls.__name__}: fields not listed: {missing}"


def test_headings_name_only_existing_structs() -> None:
    known = {cls.__name__: tag_of(cls) for module in FIELD_MODULES for cls in structs(module)}
    for title in sections():
        match = TAGGED_HEADING.match(title)
        if match is None:
            continue
        tag, name = match.groups()
        assert name in known, f"docs/events.md documents {name}, which no longer exists"
        assert known[name] == tag, f"docs/events.md gives {name} the tag `{tag}`; its tag is `{known[name]}`"
