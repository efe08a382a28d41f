"""The one trace model (kvtrace/tracemodel.py): critical-path marking,
handoff, decomposition, the ``kvlens traces --json`` form, and that the CLI,
the dashboard and the per-phase breakdown all follow it."""

from __future__ import annotations

import json

import pytest
from store_fixture import make_store

from dashboard import data
from kvtrace import costs, store, tracemodel
from kvtrace.tracemodel import CRITICAL, OVERLAP, Trace
from kvlens import traces as cli_traces

MS = 1_000_000
T0 = 1_700_000_000 * 10**9
PF, KV = T0 + 50 * MS, T0 + 60 * MS
TID = "ab" * 16


def _span(name, role, start, end, **kw):
    return {
        "name": name,
        "role": role,
        "start_ns": start,
        "end_ns": end,
        "span_id": f"{start:016x}"[-16:],
        "parent_id": None,
        "outcome": "ok",
        "attributes": {"kvlens.blocks": 4},
        **kw,
    }


def _summary(pf=PF, kv=KV, **kw):
    row = {
        "trace_id": TID,
        "request_id": TID,
        "mode": "push",
        "dispatch": "overlapped",
        "outcome": "ok",
        "start_ns": T0,
        "end_ns": T0 + 100 * MS,
        "ttft_s": 0.07,
        "prefill_finished_ns": pf,
        "kv_ready_ns": kv,
        "handoff_s": None if pf is None or kv is None else (kv - pf) / 1e9,
        "n_spans": 9,
    }
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
        "registration.stage": False,
        "registration.send": False,  # overlapped with prefill
        "match": True,  # a part of it lies inside the window
        "prefill.finished": True,
        "kv.ready": True,  # point phases at the window's ends
        "write.post": True,
        "write.complete": True,
        "kv.hold": False,  # P saw its WRITE done 2 ms after kv.ready: held after the handoff, off its path
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
    assert list(rec) == [
        "trace_id",
        "request_id",
        "mode",
        "dispatch",
        "outcome",
        "ttft_s",
        "handoff_s",
        "handoff_err_s",
        "handoff_raw_s",
        "handoff_note",
        "clock_offset_s",
        "clock_interval_s",
        "p_engine",
        "d_engine",
        "start_ns",
        "ttft_source",
        "ttft_err_s",
        "prompt_tokens",
        "split",
        "tpot_s",
        "half",
        "ranks",
        "transfer",
        "release",
        "kv_use",
        "keep",
        "open",
        "stale",
        "phases_s",
        "handoff_cpu_wait_s",
        "handoff_cpu_on_s",
        "handoff_cpu_unknown_s",
        "handoff_off_cpu_s",
        "phases_cpu_wait_s",
        "phases_cpu_on_s",
        "cpu_notes",
        "wire_progress_cpu_s",
        "spans",
    ]
    assert [list(s) for s in rec["spans"]][0] == [
        "name",
        "role",
        "start_ns",
        "end_ns",
        "span_id",
        "parent_id",
        "outcome",
        "attributes",
    ]
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
    hc = costs.handoff_costs(traces, spans)
    assert hc.requests == {"push": (2, pytest.approx(0.015))}
    assert hc.phases[("push", "prefill", "match")] == pytest.approx((0.001, 0.046))
    assert hc.phases[("push", "prefill", "write.post")] == pytest.approx((0.006, 0.0))
    assert hc.phases[("push", "decode", "registration.send")] == pytest.approx((0.0, 0.001))
    assert not any(k[2] in tracemodel.NOT_HANDOFF_PHASES for k in hc.phases)


def test_d_spans_move_onto_p_clock_by_the_offset():
    """D's clock 250 ms ahead: its spans and kv.ready shift back by the
    store's offset, so the critical path and the costs read as on one clock."""
    shift = 250 * MS
    moved = [
        dict(s, start_ns=s["start_ns"] + shift, end_ns=s["end_ns"] + shift) if s["role"] == "decode" else s
        for s in SPANS
    ]
    summary = dict(_summary(), kv_ready_ns=KV + shift, clock_offset_s=0.25)
    tr = Trace.from_rows(summary, moved)
    ref = Trace.from_rows(_summary(), SPANS)
    assert tr.window == ref.window
    assert [(s.name, s.start_ns, s.end_ns, s.critical) for s in tr.spans] == [
        (s.name, s.start_ns, s.end_ns, s.critical) for s in ref.spans
    ]
    rows = [(TID, s["role"], s["name"], s["start_ns"], s["end_ns"]) for s in moved]
    assert (
        costs.handoff_costs([(TID, "push", PF, KV + shift, 0.010, 0.25)], rows).phases
        == costs.handoff_costs(
            [(TID, "push", PF, KV, 0.010, 0.0)],
            [(TID, s["role"], s["name"], s["start_ns"], s["end_ns"]) for s in SPANS],
        ).phases
    )


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
        _, df = data.trace_detail(fixture_store, tr.trace_id)
        assert sorted(zip(df["phase"], df["role"], df["critical"])) == sorted(
            (s.name, s.role, s.critical) for s in tr.spans
        )
        text = cli_traces.waterfall(tr)
        for s in tr.spans:
            if s.start_ns != s.end_ns:
                line = next(ln for ln in text.splitlines() if f" {s.name} " in ln and "[" in ln)
                assert ("#" in line) == s.critical, line
    done = [t for t in trs if t.handoff_s is not None]
    ph = data.phase_breakdown(fixture_store, None, None)
    for mode in ("push", "pull"):
        mine = [t for t in done if t.mode == mode]
        want: dict[str, float] = {}
        for t in mine:
            for (_, name), ns in t.tiling().phases.items():
                want[name] = want.get(name, 0.0) + ns / 1e9 / len(mine)
        got = ph[(ph["mode"] == mode) & (ph["path"] == CRITICAL) & (ph["phase"] != data.UNATTRIBUTED)]
        assert got.groupby("phase")["seconds"].sum().to_dict() == pytest.approx(
            {k: v for k, v in want.items() if v > 0}
        )
        # a mode's bar adds up to its mean handoff, unattributed included
        bar = ph[(ph["mode"] == mode) & (ph["path"] == CRITICAL)]["seconds"].sum()
        assert bar == pytest.approx(sum(t.handoff_s for t in mine) / len(mine), rel=1e-6)


def test_fixture_handoffs_are_tiled_by_named_phases(fixture_store):
    """The fixture's traces carry every new phase; the named phases (recorded
    and derived) cover the whole handoff of each."""
    with store.reading(fixture_store) as c:
        trs = [t for t in tracemodel.slowest(c, 100) if t.window]
        groups = costs.breakdown(c)
    names = {m: set().union(*({s.name for s in t.spans} for t in trs if t.mode == m)) for m in ("push", "pull")}
    assert {"decode.queue", "registration.dispatch", "writer.wake", "prefill.dispatch", "write.notify"} <= names["push"]
    assert {"prefill.respond", "decode.intake", "decode.queue", "decode.dispatch"} <= names["pull"]
    for t in trs:
        til = t.tiling()
        if t.mode == "push":
            assert til.unattributed_ns == 0, til.gaps
        else:  # D's READ done -> kv.ready (a fraction of a ms, around P's kv.released) has no name
            assert {(a, b) for a, b, _ in til.gaps} <= {
                ("D:read.complete.end", "P:kv.released"),
                ("P:kv.released", "D:kv.ready"),
            }
            assert til.unattributed_share < 0.05
    assert set(groups) == {"push", "pull"}
    assert groups["push"].median_unattributed_share == 0 and groups["pull"].median_unattributed_share < 0.05
    assert tracemodel.dominant_words(groups["pull"]).startswith("pull: ")


# ------------------------------------------------------------------ tiling
def _s(name, role, a, b):
    return tracemodel.Span(name=name, role=role, start_ns=T0 + int(a * MS), end_ns=T0 + int(b * MS))


def test_tile_counts_overlap_once_and_names_the_gaps():
    """Window 0..100 ms: match 0..30 holds writer.wake 10..30 (the later
    start wins its stretch), write.complete 40..70, a gap 30..40 and 70..100;
    a non-kvlens span (vLLM's llm_request) and the root never count."""
    spans = [
        _s("prefill.finished", "prefill", 0, 0),
        _s("match", "prefill", -50, 30),
        _s("writer.wake", "prefill", 10, 30),
        _s("write.complete", "prefill", 40, 70),
        _s("request", "router", -100, 200),
        _s("llm_request", "decode", 0, 100),
        _s("kv.ready", "decode", 100, 100),
    ]
    t = tracemodel.tile(spans, (T0, T0 + 100 * MS))
    assert t.handoff_ns == 100 * MS
    assert t.phases == {
        ("prefill", "match"): 10 * MS,
        ("prefill", "writer.wake"): 20 * MS,
        ("prefill", "write.complete"): 30 * MS,
    }
    assert t.named_ns == 60 * MS and t.unattributed_ns == 40 * MS and t.unattributed_share == pytest.approx(0.4)
    assert t.gaps == (
        ("P:match.end", "P:write.complete.start", 10 * MS),
        ("P:write.complete.end", "D:kv.ready", 30 * MS),
    )
    # same start: the shorter span wins; no window: no tiling
    t2 = tracemodel.tile([_s("match", "prefill", 0, 50), _s("writer.wake", "prefill", 0, 20)], (T0, T0 + 50 * MS))
    assert t2.phases == {("prefill", "writer.wake"): 20 * MS, ("prefill", "match"): 30 * MS}
    assert tracemodel.tile(spans, None) is None


def test_tile_waiting_yields_and_starts_are_the_spans_own():
    """match (P waiting for D) only keeps what nothing else names, even when it
    started later; between two other phases clipped at the window's start, the
    one that really started later wins."""
    w = (T0, T0 + 40 * MS)
    t = tracemodel.tile(
        [
            _s("decode.queue", "decode", -30, 20),
            _s("match", "prefill", 5, 30),
            _s("registration.send", "decode", 25, 28),
        ],
        w,
    )
    assert t.phases == {
        ("decode", "decode.queue"): 20 * MS,
        ("prefill", "match"): 7 * MS,
        ("decode", "registration.send"): 3 * MS,
    }
    t = tracemodel.tile([_s("decode.queue", "decode", -30, 10), _s("registration.dispatch", "decode", -5, 10)], w)
    assert t.phases == {("decode", "registration.dispatch"): 10 * MS}


def test_derived_phases_come_from_two_recorded_timestamps():
    pull = [
        _s("prefill.finished", "prefill", 0, 0),
        _s("relay", "router", 8, 8.2),
        _s("decode.queue", "decode", 9, 30),
        _s("alloc", "decode", 30, 30),
        _s("descriptor.prep", "decode", 31, 31.5),
        _s("read.post", "decode", 31.5, 32),
    ]
    got = {d[0]: d[1:] for d in tracemodel.derive(pull)}
    assert got == {
        "prefill.respond": ("prefill", T0, T0 + 8 * MS),
        "decode.intake": ("decode", T0 + int(8.2 * MS), T0 + 9 * MS),  # relay end -> D's arrival
        "decode.dispatch": ("decode", T0 + 30 * MS, T0 + 31 * MS),
    }
    # a handshake first: decode.dispatch ends where it starts
    hs = pull + [_s("handshake", "decode", 30.5, 31)]
    assert {d[0]: d[3] for d in tracemodel.derive(hs)}["decode.dispatch"] == T0 + int(30.5 * MS)
    # reversed ends (clocks disagree) or a missing end: nothing derived
    assert tracemodel.derive([_s("relay", "router", 5, 6), _s("decode.queue", "decode", 4, 9)]) == []
    assert tracemodel.derive([_s("prefill.finished", "prefill", 0, 0)]) == []
    push = [
        _s("registration.stage", "decode", -30, -30),
        _s("registration.send", "decode", -20, -19),
        _s("prefill.finished", "prefill", 0, 0),
        _s("writer.wake", "prefill", 2, 3),
        _s("write.complete", "prefill", 4, 9),
        _s("kv.ready", "decode", 20, 20),
    ]
    assert {d[0]: d[1:] for d in tracemodel.derive(push)} == {
        "registration.dispatch": ("decode", T0 - 30 * MS, T0 - 20 * MS),
        "prefill.dispatch": ("prefill", T0, T0 + 2 * MS),
        "write.notify": ("decode", T0 + 9 * MS, T0 + 20 * MS),
    }


def test_derived_spans_in_the_trace_marked_and_drawn():
    spans = SPANS + [_span("writer.wake", "prefill", PF + 1 * MS, PF + 2 * MS)]
    tr = Trace.from_rows(_summary(), spans)
    derived = [s for s in tr.spans if s.attributes.get("kvlens.derived")]
    assert [(s.name, s.role, s.start_ns, s.end_ns, s.critical) for s in derived] == [
        ("prefill.dispatch", "prefill", PF, PF + 1 * MS, True),
        ("kv.hold", "prefill", KV, KV + 2 * MS, False),
    ]
    assert [s.start_ns for s in tr.spans] == sorted(s.start_ns for s in tr.spans)
    assert "prefill.dispatch" in cli_traces.waterfall(tr)
    assert tr.to_json()["spans"][[s.name for s in tr.spans].index("prefill.dispatch")]["attributes"] == {
        "kvlens.derived": True
    }


def test_dominant_words():
    b = tracemodel.summarize(
        [
            (
                "pull",
                tracemodel.Tiling(
                    100,
                    {
                        ("decode", "decode.queue"): 71,
                        ("prefill", "prefill.respond"): 12,
                        ("decode", "read.complete"): 9,
                        ("decode", "read.post"): 5,
                    },
                    (),
                ),
            )
        ]
    )["pull"]
    assert tracemodel.dominant_words(b) == (
        "pull: 71 % of the handoff is D's scheduler queue (decode.queue), then 12 % P's response path to "
        "the router (prefill.respond), 9 % the READ posted -> seen done (read.complete); unattributed 3 % "
        "(median per request 3 %)"
    )
    assert tracemodel.dominant_words(None, "push") == "push: no completed handoff to break down"
    assert dict(b.shares())["unattributed"] == pytest.approx(0.03) and b.shares()[0][0] == "decode.queue"


def test_breakdown_median_is_per_request():
    tl = [
        tracemodel.Tiling(100, {("p", "match"): 100}, ()),
        tracemodel.Tiling(100, {("p", "match"): 50}, ()),
        tracemodel.Tiling(1000, {("p", "match"): 0}, (("a", "b", 1000),)),
    ]
    b = tracemodel.summarize([("push", t) for t in tl])["push"]
    assert b.requests == 3 and b.median_unattributed_share == pytest.approx(0.5)
    assert b.unattributed_ns == 1050 and b.top_gaps() == [("a", "b", 1, 1000, 1000)]


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
