"""CPU or wire in ``kvlens traces --perfetto``: thread-state slices (cpu wait,
on cpu, off cpu) beside each recorded span with CPU figures, in proportion,
saying that only the totals are known; ``cpu unknown`` with the reason; the
progress thread's figures on the wire spans with the spin note. The file
stays valid trace-event JSON (the format checks of test_perfetto.py)."""

from __future__ import annotations

import pytest
from test_perfetto import _span, check_format

from kvrecord import semconv as sc
from kvtrace import cpusplit, perfetto
from kvtrace.tracemodel import Trace

MS = 1_000_000
B = 10**18


def _doc(*spans):
    return perfetto.document([Trace(trace_id="ab" * 16, mode="pull", spans=spans, d_engine="d0")])


def _cpu_events(doc, track_suffix=" cpu"):
    found = check_format(doc)
    names = found["threads"]
    return [
        e
        for e in doc["traceEvents"]
        if e.get("cat") == perfetto.CAT_CPU and names[(e["pid"], e["tid"])].split(" #")[0].endswith(track_suffix)
    ], found


def test_states_laid_end_to_end_in_proportion():
    fig = {sc.ATTR_CPU_ON_S: 0.002, sc.ATTR_CPU_WAIT_S: 0.003, sc.ATTR_CPU_TID: 77}
    doc = _doc(_span("read.post", "decode", B, B + 10 * MS, **fig))
    evs, found = _cpu_events(doc)
    assert [e["name"] for e in evs] == ["cpu wait 3.0 ms", "on cpu 2.0 ms", "off cpu 5.0 ms"]
    assert [e["dur"] for e in evs] == [3000, 2000, 5000]  # µs, over the span's 10 ms
    post = next(e for e in doc["traceEvents"] if e["name"] == "read.post")
    assert evs[0]["ts"] == post["ts"] and evs[-1]["ts"] + evs[-1]["dur"] == post["ts"] + post["dur"]
    assert all(a["ts"] + a["dur"] == z["ts"] for a, z in zip(evs, evs[1:]))  # end to end
    assert found["threads"][(evs[0]["pid"], evs[0]["tid"])] == "worker cpu"  # beside the span's own thread
    args = evs[0]["args"]
    assert args["order"] == perfetto.CPU_ORDER_NOTE and "not when within it" in args["order"]
    assert args["state"] == "cpu wait" and args["seconds"] == 0.003 and args["thread_tid"] == 77
    assert args["share_of_span"] == pytest.approx(0.3) and args["phase"] == "read.post"


def test_no_wait_draws_no_wait_slice_and_unknown_says_why():
    doc = _doc(
        _span("read.post", "decode", B, B + 4 * MS, **{sc.ATTR_CPU_ON_S: 0.004, sc.ATTR_CPU_WAIT_S: 0.0}),
        _span("descriptor.prep", "decode", B + 4 * MS, B + 6 * MS, **{sc.ATTR_CPU_UNKNOWN: "schedstat missing"}),
        _span("handshake", "decode", B + 6 * MS, B + 7 * MS),  # a store from before the figures: nothing
    )
    evs, _ = _cpu_events(doc)
    assert [e["name"] for e in evs] == ["on cpu 4.0 ms", "cpu unknown"]
    assert evs[1]["args"]["unknown"] == "schedstat missing" and evs[1]["dur"] == 2000
    assert not any("0.0 ms" in e["name"] for e in evs)  # never a 0 figure drawn as a state


def test_overlapping_spans_get_lanes_that_never_overlap():
    f = {sc.ATTR_CPU_ON_S: 0.001, sc.ATTR_CPU_WAIT_S: 0.001}
    doc = _doc(
        _span("read.complete", "decode", B + 1 * MS, B + 5 * MS, **f),
        _span("descriptor.prep", "decode", B + 2 * MS, B + 6 * MS, **f),  # overlaps, unnested
        _span("read.post", "decode", B + 2 * MS, B + 3 * MS, **f),  # nested in read.complete
    )
    evs, found = _cpu_events(doc)  # check_format: every thread's X events nest
    lanes = {found["threads"][(e["pid"], e["tid"])] for e in evs}
    assert lanes == {"worker cpu", "worker cpu #2", "worker cpu #3"}


def test_wire_span_carries_the_progress_thread_with_the_spin_note():
    wire = {
        sc.ATTR_CPU_ON_S: 0.001,
        sc.ATTR_CPU_WAIT_S: 0.001,
        sc.ATTR_CPU_PROGRESS_ON_S: 0.007,
        sc.ATTR_CPU_PROGRESS_WAIT_S: 0.002,
        sc.ATTR_CPU_PROGRESS_SPINS: True,
    }
    doc = _doc(_span("read.complete", "decode", B, B + 10 * MS, **wire))
    prog, found = _cpu_events(doc, " progress")
    assert [e["name"] for e in prog] == [
        "progress cpu wait 2.0 ms",
        "progress on cpu 7.0 ms",
        "progress off cpu 1.0 ms",
    ]
    assert all(e["args"]["note"] == cpusplit.SPIN_NOTE and e["args"]["spins"] is True for e in prog)
    assert found["threads"][(prog[0]["pid"], prog[0]["tid"])] == "worker progress"
    # several progress threads summed past the span: scaled to it, off cpu none
    wire |= {sc.ATTR_CPU_PROGRESS_ON_S: 0.015, sc.ATTR_CPU_PROGRESS_WAIT_S: 0.005}
    prog, _ = _cpu_events(_doc(_span("read.complete", "decode", B, B + 10 * MS, **wire)), " progress")
    assert [(e["name"], e["dur"]) for e in prog] == [
        ("progress cpu wait 5.0 ms", 2500),
        ("progress on cpu 15.0 ms", 7500),
    ]


def test_the_synthetic_store_stays_valid(tmp_path):
    """Traces of a store written before CPU figures: no cpu slices, the file as before."""
    from store_fixture import make_store

    from kvtrace import store, tracemodel

    path = make_store(tmp_path, n_per_mode=2, bench=False)
    with store.reading(path) as conn:
        trs = tracemodel.slowest(conn, 4)
    doc = perfetto.document(trs)
    check_format(doc)
    assert not [e for e in doc["traceEvents"] if e.get("cat") == perfetto.CAT_CPU]
