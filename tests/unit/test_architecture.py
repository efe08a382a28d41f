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


def test_lower_layers_never_import_the_cli_layer(mods):
    assert layout.upward_imports(layout.import_graph(mods)) == []


def test_sql_only_in_the_store(mods):
    assert layout.sql_outside_store(mods) == []


def test_trace_id_parsing_only_in_ids(mods):
    assert layout.id_parsing_outside_ids(mods) == []


def test_modules_and_functions_stay_small(mods):
    assert layout.big_files(mods) == []
    assert layout.long_functions(mods) == []


def test_the_checker_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert layout.cycles(graph) == [["a", "b", "c"]]
