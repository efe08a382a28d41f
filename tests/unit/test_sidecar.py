"""The span-building sidecar (issue 13), with real sidecar processes.

Events shipped through ``python -m exporters.sidecar`` land in the store as
exactly the rows the in-process path writes; the sidecar never outlives its
parent (closed recorder, SIGKILLed parent); a stalled or dead sidecar never
blocks ``record`` and every lost event is counted, up to
``kvlens_telemetry_dropped_total`` in the multiprocess directory vLLM's
``/metrics`` serves; a sidecar that cannot start leaves the in-process path.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, multiprocess

from exporters import frames, pipeline
from kvtrace import store
import store_sql
from exporters.shipping import ShippingRecorder
from kvrecord import semconv as sc
from kvrecord.events import FIELDS, Event, Kind, as_event
from kvrecord.recorder import Recorder

REPO = Path(__file__).resolve().parents[2]
T0 = 1_700_000_000_000_000_000
TIDS = [f"{i + 1:032x}" for i in range(6)]


def _cfg(home: Path) -> dict:
    return {"kvlens_home": str(home), "kvlens_metrics": "off"}


def _shipping(home: Path, engine_id: str = "p-test", cfg: dict | None = None, **kw) -> ShippingRecorder:
    cfg = cfg or _cfg(home)
    return ShippingRecorder(
        role="prefill",
        mode="push",
        engine_id=engine_id,
        pipeline_factory=pipeline.provider_factory(role="prefill", mode="push", engine_id=engine_id, config=cfg),
        sidecar_spec={"role": "prefill", "mode": "push", "engine_id": engine_id, "config": cfg},
        **kw,
    )


def _record_workload(r: Recorder) -> int:
    """A mix of phases, outcomes, attributes, a clamped interval and root
    spans (with and without a client parent). Returns the events recorded."""
    n = 0
    for i, tid in enumerate(TIDS):
        rid = f"cmpl-{tid}-0-{i:08x}"
        t = T0 + i * 1_000_000
        r.record(sc.Phase.PREFILL_FINISHED, rid, t, t + 500, "ok", {sc.ATTR_BLOCKS: 12 + i})
        r.record(
            sc.Phase.WRITE_POST,
            rid,
            t + 600,
            t + 900,
            "ok",
            {sc.ATTR_BLOCKS: 3, sc.ATTR_REMOTE_RANK: 0, sc.ATTR_BYTES: None},
        )
        r.record(
            sc.Phase.WRITE_COMPLETE,
            rid,
            t + 900,
            t + 2_000,
            "error" if i % 3 == 0 else "ok",
            {sc.ATTR_BYTES: 4096 * (i + 1), sc.ATTR_DESCRIPTORS: 4},
        )
        r.record(sc.Phase.KV_READY, rid, t + 2_500, t + 2_400, "weird-outcome")  # clamped; outcome _OTHER
        r.record(sc.Phase.MATCH, rid, t + 100, t + 100)
        r.record_root(tid, 0x1234 if i % 2 else None, t - 1_000, t + 3_000, "ok", {sc.ATTR_TTFT_S: 0.01 * i})
        n += 6
    return n


def _rows(home: Path) -> tuple[dict, list]:
    conn = store.connect(home / "traces.db", readonly=True)
    try:
        spans = store.spans_for(conn, TIDS)
        slow = store.slowest(conn, 50)
    finally:
        conn.close()
    # phase spans get random span ids (the SDK's generator) on either path; roots derive theirs
    key = lambda s: (s["name"], s["start_ns"], s["request_id"])  # noqa: E731
    out = {}
    for tid, ss in spans.items():
        out[tid] = sorted(
            ({k: v for k, v in s.items() if not (k == "span_id" and s["name"] != "request")} for s in ss), key=key
        )
    return out, slow


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, within_s: float = 30.0) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


# ------------------------------------------------------------ the frames
def test_events_cross_to_the_sidecar_as_the_typed_event():
    """What the engine buffers goes out in a frame and comes back, on the
    sidecar's side, as Event instances with the same fields, by name."""
    r = Recorder(role="prefill", mode="push", pipeline_factory=None)
    r._thread = object()  # nothing drains: the test takes the events
    _record_workload(r)
    rows = r.take(frames.MAX_FRAME_EVENTS)
    sent = [as_event(f)._asdict() for f in rows]
    buf = bytearray(frames.encode_events({"buffer_full": 2}, rows) + frames.encode_flush(7))
    tail = frames.encode_flush(8)
    buf += tail[:-1]  # a frame not yet complete stays in the buffer
    got = [frames.decode(p) for p in frames.payloads(buf)]
    assert bytes(buf) == tail[:-1]
    (ev, fl) = got
    assert (ev.kind, ev.arg, fl.kind, fl.arg, fl.events) == (frames.EVENTS, {"buffer_full": 2}, frames.FLUSH, 7, [])
    assert all(type(e) is Event for e in ev.events)
    assert [e._asdict() for e in ev.events] == sent
    roots = [e for e in ev.events if e.kind is Kind.ROOT]
    assert [e.request_id for e in roots] == TIDS and [e.parent_span_id for e in roots[:2]] == [None, 0x1234]
    assert {e.phase for e in roots} == {sc.Phase.REQUEST}


def test_a_frame_of_other_fields_is_refused():
    import pickle

    body = pickle.dumps((frames.EVENTS, {}, ("phase", *FIELDS[2:]), []), 5)
    with pytest.raises(ValueError, match="event fields"):
        frames.decode(body)
    short = pickle.dumps((frames.EVENTS, {}, FIELDS, [("span", "match", "r", 1)]), 5)
    with pytest.raises(TypeError):
        frames.decode(short)


# ------------------------------------------------------------ same rows
def test_sidecar_rows_equal_inline_rows(tmp_path):
    a, b = tmp_path / "inline", tmp_path / "sidecar"
    inline = Recorder(
        role="prefill",
        mode="push",
        engine_id="p-test",
        pipeline_factory=pipeline.provider_factory(role="prefill", mode="push", engine_id="p-test", config=_cfg(a)),
    )
    n = _record_workload(inline)
    inline.close()
    side = _shipping(b).start()
    assert _record_workload(side) == n
    side.flush()
    assert side.mode_in_use == "sidecar" and side.sidecar_pid
    pid = side.sidecar_pid
    # its options (a store URL may hold a password) are not on its command line, which anyone can read
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    assert str(b) not in cmdline and "kvlens_home" not in cmdline, cmdline
    side.close()
    assert not _alive(pid), "the sidecar exits when its recorder closes"
    rows_a, slow_a = _rows(a)
    rows_b, slow_b = _rows(b)
    assert sum(len(v) for v in rows_a.values()) == n
    assert rows_b == rows_a
    assert slow_b == slow_a and len(slow_a) == len(TIDS)
    assert side.shipped == side.recorded == n and side.dropped == side.failed_dropped == 0


def test_get_recorder_picks_the_builder_by_role_option_and_env(tmp_path, monkeypatch):
    monkeypatch.delenv(pipeline.SPAN_BUILDER_ENV, raising=False)
    made = []
    try:
        for role, builder, want in (
            ("prefill", None, ShippingRecorder),
            ("decode", "inline", Recorder),
            ("router", "sidecar", Recorder),
        ):
            r = pipeline.get_recorder(role, "pull", f"pick-{role}", _cfg(tmp_path), span_builder=builder)
            made.append(r)
            assert type(r) is want
        monkeypatch.setenv(pipeline.SPAN_BUILDER_ENV, "inline")
        assert pipeline.span_builder({"kvlens_span_builder": "sidecar"}) == "inline"
        monkeypatch.delenv(pipeline.SPAN_BUILDER_ENV)
        assert pipeline.span_builder({"kvlens_span_builder": "Inline"}) == "inline"
        with pytest.raises(ValueError, match="kvlens_span_builder must be one of sidecar, inline"):
            pipeline.span_builder({"kvlens_span_builder": "thread"})
    finally:
        for r in made:
            pipeline._recorders.pop(next(k for k, v in pipeline._recorders.items() if v is r), None)


# ------------------------------------------------------------ lifetime
_CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from exporters import pipeline
    from kvrecord import semconv as sc
    r = pipeline.get_recorder("decode", "pull", "d-kill", {{"kvlens_home": {home!r}, "kvlens_metrics": "off"}},
                              span_builder="sidecar").start()
    r.record(sc.Phase.KV_READY, "cmpl-{tid}-0-00000001", 1, 2)
    r.flush()
    print(r.mode_in_use, r.sidecar_pid, flush=True)
    time.sleep(600)
""")


def test_sidecar_exits_when_its_parent_is_killed(tmp_path):
    code = _CHILD.format(repo=str(REPO), home=str(tmp_path), tid=TIDS[0])
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        mode, pid = child.stdout.readline().split()
        pid = int(pid)
        assert mode == "sidecar" and _alive(pid)
    finally:
        child.kill()
        child.wait()
    assert _wait_gone(pid), "the sidecar outlived its SIGKILLed parent"
    conn = store.connect(tmp_path / "traces.db", readonly=True)
    try:  # what was shipped before the kill is stored
        assert [s["name"] for s in store.spans_for(conn, [TIDS[0]])[TIDS[0]]] == ["kv.ready"]
    finally:
        conn.close()


def test_a_forked_child_does_not_keep_the_sidecar_alive(tmp_path):
    """vLLM forks: a child's copy of the pipe would hold off the sidecar's EOF."""
    r = _shipping(tmp_path, "p-fork").start()
    r.flush()
    pid = r.sidecar_pid
    child = os.fork()
    if child == 0:  # pragma: no cover - the child only waits
        time.sleep(60)
        os._exit(0)
    try:
        r.close()
        assert _wait_gone(pid), "the sidecar waited for EOF from the forked child"
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


# ------------------------------------------------------- stalls and losses
def test_stalled_sidecar_never_blocks_record_and_drops_reach_the_metric(tmp_path, monkeypatch):
    prom = tmp_path / "prom"
    prom.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(prom))  # the sidecar inherits it, as from vLLM
    cfg = {"kvlens_home": str(tmp_path), "kvlens_buffer_events": 200}
    r = _shipping(tmp_path, "p-stall", cfg=cfg, capacity=200).start()
    r.flush()
    pid = r.sidecar_pid
    os.kill(pid, signal.SIGSTOP)  # a sidecar that reads nothing
    calls = 0
    try:
        payload = {sc.ATTR_BLOCKS: 1, "kvlens.note": "x" * 400}  # big events: the 1 MiB pipe fills quickly
        for round_ in range(40):
            for i in range(500):
                r.record(sc.Phase.WRITE_POST, f"cmpl-{TIDS[1]}-{round_}-{i:08x}", 1, 2, "ok", payload)
                calls += 1
            time.sleep(0.02)
        assert r.dropped > 0, "the buffer filled behind a stalled sidecar and record dropped"
    finally:
        os.kill(pid, signal.SIGCONT)
    r.close(timeout_s=20)
    assert not _alive(pid)
    assert r.recorded + r.dropped + r.shutdown_dropped == calls
    conn = store.connect(tmp_path / "traces.db", readonly=True)
    try:
        stored = store_sql.span_count(conn)
    finally:
        conn.close()
    assert stored == r.shipped  # shipped in whole frames = stored, nothing else lost
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(prom))
    got = reg.get_sample_value("kvlens_telemetry_dropped_total", {"role": "prefill", "reason": "buffer_full"})
    assert got == r.dropped
    assert r.unreported_drops() == {}, "the engine's losses were all handed to the sidecar"
    assert not list(prom.glob(f"gauge_livesum_{pid}.db")), "the exited sidecar's live gauges are removed"


def test_dead_sidecar_is_counted_and_spans_are_built_in_process(tmp_path):
    r = _shipping(tmp_path, "p-dead").start()
    r.record(sc.Phase.MATCH, f"cmpl-{TIDS[2]}-0-00000001", 1, 2)
    r.flush()
    pid = r.sidecar_pid
    os.kill(pid, signal.SIGKILL)
    assert _wait_gone(pid)
    end = time.monotonic() + 30
    while r.mode_in_use != "inline" and time.monotonic() < end:  # noticed on the recorder thread
        time.sleep(0.05)
    r.record(sc.Phase.KV_READY, f"cmpl-{TIDS[2]}-0-00000001", 3, 4)
    r.close()
    assert r.mode_in_use == "inline"
    conn = store.connect(tmp_path / "traces.db", readonly=True)
    try:
        names = sorted(s["name"] for s in store.spans_for(conn, [TIDS[2]])[TIDS[2]])
    finally:
        conn.close()
    assert names == ["kv.ready", "match"]
    assert r.failed_dropped == 0 and r.dropped == 0


@pytest.mark.parametrize(
    "argv",
    [[sys.executable, "-c", "import sys; sys.exit(3)"], ["/nonexistent/kvlens-sidecar"]],
    ids=["exits", "missing"],
)
def test_sidecar_that_cannot_start_falls_back_to_inline(tmp_path, argv):
    r = _shipping(tmp_path, "p-fallback", sidecar_argv=argv).start()
    n = _record_workload(r)
    r.close()
    assert r.mode_in_use == "inline" and r.sidecar_pid is None
    assert r.exported == n
    rows, _ = _rows(tmp_path)
    assert sum(len(v) for v in rows.values()) == n
