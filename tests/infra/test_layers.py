"""The import graph keeps its shape.

- Layers (`[tool.importlinter]` in pyproject.toml, checked by `lint-imports`): `tinkerd` may import
  `services`, `services` may import `infra`, `infra` may import `libs`, never the other way; and no
  service imports another (gateway, planner, trainer, publisher, sampler share only libs/ and infra/).
- No import cycle: no module of libs, infra, services or tinkerd is reachable from itself through
  the modules it imports (grimp's graph, the one import-linter reads; imports inside functions and
  under TYPE_CHECKING count too).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
ROOT_PACKAGES = ("libs", "infra", "services", "tinkerd")


def lint_imports() -> str:
    beside = Path(sys.executable).parent / "lint-imports"
    found = str(beside) if beside.exists() else shutil.which("lint-imports")
    assert found, "lint-imports is not installed (pip install -e '.[dev]')"
    return found


def test_lint_imports_keeps_the_layer_and_independence_contracts() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [lint_imports(), "--no-cache", "--no-logo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    report = run.stdout + run.stderr
    assert run.returncode == 0, f"lint-imports found broken contracts:\n{report}"
    assert "0 broken" in report, report


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """One cycle (`[a, b, ..., a]`) per group of modules that import each other, in import order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            module, imported = work[-1]
            step = next(imported, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.find_modules_directly_imported_by(step)))))
                elif step in on_stack:
                    low[module] = min(low[module], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == module:
                        break
                if len(group) > 1 or graph.direct_import_exists(importer=module, imported=module):
                    groups.append(sorted(group))
    found = []
    for group in groups:
        first = group[0]
        nxt = min(m for m in graph.find_modules_directly_imported_by(first) if m in group)
        back = (nxt,) if nxt == first else graph.find_shortest_chain(importer=nxt, imported=first)
        found.append([first, *(back or (nxt, first))])
    return found


def test_no_module_is_reachable_from_itself_through_its_imports() -> None:
    graph = grimp.build_graph(*ROOT_PACKAGES, cache_dir=None)
    assert len(graph.modules) > 100, sorted(graph.modules)
    found = cycles(graph)
    assert not found, "import cycles (move the shared code down a layer, or the composition up):\n" + "\n".join(
        " -> ".join(cycle) for cycle in found
    )


def test_the_cycle_check_names_each_cycle_by_its_imports() -> None:
    graph = grimp.ImportGraph()
    for importer, imported in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d"), ("p.e", "p.e")]:
        graph.add_import(importer=importer, imported=imported)
    assert cycles(graph) == [["p.a", "p.b", "p.c", "p.a"], ["p.e", "p.e"]]
