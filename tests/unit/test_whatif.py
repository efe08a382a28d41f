"""The what-if (issue 31): a handoff built from known phase durations is
reproduced from the other mode's trace, both ways; what cannot be used is
said; ``kvlens whatif`` on both store backends."""

from __future__ import annotations

import json
import time

import pytest

from kvlens.cli import main
from kvrecord import semconv as sc
from kvtrace import stats
from kvtrace import whatif as w
from kvtrace.tracemodel import Trace

P = sc.Phase
US = 1_000  # ns
T0 = 1_700_000_000 * 10**9
PF = T0 + 50_000 * US  # prefill.finished: 50 ms after the router's arrival
BYTES = 3_000_000
XFER_S = 0.0015  # NIXL's transfer time: 2 GB/s over BYTES
REST_S = 0.060  # TTFT minus handoff: queue + prefill + D's first step


def _span(name: P, role: str, a_us: float, b_us: float | None = None, attrs: dict | None = None) -> dict:
    """A span at PF + a_us .. PF + b_us (microseconds; negative: before prefill finished)."""
    b_us = a_us if b_us is None else b_us
    return {
        "name": name.value,
        "role": role,
        "start_ns": PF + int(a_us * US),
        "end_ns": PF + int(b_us * US),
        "outcome": "ok",
        "attributes": attrs or {},
    }


def _trace(tid: str, mode: str, spans: list[dict], kv_us: float, dispatch: str) -> Trace:
    handoff = kv_us * US / 1e9
    row = {
        "trace_id": tid,
        "mode": mode,
        "dispatch": dispatch,
        "outcome": "ok",
        "start_ns": T0,
        "prefill_finished_ns": PF,
        "kv_ready_ns": PF + int(kv_us * US),
        "handoff_s": handoff,
        "ttft_s": handoff + REST_S,
        "clock_offset_s": 0.0,
    }
    common = [
        {**_span(P.REQUEST, "router", -50_000, 200_000), "attributes": {}},
        _span(P.PREFILL, "prefill", -49_000, 0, {sc.ATTR_TOKENS: 1000}),
        _span(P.PREFILL_FINISHED, "prefill", 0),
        _span(P.KV_READY, "decode", kv_us),
    ]
    return Trace.from_rows(row, common + spans)


XFER = {sc.ATTR_BYTES: BYTES, sc.ATTR_NIXL_XFER_S: XFER_S}


def pull_trace(i: int) -> Trace:
    """respond 0.5 + relay 0.1 + intake 0.6 + queue 1.4 + dispatch 0.6 + prep 0.3 + post 0.5
    + READ 2.0 (wire 1.5, noticed 0.5) = 6.0 ms; P hears D's read-done 0.7 ms after it."""
    spans = [
        _span(P.RELAY, "router", 500, 600),
        _span(P.DECODE_QUEUE, "decode", 1200, 2600),
        _span(P.ALLOC, "decode", 2600),
        _span(P.DESCRIPTOR_PREP, "decode", 3200, 3500),
        _span(P.READ_POST, "decode", 3500, 4000),
        _span(P.READ_COMPLETE, "decode", 4000, 6000, XFER),
        _span(P.KV_RELEASED, "prefill", 6700),
    ]
    return _trace(f"{i:032x}", "pull", spans, 6000, "sequential")


def push_trace(i: int) -> Trace:
    """Overlapped: D's intake 0.6 ms after the router's arrival, its queue 1.4 ms, all
    before P finished; then P's step 0.6 + prep 0.3 + post 0.5 + WRITE 2.0 (wire 1.5,
    noticed 0.5) + notification 0.7 = 4.1 ms."""
    spans = [
        _span(P.DECODE_QUEUE, "decode", -49_400, -48_000),
        _span(P.REGISTRATION_STAGE, "decode", -48_000),
        _span(P.REGISTRATION_SEND, "decode", -47_700, -47_000),
        _span(P.REGISTRATION_RECEIVE, "prefill", -46_500),
        _span(P.MATCH, "prefill", -46_500, 600, {sc.ATTR_MATCH_FIRST: "registration"}),
        _span(P.WRITER_WAKE, "prefill", 600, 600),
        _span(P.DESCRIPTOR_PREP, "prefill", 600, 900),
        _span(P.WRITE_POST, "prefill", 900, 1400),
        _span(P.WRITE_COMPLETE, "prefill", 1400, 3400, XFER),
    ]
    return _trace(f"{1000 + i:032x}", "push", spans, 4100, "overlapped")


def test_the_built_traces_measure_what_they_were_built_from():
    assert pull_trace(0).handoff_s == pytest.approx(0.006) and push_trace(0).handoff_s == pytest.approx(0.0041)
    phases = {n: ns for (_, n), ns in push_trace(0).tiling().phases.items()}
    assert phases[P.PREFILL_DISPATCH.value] == 600 * US and phases[P.WRITE_NOTIFY.value] == 700 * US


@pytest.mark.parametrize(
    "src,dst,make,other", [("pull", "push", pull_trace, push_trace), ("push", "pull", push_trace, pull_trace)]
)
def test_the_whatif_reproduces_a_handoff_built_from_known_phases(src, dst, make, other):
    measured = [other(i) for i in range(8)]
    got = w.predict(src, [make(i) for i in range(8)], measured)
    assert got.status == "ok" and got.used == 8 and got.to_mode == dst
    want = measured[0].handoff_s
    assert got.handoff.p50 == pytest.approx(want, abs=1e-9)
    assert got.handoff.lo == pytest.approx(want, abs=1e-9) and got.handoff.hi == pytest.approx(want, abs=1e-9)
    assert got.ttft.p50 == pytest.approx(want + REST_S, abs=1e-9)
    assert got.measured_to["handoff_in_interval"] is True and got.measured_to["handoff_error"] == pytest.approx(
        0, abs=1e-6
    )
    # identical measured requests: sampling alone moves nothing
    assert got.measured_to["handoff_floor"] == 0.0
    doc = got.to_json()
    assert {b["name"] for b in doc["borrowed"]} >= {"bandwidth"}
    bw = next(b for b in doc["borrowed"] if b["name"] == "bandwidth")
    assert bw["p50"] == pytest.approx(BYTES / XFER_S) and bw["unit"] == "bytes/s" and bw["source"]
    assert all(b["assumption"] for b in doc["borrowed"]) and len(doc["assumptions"]) >= 6


def test_the_borrowed_figures_spread_into_the_interval():
    """Requests whose P step varies: the interval is no longer a point, and holds the p50."""
    traces = []
    for i in range(40):
        t = pull_trace(i)
        late = (i % 4) * 250 * US  # D's step to its worker: 0.6 .. 1.35 ms
        spans = [
            s
            if s.name not in (P.DESCRIPTOR_PREP.value, P.READ_POST.value, P.READ_COMPLETE.value, P.KV_RELEASED.value)
            else s.__class__(**{**s.__dict__, "start_ns": s.start_ns + late, "end_ns": s.end_ns + late})
            for s in t.spans
            if not s.attributes.get(sc.ATTR_DERIVED)
        ]
        traces.append(
            Trace.from_rows({**_row_of(t), "kv_ready_ns": t.kv_ready_ns + late}, [s.to_json() for s in spans])
        )
    got = w.predict("pull", traces)
    assert got.handoff.lo < got.handoff.hi and got.handoff.lo <= got.handoff.p50 <= got.handoff.hi
    assert got.handoff.p10 <= got.handoff.p50 <= got.handoff.p90


def _row_of(t: Trace) -> dict:
    return {
        "trace_id": t.trace_id,
        "mode": t.mode,
        "dispatch": t.dispatch,
        "outcome": t.outcome,
        "start_ns": t.start_ns,
        "prefill_finished_ns": t.prefill_finished_ns,
        "kv_ready_ns": t.kv_ready_ns,
        "handoff_s": t.handoff_s,
        "ttft_s": t.ttft_s,
        "clock_offset_s": 0.0,
    }


def test_what_cannot_be_used_is_said():
    summary_only = Trace.from_rows({**_row_of(pull_trace(0)), "trace_id": "a" * 32})  # no spans kept
    failed = Trace.from_rows({**_row_of(pull_trace(1)), "outcome": "failed", "handoff_s": None})
    got = w.predict("pull", [summary_only, failed, pull_trace(2)])
    assert got.status == stats.NOT_ENOUGH and "1 usable pull requests" in got.note
    assert got.skipped == {"summary only (spans not kept)": 1, "not completed (no handoff)": 1}
    with pytest.raises(ValueError):
        w.predict("sideways", [])


@pytest.fixture
def synthetic(backend):
    from synthetic_store import build

    build(backend.store, backend.config(), time.time_ns() - 300 * 10**9, n_per_mode=24, span_s=240.0)
    return backend


@pytest.mark.parametrize("src", ["pull", "push"])
def test_whatif_json_on_both_backends(synthetic, capsys, src):
    assert main(["whatif", "--from", src, "--store", str(synthetic.store), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "ok" and doc["from"] == src and doc["requests_used"] >= w.MIN_REQUESTS
    fig = doc["predicted"]["handoff"]
    assert fig["interval_s"][0] <= fig["p50_s"] <= fig["interval_s"][1] and fig["p10_s"] <= fig["p90_s"]
    assert doc["measured_to"]["n"] > 0 and doc["measured_to"]["handoff_in_interval"] in (True, False)
    assert len(doc["requests"]) == doc["requests_used"] and doc["assumptions"]


def test_whatif_text_lists_borrowed_figures_and_assumptions(synthetic, capsys):
    assert main(["whatif", "--from", "pull", "--store", str(synthetic.store)]) == 0
    out = capsys.readouterr().out
    assert "predicted push p50" in out and "borrowed figures" in out and "Gb/s" in out and "assumptions:" in out
    assert "sampling alone: ±" in out and "error " in out


def test_the_floor_is_what_two_samples_of_one_distribution_disagree_by():
    """stats.sampling_floor: the p50s of two independent samples of one
    distribution, relative to its p50. A log-normal of sigma 1 sampled 20 at
    a time: the p50's sampling sd is about 1.25 * sigma / sqrt(20) in log
    terms (0.28), the difference of two about 0.40, whose median absolute
    value (0.67 sd) is about 0.27 in log, 25-35 % relative; more requests
    bring it down as 1 / sqrt(n)."""
    import numpy as np

    x = np.random.default_rng(3).lognormal(0.0, 1.0, 5000)
    f20 = stats.sampling_floor(x, n_a=20, n_b=20)
    f500 = stats.sampling_floor(x, n_a=500, n_b=500)
    assert 0.2 < f20 < 0.4 and f500 == pytest.approx(f20 / 5, rel=0.3)
    assert stats.sampling_floor([1.0] * 8) == 0.0
    assert stats.sampling_floor([0.0, 0.0, 0.0]) is None and stats.sampling_floor([1.0]) is None
    assert stats.sampling_floor([1.0, None, 3.0, float("nan")]) is not None  # None and NaN dropped


def _with_cpu(t: Trace, waits: dict[str, float], noticed_wait: float) -> Trace:
    """``t`` with CPU figures on its recorded spans: ``waits`` by phase, on-CPU 0."""
    import dataclasses

    spans = []
    for s in t.spans:
        a = dict(s.attributes)
        if s.name in waits:
            a |= {sc.ATTR_CPU_ON_S: 0.0, sc.ATTR_CPU_WAIT_S: waits[s.name]}
        if s.name == P.READ_COMPLETE.value:
            a |= {sc.ATTR_CPU_ON_S: 0.0, sc.ATTR_CPU_WAIT_S: 0.0}
            a |= {sc.ATTR_CPU_NOTICED_ON_S: 0.0, sc.ATTR_CPU_NOTICED_WAIT_S: noticed_wait}
        spans.append(dataclasses.replace(s, attributes=a))
    return dataclasses.replace(t, spans=tuple(spans))


def test_the_whatif_without_cpu_wait_removes_the_carried_phases_own_wait():
    """From pull: the kept phases (descriptor.prep, read.post, read.noticed) lose their own CPU wait (0.1 +
    0.2 + 0.3 ms); the transfer itself keeps its time (its wait is not separable); with the expected wait:
    that plus the measured mode's median handoff CPU wait (push has no figures here)."""
    waits = {P.DESCRIPTOR_PREP.value: 0.0001, P.READ_POST.value: 0.0002, P.DECODE_QUEUE.value: 0.0004}
    src = [_with_cpu(pull_trace(i), waits, 0.0003) for i in range(8)]
    measured = [push_trace(i) for i in range(8)]
    got = w.predict("pull", src, measured)
    want = measured[0].handoff_s
    assert got.handoff.p50 == pytest.approx(want, abs=1e-9)
    assert got.handoff_nowait.p50 == pytest.approx(want - 0.0006, abs=1e-9)
    assert got.measured_to["expected_cpu_wait_from"] == "pull"
    expected = got.measured_to["expected_cpu_wait_s"]
    assert expected == pytest.approx(0.0001 + 0.0002 + 0.0003 + 0.0004, abs=1e-9)
    assert got.handoff_expected_wait.p50 == pytest.approx(want - 0.0006 + expected, abs=1e-9)
    assert got.measured_to["handoff_nowait_p50_s"] is None  # push measured without figures: unknown, not 0
    doc = got.to_json()["predicted"]
    assert doc["handoff_nowait"]["p50_s"] == pytest.approx(want - 0.0006, abs=1e-9)
