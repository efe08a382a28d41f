"""The layout rules of docs/architecture.md, checked from the source by
``tools/check_layout.py`` (the same script a newcomer runs by hand)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "check_layout", Path(__file__).resolve().parents[2] / "tools" / "check_layout.py"
)
layout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layout)


@pytest.fixture(scope="module")
def mods():
    return layout.modules()


def test_no_import_cycle(mods):
    assert layout.cycles(layout.import_graph(mods)) == []


def test_folders_import_only_downward_and_nobody_imports_the_plugin(mods):
    graph = layout.import_graph(mods)
    assert layout.upward_imports(graph, layout.layers()) == []
    assert layout.plugin_imports(graph) == []


def test_the_layer_order_is_the_architecture_tables():
    assert layout.layers() == [
        "kvrecord",
        "frontdoor",
        "kvtrace",
        "exporters",
        "collector",
        "dashboard",
        "proxy",
        "instrumented_connector",
        "kvlens",
    ]


def _tree(root: Path, files: dict[str, str]) -> Path:
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "architecture.md").write_text(
        "| folder | job |\n|---|---|\n| `low/` | bottom |\n| `instrumented_connector/` | plug-in |\n| `high/` | top |\n"
    )
    for name, text in {
        "low/__init__.py": "",
        "high/__init__.py": "",
        "instrumented_connector/__init__.py": "",
        **files,
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


#: A line of SQL for the planted trees, joined at run time so that this file
#: holds none itself (the checker reads tests/ too).
_PLANTED_SQL = " ".join(("SELECT trace_id", "FROM traces WHERE 1"))


def test_the_checker_fails_each_planted_violation(tmp_path):
    clean = layout.report(
        _tree(
            tmp_path / "clean",
            {
                "low/a.py": "X = 1\n",
                "high/b.py": "from low import a\n",
                "tests/test_a.py": "from low import a\n",
                "benchmarks/bench_a.py": "X = 1\n",
            },
        )
    )
    assert all(v == [] for v in clean.values()), clean
    bad = layout.report(
        _tree(
            tmp_path / "bad",
            {
                # upward, hidden inside a function
                "low/a.py": "def f():\n    from high import b\n    return b\n",
                # the dashboard/CLI layer reaching into the plug-in
                "high/b.py": "import instrumented_connector.hooks\n",
                "instrumented_connector/hooks.py": "X = 1\n",
                # SQL outside the store, in a module, a test and a benchmark
                "high/c.py": f"Q = {_PLANTED_SQL!r}\n",
                "tests/unit/test_c.py": f"def test_c(conn):\n    conn.execute({_PLANTED_SQL!r})\n",
                "benchmarks/bench_c.py": f"Q = {_PLANTED_SQL!r}\n",
                # ... but for the one exempt test helper
                "tests/store_sql.py": f"Q = {_PLANTED_SQL!r}\n",
                "high/d.py": "import re\nR = re.compile('[0-9a-f]{32}')\n",
                "high/e.py": "\n" * (layout.MAX_FILE_LINES + 1),
            },
        )
    )
    found = {k.split(" (")[0].split(":")[0]: v for k, v in bad.items()}
    assert found["upward imports"] == ["low.a -> high.b"]
    assert found["imports of the vLLM plug-in"] == ["high.b -> instrumented_connector.hooks"]
    assert sorted(v.split("/bad/", 1)[1] for v in found["SQL outside kvtrace/store"]) == [
        "benchmarks/bench_c.py:1",
        "high/c.py:1",
        "tests/unit/test_c.py:2",
    ]
    assert len(found["trace-id parsing outside kvrecord/ids.py"]) == 1
    assert len(found[f"files over {layout.MAX_FILE_LINES} lines"]) == 1
    # the cycle low.a -> high.b is not one: high.b does not import low
    assert found["import cycles"] == []


def test_sql_only_in_the_store_tests_and_benchmarks_included():
    assert layout.sql_outside_store(layout.sql_checked_files()) == []


def test_trace_id_parsing_only_in_ids(mods):
    assert layout.id_parsing_outside_ids(mods) == []


def test_modules_and_functions_stay_small(mods):
    assert layout.big_files(mods) == []
    assert layout.long_functions(mods) == []


def test_the_checker_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert layout.cycles(graph) == [["a", "b", "c"]]
