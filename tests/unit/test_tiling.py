"""The wire versus noticing it, bandwidth per request, and P letting go
(docs/phases.md): ``write.wire`` / ``read.wire`` (NIXL's own transfer time
from the completion span's start) and ``write.noticed`` / ``read.noticed``
(the rest, until vLLM's engine loop saw DONE), per rank; bytes / NIXL's time
with a link ceiling; ``kv.hold`` from D's kv.ready to P's release.

Real recorders, the real OTel pipeline and the real SQLite store, the
resolver and the span processor as they run; only the timestamps are made up.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from prometheus_client import CollectorRegistry

from kvtrace import ranks, store, tracemodel
from exporters.handoff import HandoffResolver
from exporters.families import families_for
from exporters.metrics import PhaseMetricsProcessor
from exporters.pipeline import provider_factory
from kvtrace.store import StoreSpanExporter
from kvrecord import semconv as sc
from kvrecord.recorder import Recorder
from instrumented_connector.taps import RankedRecorder
from kvlens import cli
from kvlens.traces import waterfall

MS = 1_000_000
P = sc.Phase


def _rec(role: str, home: Path, engine: str, mode: str) -> Recorder:
    return Recorder(
        role=role,
        mode=mode,
        engine_id=engine,
        pipeline_factory=provider_factory(
            role=role, mode=mode, engine_id=engine, config={"kvlens_home": str(home), "kvlens_metrics": "off"}
        ),
    )


def _close(*recs: Recorder) -> None:
    for r in recs:
        r.flush()
        r.close()


def _rids() -> tuple[str, str, str]:
    """(trace id, P's and D's vLLM request ids for one X-Request-Id)."""
    tid = secrets.token_hex(16)
    return tid, f"cmpl-{tid}-0-{secrets.token_hex(4)}", f"cmpl-{tid}-0-{secrets.token_hex(4)}"


def _xfer(nbytes: int, xfer_ms: float | None) -> dict:
    return {sc.ATTR_BYTES: nbytes, sc.ATTR_DESCRIPTORS: 4, sc.ATTR_NIXL_XFER_S: (xfer_ms or 0) / 1e3}


def _push(pre, dec, p_rid, d_rid, t0, *, xfer_ms=2.0, nbytes=4 << 20, kv_at=50, expire_at=None, ranks_=1):
    """One overlapped push as the hooks record it (ms after ``t0``): D
    registers early, P's WRITE is posted at 43 and seen done at 49
    (NIXL's own time ``xfer_ms``, rank r's later by r ms), D's kv.ready at
    ``kv_at``; the lease reaped at ``expire_at`` (an ``expired`` point)."""
    at = lambda ms: t0 + int(ms * MS)  # noqa: E731
    dec.record(P.DECODE_QUEUE, d_rid, at(5), at(8), "ok")
    dec.record(P.REGISTRATION_STAGE, d_rid, at(8), at(8), "ok")
    dec.record(P.REGISTRATION_SEND, d_rid, at(9), at(10), "ok")
    pre.record(P.PREFILL, p_rid, t0, at(40), "ok")
    pre.record(P.REGISTRATION_RECEIVE, p_rid, at(10.5), at(10.5), "ok")
    pre.record(P.PREFILL_FINISHED, p_rid, at(40), at(40), "ok", {sc.ATTR_BLOCKS: 8})
    pre.record(P.MATCH, p_rid, at(10.5), at(41), "ok", {sc.ATTR_MATCH_FIRST: "registration"})
    pre.record(P.WRITER_WAKE, p_rid, at(41), at(42), "ok")
    pre.record(P.DESCRIPTOR_PREP, p_rid, at(42), at(43), "ok")
    for r in range(ranks_):
        w = RankedRecorder(pre, r, ranks_) if ranks_ > 1 else pre
        w.record(P.WRITE_POST, p_rid, at(43), at(44), "ok", {sc.ATTR_BLOCKS: 8})
        w.record(
            P.WRITE_COMPLETE, p_rid, at(44), at(49 + r), "ok", _xfer(nbytes, None if xfer_ms is None else xfer_ms + r)
        )
    dec.record(P.KV_READY, d_rid, at(kv_at), at(kv_at), "ok")
    if expire_at is not None:
        pre.record(
            P.WRITE_COMPLETE, p_rid, at(expire_at), at(expire_at), "expired", {sc.ATTR_ERROR: "KV lease expired"}
        )


def _pull(pre, dec, p_rid, d_rid, t0, *, released_at=57.0):
    """One pull (ms after ``t0``): D READs 50 -> 55 (NIXL: 3 ms), kv.ready at
    56, P's kv.released (D's read-done notification) at ``released_at``."""
    at = lambda ms: t0 + int(ms * MS)  # noqa: E731
    pre.record(P.PREFILL, p_rid, t0, at(40), "ok")
    pre.record(P.PREFILL_FINISHED, p_rid, at(40), at(40), "ok", {sc.ATTR_BLOCKS: 8})
    dec.record(P.DECODE_QUEUE, d_rid, at(41), at(46), "ok")
    dec.record(P.ALLOC, d_rid, at(46), at(46), "ok")
    dec.record(P.DESCRIPTOR_PREP, d_rid, at(47), at(48), "ok")
    dec.record(P.READ_POST, d_rid, at(48), at(50), "ok")
    dec.record(P.READ_COMPLETE, d_rid, at(50), at(55), "ok", _xfer(2 << 20, 3.0))
    dec.record(P.KV_READY, d_rid, at(56), at(56), "ok")
    pre.record(P.KV_RELEASED, p_rid, at(released_at), at(released_at), "ok")


def _store(tmp_path: Path, mode: str, fill) -> list[tracemodel.Trace]:
    pre, dec = _rec("prefill", tmp_path, "p0", mode), _rec("decode", tmp_path, "d0", mode)
    fill(pre, dec)
    _close(pre, dec)
    with store.reading(tmp_path / "traces.db") as conn:
        return tracemodel.slowest(conn, 100, order="start")


def _named(tr, name):
    return [s for s in tr.spans if s.name == name]


def _check_tiling(tr):
    """Each stretch once, >= 90 % named, and the whole completion span
    named by its two parts where NIXL gave its time."""
    til = tr.tiling()
    assert til is not None and sum(til.phases.values()) == til.named_ns <= til.handoff_ns
    assert til.unattributed_share <= 0.10
    return til


def test_push_wire_and_noticed_split_the_write(tmp_path):
    tid, p_rid, d_rid = _rids()
    (tr,) = _store(tmp_path, "push", lambda pre, dec: _push(pre, dec, p_rid, d_rid, time.time_ns()))
    assert tr.trace_id == tid and tr.handoff_s is not None and not tr.clock_offset_s
    (wc,) = _named(tr, "write.complete")
    (wire,), (noticed,) = _named(tr, "write.wire"), _named(tr, "write.noticed")
    assert (wire.start_ns, wire.end_ns) == (wc.start_ns, wc.start_ns + 2 * MS)  # NIXL's 2 ms from the post
    assert (noticed.start_ns, noticed.end_ns) == (wire.end_ns, wc.end_ns)  # the rest: vLLM noticing
    assert wire.duration_s + noticed.duration_s == pytest.approx(wc.duration_s)
    assert wire.role == noticed.role == "prefill" and wire.critical and noticed.critical
    assert wire.attributes == {sc.ATTR_DERIVED: True} and sc.ATTR_RANK not in noticed.attributes
    til = _check_tiling(tr)
    # the parts hold the completion span's time; the whole keeps none of it
    assert til.phases[("prefill", "write.wire")] == 2 * MS and til.phases[("prefill", "write.noticed")] == 3 * MS
    assert ("prefill", "write.complete") not in til.phases
    # P saw its WRITE done (49) before D reported the KV ready (50): P let go first, no hold
    assert not _named(tr, "kv.hold")
    rel = tr.to_json()["release"]
    assert rel == {"by": "write.complete", "outcome": "ok", "after_kv_ready_s": pytest.approx(-0.001), "hold_s": None}
    text = waterfall(tr)
    assert "write.wire" in text and "write.noticed" in text
    assert "WRITE on the wire" in tracemodel.phase_words("write.wire")


def test_no_nixl_time_no_split(tmp_path):
    """Telemetry unavailable (xfer 0): the completion span keeps its time."""
    _, p_rid, d_rid = _rids()
    (tr,) = _store(tmp_path, "push", lambda pre, dec: _push(pre, dec, p_rid, d_rid, time.time_ns(), xfer_ms=None))
    assert not _named(tr, "write.wire") and not _named(tr, "write.noticed")
    til = _check_tiling(tr)
    assert til.phases[("prefill", "write.complete")] == 5 * MS
    t = tr.to_json()["transfer"]
    assert t["gbps"] is None and not t["gbps_flag"] and "telemetry unavailable" in t["gbps_note"]


def test_nixl_time_past_the_span_is_clipped_and_the_wire_names_it(tmp_path):
    """NIXL timed its transfer from the first post (a ms before the span's
    start) and saw it done only at vLLM's poll: 7 ms against a 5 ms span.
    The wire holds the whole span, nothing is left for noticing, and the
    tiling names the wire rather than the whole it fills."""
    _, p_rid, d_rid = _rids()
    (tr,) = _store(tmp_path, "push", lambda pre, dec: _push(pre, dec, p_rid, d_rid, time.time_ns(), xfer_ms=7.0))
    (wc,), (wire,) = _named(tr, "write.complete"), _named(tr, "write.wire")
    assert (wire.start_ns, wire.end_ns) == (wc.start_ns, wc.end_ns) and not _named(tr, "write.noticed")
    til = _check_tiling(tr)
    assert til.phases[("prefill", "write.wire")] == 5 * MS and ("prefill", "write.complete") not in til.phases


def test_each_rank_is_split_on_its_own_and_the_request_bandwidth_sums_bytes(tmp_path):
    _, p_rid, d_rid = _rids()
    (tr,) = _store(tmp_path, "push", lambda pre, dec: _push(pre, dec, p_rid, d_rid, time.time_ns(), ranks_=2))
    wires = {ranks.rank_of(s): s for s in _named(tr, "write.wire")}
    noticed = {ranks.rank_of(s): s for s in _named(tr, "write.noticed")}
    done = {ranks.rank_of(s): s for s in _named(tr, "write.complete")}
    assert set(wires) == set(noticed) == set(done) == {0, 1}
    for r in (0, 1):  # rank r: NIXL's (2 + r) ms, its span 44 -> 49 + r
        assert wires[r].end_ns - wires[r].start_ns == (2 + r) * MS
        assert (wires[r].start_ns, noticed[r].end_ns) == (done[r].start_ns, done[r].end_ns)
        assert noticed[r].start_ns == wires[r].end_ns
    assert "P r1" in waterfall(tr)  # drawn in its rank's lane
    _check_tiling(tr)
    t = tr.to_json()["transfer"]
    # bytes summed over ranks / the slowest rank's NIXL time
    assert (t["ranks"], t["bytes"], t["xfer_s"]) == (2, 2 * (4 << 20), pytest.approx(0.003))
    assert t["gbps"] == pytest.approx(2 * (4 << 20) * 8 / 0.003 / 1e9) and t["gbps_note"] is None


def test_bandwidth_above_the_link_is_flagged_not_shown(monkeypatch):
    tot = ranks.TransferTotals(ranks=1, bytes=10**9, descriptors=4, xfer_s=0.001, complete_s=0.004)  # 8000 Gb/s
    js = ranks.bandwidth(tot, ceiling=400.0)
    assert js["gbps"] is None and js["gbps_flag"] is True
    assert js["gbps_note"] == "above the link ceiling 400 Gb/s: NIXL's duration is implausible"
    assert ranks.bandwidth(tot, ceiling=10_000.0)["gbps"] == pytest.approx(8000.0)
    monkeypatch.setenv(ranks.LINK_GBPS_ENV, "400")
    assert ranks.link_gbps() == 400.0
    monkeypatch.setenv(ranks.LINK_GBPS_ENV, "fast")
    assert ranks.link_gbps() == ranks.DEFAULT_LINK_GBPS


def test_traces_json_says_implausible(tmp_path, monkeypatch, capsys):
    """4 MiB in NIXL's 2 ms is 16.8 Gb/s: above a 10 Gb/s link, flagged."""
    monkeypatch.setenv(ranks.LINK_GBPS_ENV, "10")
    _, p_rid, d_rid = _rids()
    _store(tmp_path, "push", lambda pre, dec: _push(pre, dec, p_rid, d_rid, time.time_ns()))
    assert cli.main(["traces", "--store", str(tmp_path / "traces.db"), "--json"]) == 0
    (rec,) = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    t = rec["transfer"]
    assert t["gbps"] is None and t["gbps_flag"] and t["link_gbps"] == 10.0 and "implausible" in t["gbps_note"]
    assert t["bytes"] == 4 << 20 and t["xfer_s"] == pytest.approx(0.002)


def test_pull_split_and_hold_after_kv_ready(tmp_path):
    _, p_rid, d_rid = _rids()
    (tr,) = _store(tmp_path, "pull", lambda pre, dec: _pull(pre, dec, p_rid, d_rid, time.time_ns()))
    assert tr.handoff_s is not None
    (rc,), (wire,), (noticed,) = _named(tr, "read.complete"), _named(tr, "read.wire"), _named(tr, "read.noticed")
    assert wire.role == noticed.role == "decode"
    assert (wire.start_ns, wire.end_ns, noticed.end_ns) == (rc.start_ns, rc.start_ns + 3 * MS, rc.end_ns)
    (hold,) = _named(tr, "kv.hold")  # D's kv.ready (56) -> P's kv.released (57)
    (kv,), (rel,) = _named(tr, "kv.ready"), _named(tr, "kv.released")
    assert (hold.role, hold.start_ns, hold.end_ns, hold.outcome) == ("prefill", kv.end_ns, rel.end_ns, "ok")
    assert not hold.critical and hold.attributes[sc.ATTR_DERIVED]
    til = _check_tiling(tr)
    assert not any(name == "kv.hold" for _, name in til.phases)  # after the window: never handoff cost
    assert tr.to_json()["release"] == {
        "by": "kv.released",
        "outcome": "ok",
        "after_kv_ready_s": pytest.approx(0.001),
        "hold_s": pytest.approx(0.001),
    }
    assert "kv.hold" in waterfall(tr)
    # released before kv.ready: no hold
    _, p2, d2 = _rids()
    (tr2,) = _store(tmp_path / "b", "pull", lambda pre, dec: _pull(pre, dec, p2, d2, time.time_ns(), released_at=55.5))
    assert not _named(tr2, "kv.hold") and tr2.to_json()["release"]["after_kv_ready_s"] < 0


def test_expired_push_lease_is_a_long_hold(tmp_path):
    """The WRITE succeeded, yet P kept the blocks until its lease ran out:
    kv.hold from D's kv.ready to the expiry, outcome expired."""
    _, p_rid, d_rid = _rids()
    (tr,) = _store(tmp_path, "push", lambda pre, dec: _push(pre, dec, p_rid, d_rid, time.time_ns(), expire_at=6050))
    (hold,) = _named(tr, "kv.hold")
    assert hold.outcome == "expired" and hold.duration_s == pytest.approx(6.0)
    (kv,) = _named(tr, "kv.ready")
    assert hold.start_ns == kv.end_ns and not hold.critical
    t = tr.to_json()["transfer"]
    assert t["bytes"] == 4 << 20 and t["ranks"] == 1  # the lease's point is no transfer
    assert tr.to_json()["release"]["by"] == "write.complete" and tr.to_json()["release"]["outcome"] == "expired"
    _check_tiling(tr)
    assert "!expired" in waterfall(tr)


def test_resolver_observes_the_split_and_counts_long_holds(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLENS_HOLD_WARN_S", "5")
    (_, p1, d1), (_, p2, d2), (pull_tid, p3, d3) = _rids(), _rids(), _rids()
    t0 = time.time_ns()

    def fill(pre, dec):
        _push(pre, dec, p1, d1, t0, expire_at=6050)  # a 6 s hold: long
        _push(pre, dec, p2, d2, t0 + 100 * MS, kv_at=48.5)  # P saw its WRITE done 0.5 ms after kv.ready: short

    trs = _store(tmp_path, "push", fill)
    pre, dec = _rec("prefill", tmp_path, "p0", "pull"), _rec("decode", tmp_path, "d0", "pull")
    _pull(pre, dec, p3, d3, t0 + 200 * MS)
    _close(pre, dec)
    reg = CollectorRegistry()
    res = HandoffResolver(
        families_for(reg), tmp_path / "traces.db", deadline_s=5.0, max_pending=10, poll_s=0.01, exemplars=False
    )
    for t in trs:
        res.submit(t.trace_id, "push")
    res.submit(pull_tid, "pull")
    assert res.flush(5.0)
    res.close()

    def count(mode, role, phase, outcome="ok"):
        return reg.get_sample_value(
            "kvlens_phase_duration_seconds_count", {"mode": mode, "role": role, "phase": phase, "outcome": outcome}
        )

    assert count("push", "prefill", "write.wire") == 2 and count("push", "prefill", "write.noticed") == 2
    assert count("pull", "decode", "read.wire") == 1 and count("pull", "decode", "read.noticed") == 1
    assert count("push", "prefill", "kv.hold", "expired") == 1 and count("push", "prefill", "kv.hold") == 1
    assert count("pull", "prefill", "kv.hold") == 1
    assert reg.get_sample_value("kvlens_kv_hold_long_total", {"mode": "push"}) == 1
    assert reg.get_sample_value("kvlens_kv_hold_long_total", {"mode": "pull"}) is None
    wire_sum = reg.get_sample_value(
        "kvlens_phase_duration_seconds_sum", {"mode": "pull", "role": "decode", "phase": "read.wire", "outcome": "ok"}
    )
    assert wire_sum == pytest.approx(0.003)


def test_span_processor_observes_bandwidth_or_counts_it_implausible(tmp_path, monkeypatch):
    """kvlens_transfer_gbps per completion span (per rank); above the link
    ceiling the figure goes to kvlens_transfer_implausible_total instead."""
    monkeypatch.setenv("KVLENS_LINK_GBPS", "10")
    reg = CollectorRegistry()
    db = tmp_path / "traces.db"
    proc = PhaseMetricsProcessor(reg, store_path=db, handoff_from="off")
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(StoreSpanExporter(db)))
    provider.add_span_processor(proc)
    tracer = provider.get_tracer("t")
    t = time.time_ns()
    for role, mode, name, nbytes, xfer_s in (
        ("decode", "pull", "read.complete", 2 << 20, 0.003),  # 5.6 Gb/s
        ("prefill", "push", "write.complete", 4 << 20, 0.002),  # 16.8: above
        ("prefill", "push", "write.complete", 4 << 20, 0.0),
    ):  # no telemetry
        s = tracer.start_span(
            name,
            start_time=t,
            attributes={
                sc.ATTR_MODE: mode,
                sc.ATTR_ROLE: role,
                sc.ATTR_OUTCOME: "ok",
                sc.ATTR_BYTES: nbytes,
                sc.ATTR_NIXL_XFER_S: xfer_s,
            },
        )
        s.end(end_time=t + 5 * MS)
    provider.shutdown()
    pull = {"mode": "pull", "role": "decode"}
    push = {"mode": "push", "role": "prefill"}
    assert reg.get_sample_value("kvlens_transfer_gbps_count", pull) == 1
    assert reg.get_sample_value("kvlens_transfer_gbps_sum", pull) == pytest.approx((2 << 20) * 8 / 0.003 / 1e9)
    assert reg.get_sample_value("kvlens_transfer_gbps_count", push) is None
    assert reg.get_sample_value("kvlens_transfer_implausible_total", push) == 1
    help_ = next(m for m in reg.collect() if m.name == "kvlens_transfer_gbps").documentation
    assert "xferDuration" in help_ and "per rank" in help_
