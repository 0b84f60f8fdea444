"""The packages import one another one way only, and each backend stays behind its own door.

Pure: gpuresa's source read as text, every `import` line counted wherever it
stands (inside a function or under `TYPE_CHECKING` too, since a lazy import
is a circle all the same once both sides run).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import gpuresa

PACKAGE = Path(gpuresa.__file__).parent
IMPORT = re.compile(r"^\s*(?:from (gpuresa[\w.]*) import|import (gpuresa[\w.]*))")


def unit_of(module: str) -> str | None:
    """The package a module counts for: `backends.X` for a backend's, else the top one.

    Top-level modules (`model`, `access`, `errors`...) are shared values, not packages.
    """
    parts = module.split(".")[1:]
    if not parts or not (PACKAGE / parts[0]).is_dir():
        return None
    if parts[0] == "backends" and len(parts) > 1 and (PACKAGE / "backends" / parts[1]).is_dir():
        return f"backends.{parts[1]}"
    return parts[0]


def package_imports() -> dict[str, dict[str, list[str]]]:
    """For each package, the packages it imports and the lines that do."""
    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        source = unit_of(".".join(("gpuresa", *relative.with_suffix("").parts)))
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found = IMPORT.match(line)
            if not found or source is None:
                continue
            target = unit_of(found.group(1) or found.group(2))
            if target is not None and target != source:
                edges[source][target].append(f"{relative}:{number}")
    return edges


def circles(edges: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected groups of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in list(edges.get(node, {})):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in list(edges):
        if node not in index:
            visit(node)
    return found


def test_no_package_imports_one_that_imports_it_back() -> None:
    edges = package_imports()
    problems = []
    for group in circles(edges):
        lines = [
            f"  {source} -> {target}: {', '.join(edges[source][target][:3])}"
            for source in group
            for target in group
            if target in edges[source]
        ]
        problems.append(" / ".join(group) + "\n" + "\n".join(lines))
    assert not problems, "circles between packages:\n" + "\n".join(problems)


def test_the_circle_finder_sees_a_circle_through_three_packages() -> None:
    edges = {"a": {"b": ["a.py:1"]}, "b": {"c": ["b.py:1"]}, "c": {"a": ["c.py:9"]}, "d": {}}
    assert circles(edges) == [["a", "b", "c"]]
    assert circles({"a": {"b": ["a.py:1"]}, "b": {}}) == []


def test_the_shared_packages_import_no_backend() -> None:
    edges = package_imports()
    for shared in ("sessions", "outputs", "planning", "reservations", "config", "gpus"):
        reached = sorted(target for target in edges.get(shared, {}) if target.startswith("backend"))
        assert not reached, f"{shared} imports {reached}: {dict(edges[shared])}"


def test_only_the_engines_backend_talks_to_docker() -> None:
    talking = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if re.search(r"^\s*(import docker|from docker\b)", path.read_text(), re.M)
    )
    assert talking, "the engines backend imports docker somewhere"
    assert all(name.startswith("backends/engines/") for name in talking), talking
