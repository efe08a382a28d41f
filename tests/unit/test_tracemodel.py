"""The one trace model (exporters/tracemodel.py): critical-path marking,
handoff, decomposition, the ``kvlens traces --json`` form, and that the CLI,
the dashboard and the per-phase breakdown all follow it."""

from __future__ import annotations

import json

import pytest
from store_fixture import make_store

from dashboard import data as D
from exporters import store, tracemodel
from exporters.tracemodel import CRITICAL, OVERLAP, Trace
from kvlens import traces as cli_traces

MS = 1_000_000
T0 = 1_700_000_000 * 10**9
PF, KV = T0 + 50 * MS, T0 + 60 * MS
TID = "ab" * 16


def _span(name, role, start, end, **kw):
    return {"name": name, "role": role, "start_ns": start, "end_ns": end, "span_id": f"{start:016x}"[-16:],
            "parent_id": None, "outcome": "ok", "attributes": {"kvlens.blocks": 4}, **kw}


def _summary(pf=PF, kv=KV, **kw):
    row = {"trace_id": TID, "request_id": TID, "mode": "push", "dispatch": "overlapped", "outcome": "ok",
           "start_ns": T0, "end_ns": T0 + 100 * MS, "ttft_s": 0.07, "prefill_finished_ns": pf,
           "kv_ready_ns": kv, "handoff_s": None if pf is None or kv is None else (kv - pf) / 1e9, "n_spans": 9}
    row.update(kw)
    return row


SPANS = [
    _span("request", "router", T0, T0 + 100 * MS),
    _span("prefill", "prefill", T0 + 1 * MS, PF),
    _span("registration.stage", "decode", T0 + 2 * MS, T0 + 2 * MS),
    _span("registration.send", "decode", T0 + 2 * MS, T0 + 3 * MS),
    _span("match", "prefill", T0 + 4 * MS, PF + 1 * MS),  # straddles prefill.finished
    _span("prefill.finished", "prefill", PF, PF),
    _span("write.post", "prefill", PF + 2 * MS, PF + 4 * MS),
    _span("write.complete", "prefill", PF + 4 * MS, KV + 2 * MS),  # ends after kv.ready
    _span("kv.ready", "decode", KV, KV),
]


def test_critical_path_marking():
    tr = Trace.from_rows(_summary(), SPANS)
    flags = {s.name: s.critical for s in tr.spans}
    assert flags == {
        "request": False,  # the root contains everything: never a handoff phase
        "prefill": False,  # ends where the window starts
        "registration.stage": False, "registration.send": False,  # overlapped with prefill
        "match": True,  # a part of it lies inside the window
        "prefill.finished": True, "kv.ready": True,  # point phases at the window's ends
        "write.post": True, "write.complete": True,
    }
    points = {s.name for s in tr.spans if s.point}
    assert points == {"registration.stage", "prefill.finished", "kv.ready"}
    assert tracemodel.critical_ns("match", T0 + 4 * MS, PF + MS, PF, KV) == MS
    assert tracemodel.critical_ns("write.complete", PF + 4 * MS, KV + 2 * MS, PF, KV) == 6 * MS
    assert tracemodel.critical_ns("request", T0, T0 + 100 * MS, PF, KV) == 0


def test_no_window_no_critical_path():
    tr = Trace.from_rows(_summary(kv=None, outcome="timeout"), SPANS[:-1])
    assert tr.window is None and tr.handoff_s is None
    assert not any(s.critical for s in tr.spans)
    assert tr.decomposition()["first_decode_s"] is None


def test_handoff_and_decomposition():
    tr = Trace.from_rows(_summary(), SPANS)
    assert tr.window == (PF, KV) and tr.handoff_s == pytest.approx(0.010)
    assert tr.t0_ns == T0
    dec = tr.decomposition()
    assert dec["queue_prefill_s"] == pytest.approx(0.050) and dec["handoff_s"] == pytest.approx(0.010)
    assert sum(dec.values()) == pytest.approx(tr.ttft_s)


def test_json_form_keys_are_the_cli_contract():
    rec = Trace.from_rows(_summary(), SPANS).to_json()
    assert list(rec) == ["trace_id", "request_id", "mode", "dispatch", "outcome", "ttft_s", "handoff_s",
                         "handoff_err_s", "handoff_raw_s", "handoff_note", "clock_offset_s", "clock_interval_s",
                         "p_engine", "d_engine", "start_ns", "spans"]
    assert [list(s) for s in rec["spans"]][0] == ["name", "role", "start_ns", "end_ns", "span_id", "parent_id",
                                                  "outcome", "attributes"]
    assert rec == tracemodel.trace_record(_summary(), SPANS)
    json.dumps(rec)


def test_static_path_for_durations_without_positions():
    assert tracemodel.static_path("push", "registration.send") == OVERLAP
    assert tracemodel.static_path("pull", "read.complete") == CRITICAL
    assert tracemodel.static_path("push", "write.complete") == CRITICAL
    assert tracemodel.static_path("push", "request") is None and tracemodel.static_path("pull", "kv.ready") is None


def test_handoff_costs_split_by_the_same_rule():
    other = "cd" * 16
    traces = [(TID, "push", PF, KV, 0.010, 0.0), (other, "push", PF, KV + 10 * MS, 0.020, None)]
    spans = [(TID, s["role"], s["name"], s["start_ns"], s["end_ns"]) for s in SPANS]
    spans += [(other, "prefill", "write.post", PF, PF + 4 * MS), ("ef" * 16, "prefill", "write.post", 0, 10)]
    costs = tracemodel.handoff_costs(traces, spans)
    assert costs.requests == {"push": (2, pytest.approx(0.015))}
    assert costs.phases[("push", "prefill", "match")] == pytest.approx((0.001, 0.046))
    assert costs.phases[("push", "prefill", "write.post")] == pytest.approx((0.006, 0.0))
    assert costs.phases[("push", "decode", "registration.send")] == pytest.approx((0.0, 0.001))
    assert not any(k[2] in tracemodel.NOT_HANDOFF_PHASES for k in costs.phases)


def test_d_spans_move_onto_p_clock_by_the_offset():
    """D's clock 250 ms ahead: its spans and kv.ready shift back by the
    store's offset, so the critical path and the costs read as on one clock."""
    shift = 250 * MS
    moved = [dict(s, start_ns=s["start_ns"] + shift, end_ns=s["end_ns"] + shift) if s["role"] == "decode" else s
             for s in SPANS]
    summary = dict(_summary(), kv_ready_ns=KV + shift, clock_offset_s=0.25)
    tr = Trace.from_rows(summary, moved)
    ref = Trace.from_rows(_summary(), SPANS)
    assert tr.window == ref.window
    assert [(s.name, s.start_ns, s.end_ns, s.critical) for s in tr.spans] == \
        [(s.name, s.start_ns, s.end_ns, s.critical) for s in ref.spans]
    rows = [(TID, s["role"], s["name"], s["start_ns"], s["end_ns"]) for s in moved]
    assert tracemodel.handoff_costs([(TID, "push", PF, KV + shift, 0.010, 0.25)], rows).phases == \
        tracemodel.handoff_costs([(TID, "push", PF, KV, 0.010, 0.0)],
                                 [(TID, s["role"], s["name"], s["start_ns"], s["end_ns"]) for s in SPANS]).phases


@pytest.fixture(scope="module")
def fixture_store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("kvlens_home"), n_per_mode=6, bench=False)


def test_cli_dashboard_and_breakdown_agree(fixture_store):
    """The waterfall's '#', the dashboard's ``critical`` column and the
    breakdown's critical seconds all come from tracemodel."""
    with store.reading(fixture_store) as c:
        trs = tracemodel.slowest(c, 100)
    assert len(trs) == 12
    for tr in trs:
        _, df = D.trace_detail(fixture_store, tr.trace_id)
        assert sorted(zip(df["phase"], df["role"], df["critical"])) == sorted(
            (s.name, s.role, s.critical) for s in tr.spans)
        text = cli_traces.waterfall(tr)
        for s in tr.spans:
            if s.start_ns != s.end_ns:
                line = next(ln for ln in text.splitlines() if f" {s.name} " in ln and "[" in ln)
                assert ("#" in line) == s.critical, line
    done = [t for t in trs if t.handoff_s is not None]
    ph = D.phase_breakdown(fixture_store, None, None)
    for mode in ("push", "pull"):
        mine = [t for t in done if t.mode == mode]
        want: dict[str, float] = {}
        for t in mine:
            for s in t.spans:
                want[s.name] = want.get(s.name, 0.0) + tracemodel.critical_ns(
                    s.name, s.start_ns, s.end_ns, *t.window) / 1e9 / len(mine)
        got = ph[(ph["mode"] == mode) & (ph["path"] == CRITICAL) & (ph["phase"] != D.UNATTRIBUTED)]
        assert got.groupby("phase")["seconds"].sum().to_dict() == pytest.approx(
            {k: v for k, v in want.items() if v > 0})


def test_traces_cli_json_is_the_model(fixture_store, capsys):
    from kvlens.cli import main

    assert main(["traces", "--store", str(fixture_store), "--mode", "pull", "--slowest", "3", "--json"]) == 0
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    with store.reading(fixture_store) as c:
        want = [t.to_json() for t in tracemodel.slowest(c, 3, mode="pull")]
    assert lines == want and len(lines) == 3
    assert main(["traces", "--store", str(fixture_store), "--slowest", "1"]) == 0
    out = capsys.readouterr().out
    assert "critical path" in out and "kv.ready" in out and "legend:" in out
