"""Partial traces read back (issue 37, item 2): which handoffs are stuck now
(``kvtrace.stuck``, ``kvlens traces --open``), how a partial trace reads in
the one trace model, the stale flag, on both store backends, with spans
written by the real pipeline (``tests/health_store.py``)."""

from __future__ import annotations

import json
import time

import pytest

from health_store import S, add_health_traces
from kvlens import traces as traces_cmd
from kvlens.cli import main
from kvrecord import semconv as sc
from kvtrace import store, stuck, tracemodel
import store_sql


#: How each backend's plan names the partial index (PostgreSQL: each day partition's own, named after the column).
OPEN_INDEX = {"sqlite": "spans_open", "postgresql": "end_ns_idx"}


@pytest.fixture
def health(backend):
    now = time.time_ns()
    ids = add_health_traces(backend.config(), now)
    return backend, ids, now


def test_stuck_now_lists_open_sides_oldest_first(health):
    backend, ids, now = health
    with store.reading(backend.store) as conn:
        got = stuck.stuck(conn, since_ns=now - 60 * S)
    assert [(o.trace_id, o.role, o.phase) for o in got] == [
        (ids["pull_stuck"], "prefill", "awaiting_read"),
        (ids["push_stuck"], "decode", "awaiting_kv"),
    ]
    pull, push = got
    assert (pull.mode, pull.since_ns, pull.seen_ns, pull.blocks) == ("pull", now - 30 * S, now - 3 * S, 16)
    assert (push.mode, push.since_ns, push.seen_ns) == ("push", now - 20 * S, now - 2 * S)
    assert push.registration_timeout and not pull.registration_timeout  # the latest snapshot's flag
    assert push.request_id and push.request_id.startswith("cmpl-" + ids["push_stuck"])
    assert push.engine == "d0" and pull.engine == "p0"
    assert push.side == "D" and pull.side == "P"
    assert push.age_s(now) == pytest.approx(20.0) and push.waited_s == pytest.approx(18.0)


def test_ended_sides_and_old_reports_are_not_stuck_now(health):
    backend, ids, now = health
    with store.reading(backend.store) as conn:
        within_hour = stuck.stuck(conn, since_ns=now - 3600 * S)
        pull_only = stuck.stuck(conn, since_ns=now - 60 * S, mode="pull")
    # the stale trace ended on both sides (its open spans are history); P's side of the push one ended at the lease
    assert ids["pull_stale"] not in {o.trace_id for o in within_hour}
    assert ("prefill", ids["push_stuck"]) not in {(o.role, o.trace_id) for o in within_hour}
    # reported 10 minutes ago and never ended: shown only when the window reaches back to it
    assert ids["abandoned"] in {o.trace_id for o in within_hour}
    assert [o.trace_id for o in pull_only] == [ids["pull_stuck"]]


def test_stuck_reads_the_partial_index(health):
    backend, _, now = health
    with store.reading(backend.store) as conn:
        if backend.is_pg:
            store_sql.prefer_indexes(conn)
        plan = store.open_spans_plan(conn, since_ns=now - 60 * S)
    assert OPEN_INDEX[backend.name] in plan, plan


def test_partial_trace_in_the_trace_model(health):
    backend, ids, _ = health
    with store.reading(backend.store) as conn:
        got = tracemodel.find(conn, ids.values())
    push = got[ids["push_stuck"]]
    opened = [s for s in push.spans if s.name == sc.SPAN_HANDOFF_OPEN]
    assert len(opened) == 1 and opened[0].role == "decode"  # the latest snapshot only
    assert [(o.role, o.phase) for o in push.open] == [("decode", "awaiting_kv")]
    assert not push.stale
    js = push.to_json()
    assert js["open"][0]["waiting"] == "decode" and js["open"][0]["registration_timeout"] is True
    assert js["stale"] is False

    # the summary's outcome is its spans' worst (P's lease expired); readers say "open" while a side waits
    assert push.outcome == "expired" and "outcome=open" in traces_cmd.waterfall(push)

    stale = got[ids["pull_stale"]]
    assert stale.open == () and stale.stale
    assert not [s for s in stale.spans if s.name == sc.SPAN_HANDOFF_OPEN]  # the complete trace replaced them
    assert stale.to_json()["stale"] is True

    text = traces_cmd.waterfall(push)
    assert "outcome=open" in text
    assert "OPEN: D (decode) waiting in awaiting_kv" in text and "push registration timed out" in text
    stale_text = traces_cmd.waterfall(stale)
    assert stuck.STALE_WORDS in stale_text and "OPEN" not in stale_text


def test_cli_open_text_json_and_none(health, capsys, tmp_path):
    backend, ids, _ = health
    assert main(["traces", "--store", str(backend.store), "--open"]) == 0
    out = capsys.readouterr().out
    assert "2 handoff side(s) stuck now" in out
    lines = out.splitlines()
    row = next(ln for ln in lines if ln.startswith(ids["push_stuck"]))
    for word in ("push", "D (decode)", "awaiting_kv", "registration timed out", "ago"):
        assert word in row, row
    assert ids["pull_stale"] not in out and ids["abandoned"] not in out

    assert main(["traces", "--store", str(backend.store), "--open", "--json", "--since", "1h"]) == 0
    objs = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert {o["trace_id"] for o in objs} == {ids["push_stuck"], ids["pull_stuck"], ids["abandoned"]}
    first = objs[0]
    assert set(first) >= {"trace_id", "request_id", "mode", "waiting", "phase", "since_ns", "age_s", "last_seen_ns"}
    assert first["trace_id"] == ids["abandoned"] and first["age_s"] >= 700


def test_cli_open_says_so_when_none(tmp_path, capsys):
    from store_fixture import make_store

    path = make_store(tmp_path, n_per_mode=3, bench=False)
    assert main(["traces", "--store", str(path), "--open"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("no handoff stuck now in ") and "last 1m" in out
    assert main(["traces", "--store", str(path), "--open", "--json"]) == 0
    assert capsys.readouterr().out == ""


def test_cli_open_missing_store_is_one_line(tmp_path, capsys):
    assert main(["traces", "--store", str(tmp_path / "none.db"), "--open"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "none.db" in err


def test_a_version_5_store_gets_the_partial_index(backend):
    conn = store.connect(backend.store)
    conn.close()
    store_sql.drop_index(backend.store, "spans_open")
    store_sql.set_schema_version(backend.store, 5)
    with store.reading(backend.store) as conn:  # an older store: upgraded once, then read
        if backend.is_pg:
            store_sql.prefer_indexes(conn)
        assert OPEN_INDEX[backend.name] in store.open_spans_plan(conn, since_ns=0)
    assert store_sql.meta(backend.store)["schema_version"] == str(store.SCHEMA_VERSION)


def test_visible_spans_rule_on_plain_rows():
    o = sc.SPAN_HANDOFF_OPEN
    rows = [
        {"name": o, "role": "decode", "start_ns": 1, "end_ns": 5},
        {"name": o, "role": "decode", "start_ns": 1, "end_ns": 9},
        {"name": o, "role": "prefill", "start_ns": 0, "end_ns": 4},
        {"name": "write.complete", "role": "prefill", "start_ns": 4, "end_ns": 4, "outcome": "expired"},
    ]
    kept = stuck.visible_spans(rows)
    assert [r["end_ns"] for r in kept if r["name"] == o] == [9]
    assert stuck.ended_sides(rows) == {"prefill"}
    assert [x.role for x in stuck.open_sides("t", rows)] == ["decode"]
    rows.append({"name": "kv.ready", "role": "decode", "start_ns": 10, "end_ns": 10})
    assert stuck.open_sides("t", rows) == () and all(r["name"] != o for r in stuck.visible_spans(rows))


def test_partial_traces_and_stale_ones_are_stored_under_keep_sampled(tmp_path):
    # --keep sampled holds a request's spans until it is decided: a partial trace
    # is written at once (it is for a request still undecided), a stale one is kept
    now = time.time_ns()
    cfg = {"kvlens_home": str(tmp_path), "kvlens_metrics": "off", "kvlens_keep": "sampled", "kvlens_keep_ratio": 0}
    ids = add_health_traces(cfg, now)
    path = tmp_path / "traces.db"
    with store.reading(path) as conn:
        got = stuck.stuck(conn, since_ns=now - 60 * S)
        traces = tracemodel.find(conn, ids.values())
    assert {(o.trace_id, o.role) for o in got} == {(ids["pull_stuck"], "prefill"), (ids["push_stuck"], "decode")}
    assert traces[ids["pull_stale"]].keep == "stale" and traces[ids["pull_stale"]].stale
