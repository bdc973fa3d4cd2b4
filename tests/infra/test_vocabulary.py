"""One vocabulary, spelled in one place each.

- Ids (model, sampler, request and sequence ids), `tinker://` paths, checkpoint ids and KV keys
  are built and read only by `libs/contracts/ids.py`; subjects only by `libs/contracts/subjects.py`.
- Paths under the data directory are built only by `libs/checkpoints/layout.py`.
- A setting that services must agree on (`infra.config.SHARED`) has its one default in
  `infra/config.py`; queue states are declared once, as `libs.contracts.records.QueueState`.

The checks read the syntax tree of every module under libs/, services/, infra/ and tinkerd/ (tests
and bench may build fixtures by hand), so comments and docstrings may spell any shape. Each
finding names its file and line and the function to call instead.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from infra.config import SHARED
from libs.contracts.ids import SEGMENT_OF_KIND

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ("libs", "services", "infra", "tinkerd")

IDS = "libs/contracts/ids.py"
SUBJECTS = "libs/contracts/subjects.py"
LAYOUT = "libs/checkpoints/layout.py"
RECORDS = "libs/contracts/records.py"
CONFIG = "infra/config.py"

DATA_ROOT = ("checkpoints", "samplers", "staging", "trainer", "traces", "models", "run", "nats", "nats.log", "nats.url")
"""The entries of the data root (layout.py's docstring draws them)."""
SEGMENTS = frozenset(SEGMENT_OF_KIND.values())
ID_NAMES = frozenset({"SCHEME", "SEGMENT_OF_KIND", "KIND_OF_SEGMENT"})
ID_LIKE = re.compile(r"(^|_)(id|ids|model|sampler|request|owner|run|entity|subject|key|path)$")
"""Names of values that hold an id, a key or a path (what a `split(":")` on them parses)."""
SPLITS = frozenset({"split", "rsplit", "partition", "rpartition"})
SHARED_DEFAULTS = {setting.name: setting.name.upper() for setting in SHARED}
"""Each shared setting's field name -> the name of its declaration in infra/config.py."""


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str
    use: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}; use {self.use}"


def modules() -> list[tuple[str, ast.Module]]:
    """(path relative to the repository, syntax tree) of every module the rules apply to."""
    found = []
    for root in SOURCE_ROOTS:
        for path in sorted((ROOT / root).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if "tests" in path.relative_to(ROOT).parts or rel.endswith("_pb2.py"):
                continue
            found.append((rel, ast.parse(path.read_text(), filename=rel)))
    return found


def documentation(tree: ast.AST) -> set[int]:
    """The string constants that are statements of their own (docstrings and attribute docs)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def strings(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, text) of every string literal that is code: plain constants and the literal parts
    of f-strings."""
    docs = documentation(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.lineno, node.value


def line_of(node: ast.AST) -> int:
    return int(getattr(node, "lineno", 0))


def terminal_name(node: ast.expr) -> str:
    """`x` for `x`, `b` for `a.b`, `f` for `f(...)` and `a.f(...)`; "" for anything else."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def is_token_call(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and terminal_name(node) == "token"


def leading_text(node: ast.expr) -> str | None:
    """The literal text a string or f-string starts with (None for anything else)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        first = node.values[0] if node.values else None
        return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""
    return None


# --- ids, paths, keys -------------------------------------------------------------------------

def id_findings(rel: str, tree: ast.AST) -> Iterator[Finding]:
    """Ids, `tinker://` paths, checkpoint ids and KV keys spelled outside ids.py."""
    if rel == IDS:
        return
    for line, text in strings(tree):
        if ":train:" in text or ":sample:" in text:
            yield Finding(rel, line, f"a model or sampler id spelled by hand ({text!r})",
                          "ids.model_id, ids.sampler_id, ids.is_sampler_id or ids.session_of")
        if "tinker://" in text:
            yield Finding(rel, line, f"a tinker:// path spelled by hand ({text!r})",
                          "ids.tinker_path, ids.unchecked_path, ids.split_path or ids.TinkerPath.parse")
    for node in ast.walk(tree):
        named = ""
        if isinstance(node, ast.Name) and node.id in ID_NAMES:
            named = node.id
        elif isinstance(node, ast.Attribute) and node.attr in ID_NAMES:
            named = node.attr
        elif isinstance(node, ast.ImportFrom) and node.module == "libs.contracts.ids":
            named = next((a.name for a in node.names if a.name in ID_NAMES), "")
        if named and not (rel == LAYOUT and named == "SEGMENT_OF_KIND"):
            yield Finding(rel, line_of(node), f"ids.{named} used to spell a path by hand",
                          "ids.tinker_path, ids.checkpoint_id, ids.is_tinker_path or ids.split_path")
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        args = [a.value for a in node.args if isinstance(a, ast.Constant)]
        if node.func.attr == "replace" and args[:2] in ([":", "="], ["=", ":"]):
            yield Finding(rel, node.lineno, "an id's token made by hand (`:` <-> `=`)", "ids.token or ids.untoken")
        if node.func.attr in SPLITS and args[:1] == [":"] and ID_LIKE.search(terminal_name(node.func.value)):
            yield Finding(rel, node.lineno, f"an id read back by hand ({node.func.attr}(':'))",
                          "ids.split_request_id, ids.owner_of_request or ids.session_of")
    if rel in (SUBJECTS, LAYOUT):
        return  # they turn ids into subjects and path names
    for node in ast.walk(tree):
        keyed = isinstance(node, ast.JoinedStr) and any(
            isinstance(v, ast.FormattedValue) and is_token_call(v.value) for v in node.values
        )
        keyed |= isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and (
            is_token_call(node.left) or is_token_call(node.right)
        )
        if keyed:
            yield Finding(rel, line_of(node), "an id's token spelled into a key, subject or path by hand",
                          "the ids.py function for the key (ids.seq_key, ids.checkpoint_key, ...), "
                          "subjects.py for a subject, layout.py for a path")


# --- the data directory -------------------------------------------------------------------------

def layout_findings(rel: str, tree: ast.AST) -> Iterator[Finding]:
    """Paths under the data directory joined outside layout.py."""
    if rel == LAYOUT:
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            text = leading_text(node.right)
            if text is None:
                continue
            if text.split("/")[0] in DATA_ROOT:
                yield Finding(rel, node.lineno, f"a path under the data directory joined by hand (/ {text!r})",
                              "a libs.checkpoints.layout function (add one there if none fits)")
            elif isinstance(node.left, ast.Call) and isinstance(node.left.func, ast.Attribute) and (
                terminal_name(node.left.func.value) == "layout"
            ):
                yield Finding(rel, node.lineno, f"layout.{node.left.func.attr}() extended by hand",
                              "a libs.checkpoints.layout function (add one there if none fits)")
            elif text in SEGMENTS:
                yield Finding(rel, node.lineno, f"a checkpoint segment joined by hand ({text!r})",
                              "layout.public_path or layout.versions_dir")
    for line, text in strings(tree):
        if "/" in text and text.split("/")[0] in DATA_ROOT:
            yield Finding(rel, line, f"a path under the data directory spelled by hand ({text!r})",
                          "a libs.checkpoints.layout function (add one there if none fits)")


# --- settings and states ------------------------------------------------------------------------

def settings_findings(rel: str, tree: ast.AST) -> Iterator[Finding]:
    """A second default for a setting `infra/config.py` declares for every service."""
    if rel == CONFIG:
        return
    for node in ast.walk(tree):
        pairs: list[tuple[str, ast.expr | None]] = []
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            pairs.append((node.target.id, node.value))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            positional = node.args.posonlyargs + node.args.args
            defaults = [None] * (len(positional) - len(node.args.defaults)) + list(node.args.defaults)
            pairs += [(a.arg, d) for a, d in zip(positional, defaults, strict=True)]
            pairs += [(a.arg, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults, strict=True)]
        for name, default in pairs:
            if name in SHARED_DEFAULTS and isinstance(default, ast.Constant) and default.value is not None:
                yield Finding(rel, default.lineno, f"a second default for {name} ({default.value!r})",
                              f"infra.config.{SHARED_DEFAULTS[name]}.default")


def queue_state_findings(rel: str, tree: ast.AST) -> Iterator[Finding]:
    """A `Literal[...]` of queue states other than records.QueueState."""
    if rel == RECORDS:
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and terminal_name(node.value) == "Literal":
            values = {n.value for n in ast.walk(node.slice) if isinstance(n, ast.Constant)}
            if "paused_capacity" in values:
                yield Finding(rel, node.lineno, "queue states declared a second time", "libs.contracts.records.QueueState")


Rule = Callable[[str, ast.AST], Iterator[Finding]]


def findings(rule: Rule) -> list[str]:
    return [str(f) for rel, tree in modules() for f in rule(rel, tree)]


def test_ids_paths_and_keys_are_spelled_only_in_ids() -> None:
    found = findings(id_findings)
    assert not found, "ids, tinker:// paths and keys spelled outside libs/contracts/ids.py:\n" + "\n".join(found)


def test_data_dir_paths_are_built_only_in_layout() -> None:
    found = findings(layout_findings)
    assert not found, "paths under the data directory built outside libs/checkpoints/layout.py:\n" + "\n".join(found)


def test_shared_settings_take_their_one_default_from_infra_config() -> None:
    found = findings(settings_findings)
    assert not found, "a setting infra/config.py declares has a second default:\n" + "\n".join(found)


def test_queue_states_are_declared_only_in_records() -> None:
    found = findings(queue_state_findings)
    assert not found, "\n".join(found)


# --- the checks themselves find what they are meant to -----------------------------------------

SPELLED = [
    (id_findings, 'model = f"{session}:train:{n}"', "ids.model_id"),
    (id_findings, 'path = f"tinker://{run}/weights/{name}"', "ids.tinker_path"),
    (id_findings, "from libs.contracts.ids import SCHEME", "ids.tinker_path"),
    (id_findings, 'key = model_id.replace(":", "=")', "ids.token"),
    (id_findings, 'owner, _, seq = request_id.rpartition(":")', "ids.split_request_id"),
    (id_findings, 'key = f"{ids.token(sampler)}.clones"', "ids.seq_key"),
    (layout_findings, 'root = data_dir / "checkpoints"', "libs.checkpoints.layout"),
    (layout_findings, 'rel = f"traces/{name}.pftrace"', "libs.checkpoints.layout"),
    (layout_findings, 'v = layout.versions_dir(d, r, k) / f"{name}@copy"', "libs.checkpoints.layout"),
    (settings_findings, "class C:\n    num_slots: int = 8", "infra.config.NUM_SLOTS.default"),
    (settings_findings, "def f(token_budget: int = 100) -> None: ...", "infra.config.TOKEN_BUDGET.default"),
    (queue_state_findings, 'S = Literal["active", "paused_capacity"]', "QueueState"),
]


@pytest.mark.parametrize(("rule", "code", "use"), SPELLED, ids=[code for _, code, _ in SPELLED])
def test_each_check_names_the_line_and_the_function_to_use(rule: Rule, code: str, use: str) -> None:
    found = [str(f) for f in rule("services/example.py", ast.parse(code))]
    assert len(found) >= 1 and found[0].startswith("services/example.py:"), found
    assert use in found[0], found


ALLOWED = [
    (id_findings, '"""A model id is `{session}:train:{n}`, its checkpoints `tinker://RUN/weights/NAME`."""'),
    (id_findings, 'port = int(server.url.rsplit(":", 1)[1])'),
    (id_findings, "model = ids.model_id(session, 0)"),
    (layout_findings, 'snapshot = hf_root / "snapshots" / revision'),
    (layout_findings, "target = data_dir / relative"),
    (settings_findings, "class C:\n    num_slots: int = NUM_SLOTS.default"),
]


@pytest.mark.parametrize(("rule", "code"), ALLOWED, ids=[code for _, code in ALLOWED])
def test_docs_and_unrelated_strings_are_not_findings(rule: Rule, code: str) -> None:
    assert not [str(f) for f in rule("services/example.py", ast.parse(code))]


def test_every_path_layout_builds_lies_under_an_entry_its_docstring_draws(tmp_path: Path) -> None:
    from libs.checkpoints import layout

    run = layout.run_dir(tmp_path)
    built = [
        layout.public_path(tmp_path, "s-1:train:0", "training", "c"),
        layout.version_dir(tmp_path, "s-1:train:0", "sampler", "c", "u1"),
        layout.ephemeral_dir(tmp_path, "s-1:sample:0", "u1"),
        layout.staging_dir(tmp_path, "u1", "s-1:train:0:3"),
        layout.paged_file(layout.page_store_dir(tmp_path, "g"), "s-1:train:0"),
        layout.trainer_snapshot_dir(tmp_path, "g", 7) / layout.snapshot_paged_name("s-1:train:0"),
        tmp_path / layout.export_file("s-1:train:0", "u1"),
        layout.adopted_file(tmp_path, "s-1:train:0", "u1"),
        tmp_path / layout.trace_file("s-1", "abc"),
        layout.models_root(tmp_path),
        layout.announce_file(run, "sampler"),
        layout.liveness_file(run, "gateway"),
        layout.stack_state_file(run),
        layout.nats_store_dir(tmp_path),
        layout.nats_log_file(tmp_path),
        layout.nats_url_file(tmp_path),
    ]
    entries = {path.relative_to(tmp_path).parts[0] for path in built}
    assert entries == set(DATA_ROOT)
    drawn = {entry for entry in DATA_ROOT if f"DATA/{entry}" in (layout.__doc__ or "")}
    assert drawn == set(DATA_ROOT), f"layout.py's docstring does not draw {sorted(set(DATA_ROOT) - drawn)}"
    assert not [p for p in built if ":" in str(p.relative_to(tmp_path))], "ids in paths go through ids.token"
