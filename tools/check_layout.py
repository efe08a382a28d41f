#!/usr/bin/env python3
"""The house rules of kvlens' layout, checked from the source (no imports run).

    python tools/check_layout.py            # prints the module graph's cycles, big files, long functions

Rules (docs/architecture.md):

* no import cycle among the project's modules (every ``import``, at module
  level or inside a function, is an edge);
* folders are layers: a module imports only from its own folder and the
  folders below it, in the order of the table "Layers" in
  ``docs/architecture.md`` (read from there, bottom row first); imports
  inside functions count;
* nothing imports the vLLM plug-in (``instrumented_connector``): vLLM loads
  it by name, and the dashboard and the CLI must not depend on it;
* SQL text only in ``kvtrace/store``, ``tests/`` and ``benchmarks/`` included,
  but for the files of ``SQL_ALLOWED`` (``tests/store_sql.py``: what tests
  and benchmarks need beneath the store API, out of the product);
* trace-id parsing (the 32-hex / traceparent patterns) only in ``kvrecord/ids.py``;
* files under ``MAX_FILE_LINES`` lines, functions under ``MAX_FUNC_LINES``
  unless listed in ``LONG_FUNCTIONS`` with the reason. These caps are a smoke
  alarm, not a target: they sit far above today's sizes, and a module past
  ``WARN_FILE_LINES`` (a function past ``WARN_FUNC_LINES``) is only printed
  as a warning, a hint to look for where its concepts part. Never trim a
  comment or split a class to pass them; split where the concepts part.

``tests/unit/test_check_layout.py`` runs the same checks.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = "docs/architecture.md"
#: The vLLM plug-in: loaded by vLLM by name, imported by nobody.
PLUGIN = "instrumented_connector"
#: Failures: far above any module's size; a file this long has stopped being one concept.
MAX_FILE_LINES = 800
MAX_FUNC_LINES = 150
#: Warnings only (printed, never failing): well above today's sizes.
WARN_FILE_LINES = 500
WARN_FUNC_LINES = 80

#: Functions allowed past MAX_FUNC_LINES, with the reason.
LONG_FUNCTIONS: dict[str, str] = {}

_SQL = re.compile(
    r"\b(SELECT\s+[^;]+?\s+FROM\s|INSERT\s+(OR\s+\w+\s+)?INTO\s|(CREATE|DROP)\s+(TABLE|INDEX|DATABASE)\s"
    r"|ALTER\s+TABLE\s|DELETE\s+FROM\s|UPDATE\s+\w+\s+SET\s)",
    re.IGNORECASE,
)
#: Folders that are no layer but hold Python that must not write SQL either.
SQL_CHECKED_TOO = ("tests", "benchmarks")
#: The exemptions from "SQL only in the store", by dotted name, with the reason.
SQL_ALLOWED: dict[str, str] = {
    "tests.store_sql": "what tests and benchmarks need beneath the store API (an older schema, a held write "
    "lock, a test server's databases): test code, kept out of the product"
}
_ID_PATTERNS = ("[0-9a-f]{32}", "[0-9a-f]{16}", "traceparent")


def _rel(f: Path) -> Path:
    return f.relative_to(ROOT) if f.is_relative_to(ROOT) else f


_LAYER_ROW = re.compile(r"^\|\s*`([A-Za-z_][\w]*)/`\s*\|")


def layers(root: Path = ROOT) -> list[str]:
    """The project's top-level packages, bottom layer first: the first cells
    of the rows of ``docs/architecture.md``'s "Layers" table that name a
    folder (`` `kvrecord/` ``)."""
    out = []
    for line in (root / ARCHITECTURE).read_text().splitlines():
        m = _LAYER_ROW.match(line)
        if m and m.group(1) not in out:
            out.append(m.group(1))
    if not out:
        raise SystemExit(f"check_layout: no layer rows (| `folder/` | ...) in {root / ARCHITECTURE}")
    return out


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for pkg in layers(root):
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        tree = ast.parse(f.read_text(), str(f))
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(m, f.name == "__init__.py", node)
                for a in node.names:
                    sub = f"{src}.{a.name}"
                    targets.append(sub if sub in mods else src)
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                # a module importing its own package (``__init__``) is Python's normal order, not a cycle
                if t and t != m and not m.startswith(t + "."):
                    graph[m].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def upward_imports(graph: dict[str, set[str]], order: list[str]) -> list[str]:
    """Imports of a module from a folder above its own in ``order`` (bottom first)."""
    rank = {pkg: i for i, pkg in enumerate(order)}
    return [
        f"{m} -> {t}" for m, ts in graph.items() for t in sorted(ts) if rank[t.split(".")[0]] > rank[m.split(".")[0]]
    ]


def plugin_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of the vLLM plug-in from outside it."""
    return [
        f"{m} -> {t}"
        for m, ts in graph.items()
        for t in sorted(ts)
        if t.split(".")[0] == PLUGIN and m.split(".")[0] != PLUGIN
    ]


def sql_checked_files(root: Path = ROOT) -> dict[str, Path]:
    """The project's modules and the Python files of :data:`SQL_CHECKED_TOO`
    (tests and benchmarks reach the store through its API too), by dotted name."""
    out = modules(root)
    for folder in SQL_CHECKED_TOO:
        for f in sorted((root / folder).rglob("*.py")):
            out[".".join(f.relative_to(root).with_suffix("").parts)] = f
    return out


def sql_outside_store(mods: dict[str, Path]) -> list[str]:
    """String constants that look like SQL outside ``kvtrace.store`` and
    :data:`SQL_ALLOWED` (pass :func:`sql_checked_files` to cover tests and benchmarks)."""
    out = []
    for m, f in mods.items():
        if m.startswith("kvtrace.store") or m in SQL_ALLOWED:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _SQL.search(node.value):
                out.append(f"{_rel(f)}:{node.lineno}")
    return out


def id_parsing_outside_ids(mods: dict[str, Path]) -> list[str]:
    out = []
    for m, f in mods.items():
        if m == "kvrecord.ids":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in (
                "compile",
                "match",
                "search",
                "fullmatch",
            ):
                for a in node.args[:1]:
                    if (
                        isinstance(a, ast.Constant)
                        and isinstance(a.value, str)
                        and any(p in a.value for p in _ID_PATTERNS)
                    ):
                        out.append(f"{_rel(f)}:{node.lineno}")
    return out


def big_files(mods: dict[str, Path], limit: int = MAX_FILE_LINES) -> list[str]:
    return [f"{_rel(f)}: {n} lines" for f in mods.values() if (n := len(f.read_text().splitlines())) > limit]


def long_functions(mods: dict[str, Path], limit: int = MAX_FUNC_LINES) -> list[str]:
    out = []
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                key = f"{m}.{node.name}"
                if n > limit and key not in LONG_FUNCTIONS:
                    out.append(f"{_rel(f)}:{node.lineno} {node.name}: {n} lines")
    return out


def warnings(root: Path = ROOT) -> dict[str, list[str]]:
    """Sizes worth a look (printed, never failing): where a module or a
    function may hold more than one concept."""
    mods = modules(root)
    return {
        f"files over {WARN_FILE_LINES} lines (a warning)": big_files(mods, WARN_FILE_LINES),
        f"functions over {WARN_FUNC_LINES} lines (a warning)": long_functions(mods, WARN_FUNC_LINES),
    }


def report(root: Path = ROOT) -> dict[str, list[str]]:
    """Every rule's violations, by rule."""
    order = layers(root)
    mods = modules(root)
    graph = import_graph(mods)
    return {
        "import cycles": [" <-> ".join(c) for c in cycles(graph)],
        f"upward imports (layers, bottom first: {' < '.join(order)})": upward_imports(graph, order),
        f"imports of the vLLM plug-in ({PLUGIN}) from outside it": plugin_imports(graph),
        "SQL outside kvtrace/store": sql_outside_store(sql_checked_files(root)),
        "trace-id parsing outside kvrecord/ids.py": id_parsing_outside_ids(mods),
        f"files over {MAX_FILE_LINES} lines": big_files(mods),
        f"functions over {MAX_FUNC_LINES} lines": long_functions(mods),
    }


def main() -> int:
    bad = 0
    for title, items in report().items():
        print(f"{title}: {len(items) or 'none'}")
        for i in items:
            print("   ", i)
        bad += len(items)
    for title, items in warnings().items():
        if items:
            print(f"{title}: {len(items)}")
            for i in items:
                print("   ", i)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
