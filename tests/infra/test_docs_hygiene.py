"""The docs describe the product, not the history of its making.

- docs/*.md, README.md, bench/README.md and bench/results/**/README.md, and every docstring and
  comment of bench/*.py, cite no issue number ("issue 12", "issue #12", "(#12)") and narrate no
  run of the work ("the second session", "device call", "remote GPU time", "a helper's worktree",
  "lent machines", "sitting");
- no docstring or comment under services/, libs/, infra/, tests/ or bench/ cites an issue number.

A Tinker *session* (a client's session, `session_id`, sampling sessions) is product vocabulary and
is left alone: only phrasings that place a session in the project's own history are refused.
An upstream project's thread spelled with its repository (``sgl-project/sglang#15746``) is a
reference, not history, and is allowed. History lives in git and in bench/results/'s dated
folders.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

ISSUE_NUMBER = re.compile(
    r"\bissue[ -]#?\d+"  # issue 12, issue #12, issue-17 (a heading's anchor or a branch)
    r"|\bissues #?\d+(?=(, | and |/)#?\d)"  # issues 15, 16 (not the verb: "issues 1,796 ops")
    r"|(?<![\w/.#-])#\d+\b",  # (#15), #8: a bare number, not owner/repo#N nor a URL fragment
    re.IGNORECASE,
)
"""An issue number cited as where something came from."""

HISTORY = re.compile(
    "|".join(
        [
            r"\bsittings?\b",
            r"\bdevice (call|budget)s?\b|\bminutes of (device|GPU) time\b",
            r"\bremote[- ]GPU\b",
            r"\blent\b",
            r"\bwork ?place's\b|\bthis work ?place\b",
            r"\bhelper's\b|\bby a helper\b|\ba helper (ran|measured|made)\b",
            r"\bthe lead(?:'s)?\b(?!er)",
            r"\b(this|that|the (first|second|third|fourth|last|previous|next)|(first|second|third|fourth)"
            r"|an earlier|a later) session\b",
            r"\b(this|that|the (last|previous|next)|an earlier|a later)( \w+)? issue\b",
        ]
    ),
    re.IGNORECASE,
)
"""Narration of how the project was worked on: its sessions, machines and hands."""

SOURCE_ROOTS = ("services", "libs", "infra", "tests", "bench")


def prose_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "bench" / "README.md"]
    files += sorted((ROOT / "docs").glob("*.md"))
    files += sorted((ROOT / "bench" / "results").rglob("README.md"))
    return [f for f in files if f.is_file()]


def python_files(*roots: str) -> list[Path]:
    """The Python files under `roots`, this one excepted (its examples are the patterns' own)."""
    here = Path(__file__).resolve()
    return sorted(
        p for r in roots for p in (ROOT / r).rglob("*.py") if ".venv" not in p.parts and p.resolve() != here
    )


def docstrings_and_comments(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every docstring and every comment of one Python file."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                value = body[0].value.value
                if isinstance(value, str):
                    yield body[0].lineno, value
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def findings(pattern: re.Pattern[str], text: str, first_line: int = 1) -> list[str]:
    out = []
    for offset, line in enumerate(text.splitlines()):
        for match in pattern.finditer(line):
            out.append(f"{first_line + offset}: {match.group(0)!r} in {line.strip()[:120]!r}")
    return out


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", prose_files(), ids=rel)
def test_docs_cite_no_issue_and_narrate_no_history(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    found = findings(ISSUE_NUMBER, text) + findings(HISTORY, text)
    assert not found, f"{rel(path)} tells history instead of the product:\n" + "\n".join(found)


@pytest.mark.parametrize("path", python_files("bench"), ids=rel)
def test_bench_docstrings_narrate_no_history(path: Path) -> None:
    found = [f for line, text in docstrings_and_comments(path) for f in findings(HISTORY, text, line)]
    assert not found, f"{rel(path)} tells history instead of what it measures:\n" + "\n".join(found)


def test_no_docstring_or_comment_cites_an_issue_number() -> None:
    found = [
        f"{rel(path)}:{f}"
        for path in python_files(*SOURCE_ROOTS)
        for line, text in docstrings_and_comments(path)
        for f in findings(ISSUE_NUMBER, text, line)
    ]
    assert not found, "issue numbers cited in docstrings or comments:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "text",
    [
        "Trainer throughput (issue 4)",
        "as issue #12 asked",
        "(issues 15, 16; 2026-12-01)",
        "the fix (#15)",
        "[benchmarks](benchmarks.md#chaos-soak-issue-14)",
        "Second session on the H200",
        "in this session",
        "six device calls",
        "about 19 minutes of device time",
        "minutes of remote GPU time",
        "only one-GPU machines are lent",
        "a helper's worktree",
        "in one sitting",
        "the lead's call",
        "the last speed issue",
    ],
)
def test_the_patterns_catch_history(text: str) -> None:
    assert ISSUE_NUMBER.search(text) or HISTORY.search(text)


@pytest.mark.parametrize(
    "text",
    [
        "a session whose heartbeats stop is expired",
        "the session's requests as a Perfetto trace",
        "create_sampling_session",
        "sgl-project/sglang#15746",
        "[gpu.md](gpu.md#two-h200s-one-tp2-trainer-group)",
        "the leader of the requests stream",
        "an equivalent adapter",
        "Shared bench helpers",
        "the JWT was not issued by this server",
        "a CUDA device",
        "an aten op's device time repeats its kernels' time",
        "the forward issues 1,796 aten ops",
    ],
)
def test_the_patterns_leave_product_vocabulary_alone(text: str) -> None:
    assert not ISSUE_NUMBER.search(text) and not HISTORY.search(text)
