"""``kvlens traces --perfetto``: push and pull traces from the synthetic
store, converted to Chrome trace-event JSON, checked against the format
(every event's fields per phase type, µs times, nesting per thread, flow
pairs bound to spans that exist, metadata for every pid/tid) and through the
CLI."""

from __future__ import annotations

import json
import math
from collections import defaultdict

import pytest

from kvtrace import perfetto, store, tracemodel
from kvtrace.tracemodel import Span, Trace
from kvrecord import derived
from kvrecord import semconv as sc
from kvlens.cli import main

MS = 1_000_000
_POINTS = {p.value for p in sc.POINT_PHASES}
_REQUIRED = {
    "X": {"name", "ph", "ts", "dur", "pid", "tid"},
    "i": {"name", "ph", "ts", "pid", "tid", "s"},
    "M": {"name", "ph", "pid", "args"},
    "s": {"name", "cat", "ph", "id", "ts", "pid", "tid"},
    "f": {"name", "cat", "ph", "id", "ts", "pid", "tid"},
}


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def ns(us: float) -> int:
    """A ``ts`` / ``dur`` as Perfetto's JSON importer reads it (a fraction
    would be truncated: kvlens writes whole µs)."""
    assert isinstance(us, int), us
    return int(us * 1000)


def check_format(doc: dict) -> dict:
    """Assert ``doc`` is valid trace-event JSON as kvlens writes it; return
    what the checks found (names, flows) for further assertions."""
    assert json.loads(json.dumps(doc, allow_nan=False)) == doc  # round-trips, no NaN
    events = doc["traceEvents"]
    assert events
    names: dict[tuple[int, int], str] = {}
    procs: dict[int, str] = {}
    slices: dict[tuple[int, int], list[dict]] = defaultdict(list)
    flows: dict[int, dict[str, dict]] = defaultdict(dict)
    for ev in events:
        ph = ev["ph"]
        assert ph in _REQUIRED, ev
        assert _REQUIRED[ph] <= set(ev), (ph, sorted(_REQUIRED[ph] - set(ev)))
        assert isinstance(ev["pid"], int) and isinstance(ev.get("tid", 0), int)
        if ph == "M":
            assert ev["name"] in ("process_name", "thread_name", "process_sort_index", "thread_sort_index")
            if ev["name"] == "process_name":
                procs[ev["pid"]] = ev["args"]["name"]
            elif ev["name"] == "thread_name":
                names[(ev["pid"], ev["tid"])] = ev["args"]["name"]
            else:
                assert isinstance(ev["args"]["sort_index"], int)
            continue
        assert _num(ev["ts"]), ev
        if ph == "X":
            assert _num(ev["dur"]), ev
            assert ev["name"] not in _POINTS
        if ph == "i":
            assert ev["s"] in ("t", "p", "g")
        if ph in "Xi":
            slices[(ev["pid"], ev["tid"])].append(ev)
        else:
            assert ph not in flows[ev["id"]], f"two {ph} events for flow {ev['id']}"
            flows[ev["id"]][ph] = ev
    used = {(e["pid"], e["tid"]) for e in events if e["ph"] != "M"}
    assert used <= set(names), f"threads without a name: {used - set(names)}"
    assert {p for p, _ in used} <= set(procs), "processes without a name"
    for key, evs in slices.items():  # X events nest on each thread (the viewers cannot draw overlap)
        stack: list[int] = []  # in ns as Perfetto reads them: int(µs * 1000), start and duration apart
        for e in sorted((e for e in evs if e["ph"] == "X"), key=lambda e: (ns(e["ts"]), -ns(e["dur"]))):
            while stack and stack[-1] <= ns(e["ts"]):
                stack.pop()
            assert not stack or ns(e["ts"]) + ns(e["dur"]) <= stack[-1], (names[key], e["name"])
            stack.append(ns(e["ts"]) + ns(e["dur"]))
    for fid, pair in flows.items():
        assert set(pair) == {"s", "f"}, f"flow {fid} has {sorted(pair)}"
        s, f = pair["s"], pair["f"]
        assert (s["name"], s["cat"]) == (f["name"], f["cat"])
        assert f["ts"] >= s["ts"]
        assert s["pid"] != f["pid"], "an arrow crosses between processes"
        assert _anchored(slices[(s["pid"], s["tid"])], s, enclosing=True), s
        assert _anchored(slices[(f["pid"], f["tid"])], f, enclosing=f.get("bp") == "e"), f
    return {"procs": procs, "threads": names, "flows": flows, "slices": slices}


def _anchored(evs: list[dict], flow: dict, *, enclosing: bool) -> bool:
    """A flow end binds to a span there: an enclosing X, or an instant at its
    timestamp (a finish without ``bp`` binds to the slice starting there)."""
    t = flow["ts"]
    for e in evs:
        if e["ph"] == "i" and e["ts"] == t:
            return True
        if e["ph"] == "X" and (e["ts"] <= t <= e["ts"] + e["dur"] if enclosing else e["ts"] == t):
            return True
    return False


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    from store_fixture import make_store

    path = make_store(tmp_path_factory.mktemp("kvlens_home"), n_per_mode=4, bench=False)
    with store.reading(path) as conn:
        trs = tracemodel.slowest(conn, 8)
    return path, trs


def _by_mode(trs, mode):
    return next(t for t in trs if t.mode == mode and t.outcome == "ok" and t.window)


def _flow_names(found):
    return {p["s"]["name"] for p in found["flows"].values()}


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_one_trace_is_valid_and_has_its_arrows(synthetic, mode):
    tr = _by_mode(synthetic[1], mode)
    doc = perfetto.document([tr])
    found = check_format(doc)
    want = {
        "push": {"PUSH_REG (D's registration)", "WRITE done notification"},
        "pull": {"P's answer to the router", "the router's request to D", "READ done notification"},
    }[mode]
    assert _flow_names(found) == want
    assert sorted(found["procs"].values()) == sorted(f"{r} · {tr.trace_id[:8]}" for r in ("router", "P p0", "D d0"))
    # every span of the trace model is there once, points as instants, derived ones marked
    evs = [e for e in doc["traceEvents"] if e["ph"] in "Xi" and e.get("cat") != perfetto.CAT_WINDOW]
    assert sorted(e["name"] for e in evs) == sorted(s.name for s in tr.spans)
    for e in evs:
        thread = found["threads"][(e["pid"], e["tid"])]
        if e["name"] in _POINTS:
            assert e["ph"] == "i"
        is_derived = e["name"] in {p.value for p in derived.DERIVED_PHASES}
        assert (e["cat"] == perfetto.CAT_DERIVED) == is_derived == (thread == "derived")
        assert "trace_id" in e["args"]
    window = [e for e in doc["traceEvents"] if e.get("cat") == perfetto.CAT_WINDOW]
    assert len(window) == 1 and window[0]["args"]["handoff_s"] == tr.handoff_s
    assert window[0]["dur"] == pytest.approx(tr.handoff_s * 1e6, abs=1)
    origin = perfetto.origin_ns([tr])  # every span where the trace model has it, to the µs

    def us(t):
        return (t - origin + 500) // 1000

    spans = sorted((s.name, us(s.start_ns), us(s.end_ns)) for s in tr.spans)
    assert spans == sorted((e["name"], e["ts"], e["ts"] + e.get("dur", 0)) for e in evs)
    for e in evs:
        if e["ph"] == "X":
            s = next(s for s in tr.spans if s.name == e["name"])
            assert e["args"]["duration_ms"] == (s.end_ns - s.start_ns) / 1e6
    assert window[0]["args"]["handoff_err_s"] == tr.handoff_err_s
    assert doc["otherData"]["traces"][0]["trace_id"] == tr.trace_id


def test_threads_follow_the_hooks(synthetic):
    tr = _by_mode(synthetic[1], "push")
    found = check_format(perfetto.document([tr]))
    where = {}
    for (pid, tid), evs in found["slices"].items():
        for e in evs:
            where[e["name"]] = (found["procs"][pid].split(" ·")[0], found["threads"][(pid, tid)])
    assert where["prefill.finished"] == ("P p0", "scheduler")
    assert where["registration.stage"] == ("D d0", "scheduler")
    assert where["registration.send"] == ("D d0", "writer")
    assert where["write.post"] == ("P p0", "writer")
    assert where["write.complete"] == ("P p0", "worker")
    assert where["kv.ready"] == ("D d0", "worker")
    assert where["write.notify"] == ("D d0", "derived")
    assert where["request"] == ("router", "proxy")


def test_slowest_traces_each_get_their_own_processes(synthetic):
    trs = synthetic[1]
    found = check_format(perfetto.document(trs))
    assert len(found["procs"]) == 3 * len(trs)
    for t in trs:  # each trace's spans are in processes named with its id, nowhere else
        assert sum(t.trace_id[:8] in n for n in found["procs"].values()) == 3
    origin = perfetto.origin_ns(trs)
    assert origin == min(t.t0_ns for t in trs)
    assert min(ns(e["ts"]) for e in perfetto.document(trs)["traceEvents"] if "ts" in e) == 0


def test_d_spans_are_on_ps_clock(synthetic):
    """A store whose D clock runs 250 ms ahead: the trace model moves D's
    spans back, and the file shows them where the model put them."""
    path, trs = synthetic
    tr = _by_mode(trs, "push")
    off = 0.25
    with store.reading(path) as conn:
        rows = store.slowest(conn, 1, trace_ids=[tr.trace_id])
        spans = store.spans_for(conn, [tr.trace_id])[tr.trace_id]
    shifted = [
        dict(s, start_ns=s["start_ns"] + int(off * 1e9), end_ns=s["end_ns"] + int(off * 1e9))
        if s.get("role") == "decode"
        else s
        for s in spans
    ]
    summary = dict(rows[0], clock_offset_s=off, kv_ready_ns=rows[0]["kv_ready_ns"] + int(off * 1e9))
    moved = Trace.from_rows(summary, shifted)
    a, b = perfetto.document([tr]), perfetto.document([moved])
    check_format(b)
    ts = [(e["name"], e["ts"]) for e in a["traceEvents"] if e["ph"] in "Xi"]
    assert ts == [(e["name"], e["ts"]) for e in b["traceEvents"] if e["ph"] in "Xi"]
    kv = next(e for e in b["traceEvents"] if e["name"] == "kv.ready")
    assert "moved onto P's" in kv["args"]["clock"]
    assert b["otherData"]["traces"][0]["clock_offset_s"] == off


def _span(name, role, t0, t1, **attrs):
    return Span(name=name, role=role, start_ns=t0, end_ns=t1, attributes=attrs, point=name in _POINTS)


def test_arrow_back_in_time_is_left_out_and_said():
    """kv.ready before P saw its WRITE done (within a clock bound): no arrow
    the viewer would drop, and the trace's metadata names it."""
    b = 10**18
    spans = (
        _span("registration.send", "decode", b, b + MS),
        _span("registration.receive", "prefill", b + 2 * MS, b + 2 * MS),
        _span("write.complete", "prefill", b + 5 * MS, b + 9 * MS),
        _span("kv.ready", "decode", b + 8 * MS, b + 8 * MS),
    )
    tr = Trace(trace_id="ab" * 16, mode="push", spans=spans, p_engine="p0", d_engine="d0")
    doc = perfetto.document([tr])
    found = check_format(doc)
    assert _flow_names(found) == {"PUSH_REG (D's registration)"}
    assert doc["otherData"]["traces"][0]["arrows_left_out"] == ["WRITE done notification"]


def test_rank_overlap_and_text_attributes():
    b = 10**18
    spans = (
        _span("read.post", "decode", b, b + 2 * MS, **{perfetto.RANK_ATTR: 0}),
        _span("read.post", "decode", b, b + 3 * MS, **{perfetto.RANK_ATTR: 1}),
        _span("read.complete", "decode", b + 1 * MS, b + 5 * MS),
        _span("descriptor.prep", "decode", b + 2 * MS, b + 6 * MS),  # overlaps read.complete, unnested
        _span("llm_request", None, b, b + 9 * MS, **{"gen_ai.prompt": "secret words", "gen_ai.usage.prompt_tokens": 7}),
    )
    tr = Trace(trace_id="cd" * 16, mode="pull", spans=spans, d_engine="d0")
    doc = perfetto.document([tr])
    found = check_format(doc)
    threads = set(found["threads"].values())
    assert {"worker rank 0", "worker rank 1", "worker", "worker #2", "context"} <= threads
    assert "other · cdcdcdcd" in found["procs"].values()
    assert "secret words" not in json.dumps(doc)
    llm = next(e for e in doc["traceEvents"] if e["name"] == "llm_request")
    assert llm["args"]["gen_ai.usage.prompt_tokens"] == 7


def test_pull_without_router_goes_straight_to_d():
    b = 10**18
    spans = (
        _span("prefill.finished", "prefill", b, b),
        _span("alloc", "decode", b + 3 * MS, b + 3 * MS),
        _span("read.complete", "decode", b + 4 * MS, b + 6 * MS),
        _span("kv.released", "prefill", b + 7 * MS, b + 7 * MS),
    )
    found = check_format(perfetto.document([Trace(trace_id="ef" * 16, mode="pull", spans=spans)]))
    assert _flow_names(found) == {"P's answer to D", "READ done notification"}


# ------------------------------------------------------------------ CLI
def test_cli_writes_the_slowest(synthetic, tmp_path, capsys):
    path, _ = synthetic
    out = tmp_path / "t.json"
    assert main(["traces", "--store", str(path), "--slowest", "3", "--mode", "pull", "--perfetto", str(out)]) == 0
    doc = json.loads(out.read_text())
    check_format(doc)
    meta = doc["otherData"]["traces"]
    assert len(meta) == 3 and {m["mode"] for m in meta} == {"pull"}
    said = capsys.readouterr().out
    assert f"wrote 3 trace(s), {len(doc['traceEvents'])} events to {out}" in said


def test_cli_one_trace_to_stdout(synthetic, capsys):
    path, trs = synthetic
    tid = trs[0].trace_id
    assert main(["traces", "--store", str(path), "--trace", tid, "--perfetto", "-"]) == 0
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    check_format(doc)
    assert [m["trace_id"] for m in doc["otherData"]["traces"]] == [tid]
    assert "wrote 1 trace(s)" in cap.err and "stdout" in cap.err


@pytest.mark.parametrize("where", ["missing/dir/t.json", "."])
def test_cli_unwritable_path_is_exit_2(synthetic, tmp_path, capsys, where):
    out = tmp_path / where
    assert main(["traces", "--store", str(synthetic[0]), "--perfetto", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvlens traces: cannot write") and len(err.splitlines()) == 1
    assert "Traceback" not in err


def test_cli_nothing_matches_writes_nothing(synthetic, tmp_path, capsys):
    out = tmp_path / "none.json"
    assert main(["traces", "--store", str(synthetic[0]), "--since", "1s", "--perfetto", str(out)]) == 0
    assert not out.exists() and "not written" in capsys.readouterr().err
