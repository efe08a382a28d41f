"""Handoff health (docs/handoff-health.md): the open-handoff table, its metrics and
partial traces, and the stale / expired / registration-timeout / pinned paths
driven through vLLM's own NIXL methods where they run without an agent."""

from __future__ import annotations

import collections
import math
import queue
import threading
import time
import types

import pytest
from prometheus_client import CollectorRegistry

from exporters import handoffhealth
from instrumented_connector import hooks, scheduler, worker
from instrumented_connector.taps import NixlTap, NotifQueueTap
from kvrecord import openhandoffs
from kvrecord import semconv as sc
from kvrecord.config import Options
from kvrecord.openhandoffs import HandoffTable

OP = sc.OpenPhase
P_RID = "cmpl-" + "ab" * 16 + "-0-11111111"
D_RID = "cmpl-" + "ab" * 16 + "-0-22222222"


class ListRecorder:
    """Records what the hooks and the publisher hand the recorder."""

    dropped = 0

    def __init__(self, role="prefill", mode="push"):
        self.role, self.mode = role, mode
        self.spans = []  # (phase, rid, start_ns, end_ns, outcome, attrs)
        self.periodic = []

    def record(self, phase, rid, start_ns, end_ns, outcome="ok", attrs=None):
        self.spans.append((phase, rid, start_ns, end_ns, outcome, attrs))

    def point(self, phase, rid, outcome="ok", attrs=None):
        t = time.time_ns()
        self.record(phase, rid, t, t, outcome, attrs)

    def add_periodic(self, fn, every_s=1.0):
        self.periodic.append(fn)

    def named(self, phase):
        return [s for s in self.spans if s[0] == phase]


# ------------------------------------------------------------------ the table
def test_table_open_move_close_and_oldest():
    t = HandoffTable("push", "prefill")
    t.own(sc.OPEN_PHASES[("push", "prefill")])
    t.open("a", OP.AWAITING_REGISTRATION, 100, blocks=3)
    t.open("b", OP.AWAITING_REGISTRATION, 200, blocks=2)
    t.open("r", OP.AWAITING_PREFILL, 150, attempt=False)
    snap = t.snapshot()
    assert snap["awaiting_registration"] == (2, 100, 5)
    assert snap["awaiting_prefill"] == (1, 150, 0)
    assert snap["writing"] == (0, None, 0)
    assert t.attempts == 2  # a registration alone is not a P handoff yet
    # matched: moves (keeps its start and blocks), the oldest is now b
    assert t.move("a", OP.WRITING, 300)
    assert t.snapshot()["awaiting_registration"] == (1, 200, 2)
    assert t.snapshot()["writing"] == (1, 300, 3)
    e = t.close("a", "ok")
    assert openhandoffs.entry_fields(e)["start_ns"] == 100
    assert t.close("a", "ok") is None  # ended once
    assert t.outcomes["ok"] == 1 and len(t) == 2
    assert not t.move("gone", OP.WRITING, 1)
    # a phase of another side is ignored
    t.open("x", OP.AWAITING_KV, 1)
    assert not t.is_open("x")


def test_table_reopen_moves_and_keeps_the_earlier_start():
    t = HandoffTable("push", "prefill")
    t.open("p", OP.AWAITING_REGISTRATION, 500, blocks=4)
    t.open("p", OP.WRITING, 600, start_ns=400)  # the registration came first, at 400
    f = openhandoffs.entry_fields(t.close("p", None))
    assert (f["phase"], f["start_ns"], f["blocks"]) == ("writing", 400, 4)
    assert t.attempts == 1 and sum(t.outcomes.values()) == 0  # closed without an outcome


def test_table_is_bounded_and_counts_what_it_drops():
    t = HandoffTable("pull", "decode", cap=3)
    for i in range(5):
        t.open(str(i), OP.READING, i)
    assert len(t) == 3 and t.dropped == 2 and t.attempts == 3
    t.close("0", "ok")
    t.open("9", OP.READING, 9)
    assert len(t) == 3 and t.is_open("9")
    with pytest.raises(ValueError, match="cap"):
        HandoffTable("pull", "decode", cap=0)


def test_table_flags_blocks_and_due():
    t = HandoffTable("push", "decode")
    t.own([OP.AWAITING_KV])
    t.open("old", OP.AWAITING_KV, 1_000, blocks=1)
    t.open("new", OP.AWAITING_KV, 9_000)
    assert t.flag("old", "k", 1) and not t.flag("nope", "k", 1)
    assert t.flags("old") == {"k": 1} and t.flags("new") is None
    t.set_blocks("new", 7)
    assert t.snapshot()["awaiting_kv"] == (2, 1_000, 8)
    # open >= 5_000 ns at 10_000: only "old"; written again only after every_ns
    due = t.due(10_000, 5_000, 3_000, 10)
    assert [rid for rid, _ in due] == ["old"]
    assert t.due(11_000, 5_000, 3_000, 10) == []
    assert [rid for rid, _ in t.due(14_000, 5_000, 3_000, 10)] == ["old", "new"]
    assert t.open_ids(OP.AWAITING_KV, before_ns=5_000) == ["old"]


def test_table_is_per_process_and_side():
    a = openhandoffs.table_for("pull", "prefill")
    assert openhandoffs.table_for("pull", "prefill") is a
    assert openhandoffs.table_for("pull", "decode") is not a
    assert a in openhandoffs.tables()


def test_table_survives_concurrent_threads():
    t = HandoffTable("push", "prefill")
    t.own(sc.OPEN_PHASES[("push", "prefill")])

    def worker_thread(k):
        for i in range(2000):
            rid = f"{k}-{i}"
            t.open(rid, OP.AWAITING_REGISTRATION, i, blocks=1)
            t.move(rid, OP.WRITING, i)
            t.close(rid, "ok")

    threads = [threading.Thread(target=worker_thread, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for _ in range(200):
        t.snapshot()
    for th in threads:
        th.join()
    assert len(t) == 0 and t.outcomes["ok"] == 8000 and t.attempts == 8000
    assert all(v == (0, None, 0) for v in t.snapshot().values())


# ------------------------------------------------------------------ metrics
def _publisher(tables, registry, rec=None, after_s=5.0):
    return handoffhealth.HealthPublisher(
        rec or ListRecorder(), registry, open_trace_after_s=after_s, tables=lambda: tables
    )


def test_every_counter_is_zero_before_the_first_event():
    reg = CollectorRegistry()
    handoffhealth.health_families(reg)
    v = reg.get_sample_value
    for mode in ("push", "pull"):
        assert v("kvlens_kv_stale_total", {"mode": mode}) == 0
        assert v("kvlens_registration_timeouts_total", {"mode": mode}) == 0
        for role in ("prefill", "decode"):
            assert v("kvlens_handoff_attempts_total", {"mode": mode, "role": role}) == 0
            assert v("kvlens_handoff_untracked_total", {"mode": mode, "role": role}) == 0
            for outcome in ("ok", "failed", "timeout", "expired", "stale"):
                assert v("kvlens_handoff_outcomes_total", {"mode": mode, "role": role, "outcome": outcome}) == 0


def test_gauges_and_counters_follow_the_table():
    reg = CollectorRegistry()
    t = HandoffTable("pull", "prefill")
    t.own([OP.AWAITING_READ])
    pub = _publisher([t], reg)
    v = reg.get_sample_value
    lab = {"mode": "pull", "role": "prefill", "phase": "awaiting_read"}
    pin = {"mode": "pull", "state": "awaiting_read"}
    pub.tick()
    assert v("kvlens_handoffs_open", lab) == 0
    assert math.isnan(v("kvlens_handoff_oldest_open_start_timestamp_seconds", lab))  # none open: NaN
    assert math.isnan(v("kvlens_kv_pinned_oldest_start_timestamp_seconds", pin))
    t.open("a", OP.AWAITING_READ, 1_700_000_000_000_000_000, blocks=5)
    t.open("b", OP.AWAITING_READ, 1_700_000_001_000_000_000, blocks=3)
    pub.tick()
    assert v("kvlens_handoffs_open", lab) == 2
    assert v("kvlens_handoff_oldest_open_start_timestamp_seconds", lab) == 1_700_000_000.0
    assert v("kvlens_kv_pinned_requests", pin) == 2 and v("kvlens_kv_pinned_blocks", pin) == 8
    assert v("kvlens_kv_pinned_oldest_start_timestamp_seconds", pin) == 1_700_000_000.0
    assert v("kvlens_handoff_attempts_total", {"mode": "pull", "role": "prefill"}) == 2
    t.close("a", "expired")
    t.count_stale()
    pub.tick()
    pub.tick()  # counters grow by what is new only
    out = {"mode": "pull", "role": "prefill"}
    assert v("kvlens_handoff_outcomes_total", {**out, "outcome": "expired"}) == 1
    assert v("kvlens_handoff_outcomes_total", {**out, "outcome": "stale"}) == 1
    assert v("kvlens_kv_stale_total", {"mode": "pull"}) == 1
    assert v("kvlens_handoff_oldest_open_start_timestamp_seconds", lab) == 1_700_000_001.0
    t.close("b", "ok")
    pub.tick()
    assert v("kvlens_handoffs_open", lab) == 0 and v("kvlens_kv_pinned_blocks", pin) == 0
    assert math.isnan(v("kvlens_handoff_oldest_open_start_timestamp_seconds", lab))


def test_only_owned_phases_are_published():
    reg = CollectorRegistry()
    t = HandoffTable("push", "prefill")
    t.own([OP.WRITING])  # e.g. the worker's process
    _publisher([t], reg).tick()
    v = reg.get_sample_value
    assert v("kvlens_handoffs_open", {"mode": "push", "role": "prefill", "phase": "writing"}) == 0
    assert v("kvlens_handoffs_open", {"mode": "push", "role": "prefill", "phase": "awaiting_prefill"}) is None


def test_partial_traces_of_handoffs_open_too_long():
    rec = ListRecorder(role="decode")
    t = HandoffTable("push", "decode")
    t.own([OP.AWAITING_KV])
    now = time.time_ns()
    t.open(D_RID, OP.AWAITING_KV, now - 10_000_000_000, blocks=4)
    t.open("young", OP.AWAITING_KV, now)
    t.flag(D_RID, sc.ATTR_REGISTRATION_TIMEOUT, True)
    t.flag(D_RID, hooks.TIMEOUT_AT, now - 2_000_000_000)
    pub = _publisher([t], CollectorRegistry(), rec, after_s=5.0)
    pub.tick()
    (span,) = rec.named(sc.SPAN_HANDOFF_OPEN)
    _, rid, t0, t1, outcome, a = span
    assert rid == D_RID and t0 == now - 10_000_000_000 and t1 >= now
    assert a[sc.ATTR_OPEN] is True and a[sc.ATTR_OPEN_PHASE] == "awaiting_kv"
    assert (a[sc.ATTR_ROLE], a[sc.ATTR_MODE], a[sc.ATTR_OPEN_BLOCKS]) == ("decode", "push", 4)
    assert a[sc.ATTR_REGISTRATION_TIMEOUT] is True and a[sc.ATTR_REGISTRATION_TIMEOUT_WAIT_S] >= 2.0
    assert hooks.TIMEOUT_AT not in a  # the flag's bookkeeping is no attribute
    pub.tick()
    assert len(rec.named(sc.SPAN_HANDOFF_OPEN)) == 1  # not again within REEMIT_S
    # off: never
    rec2 = ListRecorder()
    _publisher([t], CollectorRegistry(), rec2, after_s=0).tick()
    assert rec2.spans == []
    with pytest.raises(ValueError, match="open_trace_after_s"):
        _publisher([t], CollectorRegistry(), after_s=-1)


def test_a_failing_reconciler_is_logged_and_skipped(caplog):
    reg = CollectorRegistry()
    t = HandoffTable("pull", "decode")
    t.own([OP.READING])
    t.reconcilers.append(lambda: 1 / 0)
    t.open("a", OP.READING, 1)
    _publisher([t], reg).tick()
    assert reg.get_sample_value("kvlens_handoffs_open", {"mode": "pull", "role": "decode", "phase": "reading"}) == 1


def test_attach_runs_on_the_recorder_thread_once_per_process():
    rec = ListRecorder()
    saved = dict(handoffhealth._publishers)
    handoffhealth._publishers.clear()
    try:
        p = handoffhealth.attach(rec, 5.0, registry=CollectorRegistry())
        assert handoffhealth.attach(rec, 5.0) is p and rec.periodic == [p.tick]
        assert handoffhealth.attach(hooks.NullRecorder(), 5.0) is p  # the process's publisher
        handoffhealth._publishers.clear()
        assert handoffhealth.attach(hooks.NullRecorder(), 5.0) is None  # no background thread: no health
    finally:
        handoffhealth._publishers.clear()
        handoffhealth._publishers.update(saved)


def test_open_trace_after_s_option():
    assert Options.from_config({}).open_trace_after_s == 5.0
    assert Options.from_config({"open_trace_after_s": "0"}).open_trace_after_s == 0.0
    o = Options.from_config({"open_trace_after_s": 2.5})
    assert o.open_trace_after_s == 2.5 and Options.from_config(o.to_config()).open_trace_after_s == 2.5
    for bad in (-1, "soon", True, float("inf")):
        with pytest.raises(ValueError, match="open_trace_after_s"):
            Options.from_config({"open_trace_after_s": bad})
    with pytest.raises(ValueError, match="open_trace_after_s"):
        Options.from_config({"open_trace_after": 3})  # a near miss names the option


def test_the_recorder_runs_periodic_tasks_on_its_thread():
    from kvrecord.recorder import Recorder

    rec = Recorder(role="prefill", mode="pull", flush_interval_s=0.01)
    seen = []
    done = threading.Event()

    def task():
        seen.append(threading.current_thread().name)
        done.set()

    rec.add_periodic(lambda: 1 / 0, 0.01)  # a failing task is skipped, the next still runs
    rec.add_periodic(task, 0.01)
    try:
        assert done.wait(30)
    finally:
        rec.close()
    assert seen[0] == rec.thread_name


def test_handoff_open_spans_add_no_phase_series():
    from exporters.metrics import PhaseMetricsProcessor
    from exporters.spanobs import plan

    reg = CollectorRegistry()
    proc = PhaseMetricsProcessor(reg, store_path=None, handoff_from="off")
    mode, observe, more, h = plan(proc.fam, proc, sc.SPAN_HANDOFF_OPEN, "push", "decode", "ok")
    observe(1.0, None)
    assert (mode, more, h) == ("push", None, None)
    assert 'phase="_OTHER"' not in _exposition(reg)


def _exposition(reg) -> str:
    from prometheus_client import generate_latest

    return generate_latest(reg).decode()


# --------------------------------------------- the hooks, with vLLM's methods
class _Stats:
    def __init__(self):
        self.after_expiry = 0
        self.expired = 0

    def record_notification_after_expiry(self):
        self.after_expiry += 1

    def record_kv_expired_req(self):
        self.expired += 1

    def record_transfer(self, res):
        pass


class _Wrapper:
    """NIXL wrapper stand-in: notifications to hand out, transfers DONE."""

    def __init__(self, notifs=None):
        self.notifs = notifs or {}

    def get_new_notifs(self):
        n, self.notifs = self.notifs, {}
        return n

    def check_xfer_state(self, handle):
        return "DONE"

    def get_xfer_telemetry(self, handle):
        return None

    def release_xfer_handle(self, handle):
        pass


def _worker(cls, role: str, table: HandoffTable, **state):
    """An instrumented worker without a NIXL agent: the state vLLM's own
    notification, lease and completion methods use, and the hook state."""
    w = object.__new__(cls)
    w._reqs_to_send, w._reqs_to_process, w._recving_metadata, w._recving_transfers = {}, set(), {}, {}
    w.consumer_notification_counts_by_req = collections.defaultdict(int)
    w.expected_consumer_notifications_by_req = {}
    w.xfer_stats = _Stats()
    w.transfer_topo = types.SimpleNamespace(tp_ratio=lambda n: 1)
    w.world_size, w._lease_extension = 1, 30
    w._kvl_tls = worker._XferTimes()
    w._kvl_post_end, w._kvl_hs_t0, w._kvl_xfer = hooks.Pending(), hooks.Pending(), hooks.Pending()
    w._kvl_failed = set()
    w._kvl = ListRecorder(role=role, mode=table.mode)
    w._kvl_table, w._kvl_role, w._kvl_stale_on = table, role, True
    for k, v in state.items():
        setattr(w, k, v)
    return w


def test_pull_p_late_read_is_stale_and_a_timely_one_ends_ok(caplog):
    """vLLM's own _get_new_notifs: D's read-done for a request P's lease
    already released is stale (vLLM logs "Potentially invalid KV blocks");
    one for a request P holds ends its awaiting_read handoff ok."""
    t = HandoffTable("pull", "prefill")
    t.own([OP.AWAITING_READ])
    w = _worker(worker.InstrumentedNixlPullConnectorWorker, "prefill", t)
    w.nixl_wrapper = NixlTap(_Wrapper(), hooks.Pending(), w._kvl_notifs_cb())
    held, late = P_RID, "cmpl-" + "cd" * 16 + "-0-33333333"
    t.open(held, OP.AWAITING_READ, 1, blocks=2)
    w._reqs_to_send[held] = time.perf_counter() + 60
    w._reqs_to_process.add(held)
    w.nixl_wrapper._inner.notifs = {"d-agent": [f"{held}:1".encode(), f"{late}:1".encode(), b"HB:x"]}
    assert w._get_new_notifs() == {held}  # vLLM's answer, unchanged
    assert w.xfer_stats.after_expiry == 1  # vLLM's own count of the late one
    assert "Potentially invalid KV blocks" in caplog.text
    assert t.outcomes["ok"] == 1 and not t.is_open(held) and t.stale == 1
    (stale,) = [s for s in w._kvl.spans if s[4] == "stale"]
    assert stale[0] is sc.Phase.KV_RELEASED and stale[1] == late
    assert stale[5][sc.ATTR_KV_STALE] is True and stale[5][sc.ATTR_KV_STALE_SEEN_BY] == "prefill"


def test_lease_expiry_ends_the_handoff_expired():
    """vLLM's own _reap_expired_send_leases releases the blocks; the open
    handoff (pinned awaiting_read) ends expired."""
    t = HandoffTable("pull", "prefill")
    t.own([OP.AWAITING_READ])
    w = _worker(worker.InstrumentedNixlPullConnectorWorker, "prefill", t)
    t.open(P_RID, OP.AWAITING_READ, 1, blocks=2)
    w._reqs_to_send[P_RID] = time.perf_counter() - 1  # lease over
    w._reqs_to_process.add(P_RID)
    done: set[str] = set()
    w._reap_expired_send_leases(done)
    assert done == {P_RID} and w.xfer_stats.expired == 1
    assert not t.is_open(P_RID) and t.outcomes["expired"] == 1
    assert [(s[0], s[4]) for s in w._kvl.spans] == [(sc.Phase.READ_COMPLETE, "expired")]


def test_push_d_completion_for_a_request_it_dropped_is_stale(caplog):
    """vLLM's own push _get_new_notifs on D: a completion notification for a
    request D no longer tracks ("Unrecognized request ... notif") is stale,
    seen by D; one for a request D waits on is not."""
    t = HandoffTable("push", "decode")
    w = _worker(worker.InstrumentedNixlPushConnectorWorker, "decode", t)
    w._pending_completion_notifs = NotifQueueTap(w._kvl_d_notif)
    w._recving_metadata[D_RID] = types.SimpleNamespace(pp_size=1)
    w._pending_completion_notifs.put(f"{D_RID}:1".encode())
    w._pending_completion_notifs.put(b"cmpl-gone-0-44444444:1")
    w._get_new_notifs()
    assert "Unrecognized request cmpl-gone-0-44444444" in caplog.text
    assert w._recving_transfers == {D_RID: []}  # vLLM's bookkeeping of the known one, unchanged
    assert t.stale == 1
    ((phase, rid, _, _, outcome, a),) = w._kvl.spans
    assert (phase, rid, outcome) == (sc.Phase.KV_READY, "cmpl-gone-0-44444444", "stale")
    assert a[sc.ATTR_KV_STALE_SEEN_BY] == "decode"


def test_push_p_write_seen_done_after_the_lease_is_stale():
    """vLLM's own _pop_done_transfers: a WRITE done for a request whose lease
    released the blocks ends write.complete stale; one P still holds ends ok."""
    t = HandoffTable("push", "prefill")
    t.own(sc.OPEN_PHASES[("push", "prefill")])
    w = _worker(worker.InstrumentedNixlPushConnectorWorker, "prefill", t, nixl_wrapper=_Wrapper())
    late = "cmpl-" + "cd" * 16 + "-0-33333333"
    for rid in (P_RID, late):
        t.open(rid, OP.WRITING, 1, blocks=2)
        w._kvl_post_end.put(rid, (1, "d0"))
    w._reqs_to_process.add(P_RID)  # P holds it; `late` was reaped
    t.close(late, "expired")
    transfers = {P_RID: [1], late: [2]}
    done, failed = w._pop_done_transfers(transfers)
    assert done == {P_RID, late} and not failed and transfers == {}
    got = {s[1]: (s[0], s[4], s[5]) for s in w._kvl.spans}
    assert got[P_RID][:2] == (sc.Phase.WRITE_COMPLETE, "ok")
    assert got[late][:2] == (sc.Phase.WRITE_COMPLETE, "stale") and got[late][2][sc.ATTR_KV_STALE] is True
    assert t.outcomes["ok"] == 1 and t.outcomes["expired"] == 1 and t.stale == 1 and len(t) == 0


def _push_p_worker(t):
    w = _worker(worker.InstrumentedNixlPushConnectorWorker, "prefill", t)
    w.pcp_rank = 0
    w._finished_blocks_inbox, w._reg_send_inbox, w._push_writer_wake = queue.Queue(), queue.Queue(), threading.Event()
    w._pending_d_registrations, w._push_finished_blocks = {}, {}
    w._kvl_enq, w._kvl_enq_lock = hooks.Pending(), threading.Lock()
    w._kvl_reg_seen, w._kvl_fin_seen = hooks.Pending(), hooks.Pending()
    return w


def _finished(rid, blocks):
    return types.SimpleNamespace(
        reqs_to_recv={},
        push_registrations={},
        push_finished_blocks={rid: blocks},
        reqs_in_batch=set(),
        reqs_not_processed=set(),
        reqs_to_send={},
        scheduler_clock=None,
        heartbeat_by_engine={},
    )


def test_push_p_pinned_prefill_then_registration():
    """Finished blocks first (vLLM's start_load_kv, then its writer's
    matching): pinned unregistered_prefill with P's blocks until D's
    registration matches them, then writing."""
    t = HandoffTable("push", "prefill")
    t.own(sc.OPEN_PHASES[("push", "prefill")])
    w = _push_p_worker(t)
    w.start_load_kv(_finished(P_RID, ([1, 2, 3],)))
    rid, blocks = w._finished_blocks_inbox.get_nowait()  # the writer loop's step 3
    assert w._pop_matching_registration(rid) is None
    w._push_finished_blocks[rid] = blocks
    assert t.snapshot()["awaiting_registration"][0::2] == (1, 3)
    assert w._pop_matching_finished_blocks(D_RID) == (P_RID, ([1, 2, 3],))  # D's PUSH_REG
    snap = t.snapshot()
    assert snap["awaiting_registration"] == (0, None, 0) and snap["writing"][0] == 1
    assert t.attempts == 1


def test_push_p_pinned_registration_then_prefill():
    """D's registration first: pinned unmatched_registration (its blocks read
    from vLLM's table by the reconciler) until P's blocks match it; then one
    handoff, writing, that started when the registration arrived."""
    t = HandoffTable("push", "prefill")
    t.own(sc.OPEN_PHASES[("push", "prefill")])
    w = _push_p_worker(t)
    assert w._pop_matching_finished_blocks(D_RID) is None
    w._pending_d_registrations[D_RID] = {"request_id": D_RID, "local_block_ids": ([7, 8],)}
    reg_start = openhandoffs.entry_fields(t.due(time.time_ns() + 10**12, 0, 0, 1)[0][1])["start_ns"]
    assert t.snapshot()["awaiting_prefill"][0] == 1 and t.attempts == 0
    t.reconcilers.append(w._kvl_reconcile_registrations)
    time.sleep(0.001)
    w._kvl_reconcile_registrations()  # too young: left alone
    assert t.snapshot()["awaiting_prefill"][2] == 0
    # (what the reconciler does once the entry is a second old)
    w._kvl_table.set_blocks(D_RID, hooks.nblocks(w._pending_d_registrations[D_RID]["local_block_ids"]))
    assert t.snapshot()["awaiting_prefill"][2] == 2
    w.start_load_kv(_finished(P_RID, ([1, 2, 3],)))
    rid, _ = w._finished_blocks_inbox.get_nowait()
    assert w._pop_matching_registration(rid)["request_id"] == D_RID
    snap = t.snapshot()
    assert snap["awaiting_prefill"] == (0, None, 0) and snap["awaiting_registration"] == (0, None, 0)
    assert snap["writing"][0] == 1 and snap["writing"][2] == 3
    (entry,) = [e for r, e in t.due(time.time_ns() + 10**12, 0, 0, 5) if r == P_RID]
    assert openhandoffs.entry_fields(entry)["start_ns"] == reg_start


def test_reconciler_drops_registrations_vllm_forgot():
    t = HandoffTable("push", "prefill")
    t.own(sc.OPEN_PHASES[("push", "prefill")])
    w = _push_p_worker(t)
    t.open(D_RID, OP.AWAITING_PREFILL, time.time_ns() - 5_000_000_000, attempt=False)
    t.open("kept", OP.AWAITING_PREFILL, time.time_ns() - 5_000_000_000, attempt=False)
    w._pending_d_registrations["kept"] = {"local_block_ids": ([1, 2, 3, 4],)}
    w._kvl_reconcile_registrations()
    assert not t.is_open(D_RID) and t.snapshot()["awaiting_prefill"] == (1, t.snapshot()["awaiting_prefill"][1], 4)


class _Watchdog:
    """vLLM's push scheduler watchdog, as build_connector_meta runs it: drop
    registrations whose deadline passed (the request keeps waiting)."""

    def __init__(self):
        self._push_registration_deadlines = {}

    def build_connector_meta(self, scheduler_output):
        now = time.perf_counter()
        for rid in [r for r, d in self._push_registration_deadlines.items() if d <= now]:
            del self._push_registration_deadlines[rid]
        return "meta"

    def request_finished(self, request, block_ids):
        return False, None

    def update_connector_output(self, connector_output):
        return None


class _D(scheduler._SchedulerHooks, _Watchdog):
    _kvl_watchdog = scheduler.InstrumentedNixlPushConnectorScheduler._kvl_watchdog

    def build_connector_meta(self, scheduler_output):  # as InstrumentedNixlPushConnectorScheduler's
        return self._kvl_watchdog(super().build_connector_meta, scheduler_output)


def test_build_connector_meta_override_matches_the_watchdog_it_wraps():
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1 import nixl

    src = inspect.getsource(nixl.NixlPushConnectorScheduler.build_connector_meta)
    assert "self._push_registration_deadlines.pop(rid, None)" in src and "timed out" in src


def _d_sched(t):
    d = _D()
    d._kvl_loaded, d._kvl_sched, d._kvl_flagged = hooks.Pending(), hooks.Pending(), hooks.Pending()
    d._kvl = ListRecorder(role="decode")
    d._kvl_table = t
    return d


def test_registration_timeout_keeps_the_handoff_open_until_the_request_ends():
    """The watchdog fires: counted, flagged, still open (no kv.ready yet);
    D's request then ends without its KV: kv.ready timeout, flagged, with
    the wait after the watchdog."""
    t = HandoffTable("push", "decode")
    t.own([OP.AWAITING_KV])
    d = _d_sched(t)
    t.open(D_RID, OP.AWAITING_KV, time.time_ns())
    d._push_registration_deadlines[D_RID] = time.perf_counter() - 1
    assert d.build_connector_meta(None) == "meta"
    assert t.registration_timeouts == 1 and t.is_open(D_RID)
    assert d._kvl.spans == []  # kv.ready not yet: D still waits
    time.sleep(0.01)
    req = types.SimpleNamespace(request_id=D_RID, kv_transfer_params={"do_remote_prefill": False})
    assert d.request_finished(req, ()) == (False, None)
    ((phase, rid, _, _, outcome, a),) = d._kvl.spans
    assert (phase, rid, outcome) == (sc.Phase.KV_READY, D_RID, "timeout")
    assert a[sc.ATTR_REGISTRATION_TIMEOUT] is True and a[sc.ATTR_REGISTRATION_TIMEOUT_WAIT_S] > 0
    assert t.outcomes["timeout"] == 1 and not t.is_open(D_RID)


def test_kv_arriving_after_the_watchdog_ends_ok_and_flagged():
    """The KV does arrive after the watchdog: D's worker records kv.ready ok
    with the flag; the scheduler's output ends the handoff ok."""
    t = HandoffTable("push", "decode")
    t.own([OP.AWAITING_KV])
    d = _d_sched(t)
    t.open(D_RID, OP.AWAITING_KV, time.time_ns())
    d._push_registration_deadlines[D_RID] = time.perf_counter() - 1
    d.build_connector_meta(None)

    class Results:
        def get_transfer_results(self):
            return types.SimpleNamespace(finished_recving={D_RID}, failed_recving=set(), finished_sending=set())

    class W(worker._WorkerHooks, Results):
        pass

    w = object.__new__(W)
    w._kvl, w._kvl_table = ListRecorder(role="decode"), t
    w.get_transfer_results()
    ((_, _, _, _, outcome, a),) = w._kvl.spans
    assert outcome == "ok" and a[sc.ATTR_REGISTRATION_TIMEOUT] is True
    d.update_connector_output(
        types.SimpleNamespace(finished_recving={D_RID}, failed_recving=set(), finished_sending=())
    )
    assert t.outcomes["ok"] == 1 and not t.is_open(D_RID)
    # the worker may run in another process (vLLM's default here): the scheduler
    # flags D's first step after the KV arrived too
    d.block_size = 16
    d._kvl_sched.put(D_RID, (time.time_ns(), 0))
    d.update_connector_output(types.SimpleNamespace(finished_recving=None, failed_recving=set(), finished_sending=()))
    (first,) = d._kvl.named(sc.Phase.DECODE_FIRST_STEP)
    assert first[5][sc.ATTR_REGISTRATION_TIMEOUT] is True and first[5][sc.ATTR_REGISTRATION_TIMEOUT_WAIT_S] >= 0


def test_untracked_registration_timeout_records_kv_ready_timeout_as_before():
    d = _d_sched(None)
    d._push_registration_deadlines[D_RID] = time.perf_counter() - 1
    d.build_connector_meta(None)
    ((phase, _, _, _, outcome, _),) = d._kvl.spans
    assert (phase, outcome) == (sc.Phase.KV_READY, "timeout")


def test_scheduler_opens_d_and_pull_p_handoffs_and_ends_them():
    """D: staged blocks open awaiting_kv / reading; finished_recving ends them.
    Pull P: request_finished with delayed free opens awaiting_read (pinned);
    vLLM freeing the blocks (finished_sending) ends it."""

    class Host:
        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            return None

        def request_finished(self, request, block_ids):
            return True, {}

        def update_connector_output(self, connector_output):
            return None

    class Pull(scheduler._SchedulerHooks, Host):
        _KVL_OWN = scheduler.InstrumentedNixlPullConnectorScheduler._KVL_OWN

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            return self._kvl_alloc(
                sc.Phase.ALLOC, super().update_state_after_alloc, request, blocks, num_external_tokens
            )

    d_tab, p_tab = HandoffTable("pull", "decode"), HandoffTable("pull", "prefill")
    d, p = Pull(), Pull()
    d._kvl, d._kvl_table = ListRecorder(role="decode", mode="pull"), d_tab
    p._kvl, p._kvl_table = ListRecorder(role="prefill", mode="pull"), p_tab
    blocks = types.SimpleNamespace(get_block_ids=lambda: ([1, 2, 3],))
    dreq = types.SimpleNamespace(
        request_id=D_RID,
        num_prompt_tokens=40,
        arrival_time=None,
        kv_transfer_params={"do_remote_prefill": True, "remote_engine_id": "p0", "remote_request_id": P_RID},
    )
    d.update_state_after_alloc(dreq, blocks, 32)
    assert d_tab.is_open(D_RID) and d_tab.attempts == 1
    preq = types.SimpleNamespace(
        request_id=P_RID, num_prompt_tokens=40, arrival_time=None, kv_transfer_params={"do_remote_decode": True}
    )
    p.request_finished(preq, ([1, 2, 3],))
    p_tab.own([OP.AWAITING_READ])
    assert p_tab.snapshot()["awaiting_read"][0::2] == (1, 3)
    d.update_connector_output(
        types.SimpleNamespace(finished_recving={D_RID}, failed_recving={D_RID}, finished_sending=None)
    )
    assert d_tab.outcomes["failed"] == 1 and len(d_tab) == 0
    p.update_connector_output(types.SimpleNamespace(finished_recving=None, failed_recving=(), finished_sending={P_RID}))
    assert len(p_tab) == 0 and sum(p_tab.outcomes.values()) == 0  # the worker counts the outcome


def test_missing_vllm_attributes_disable_the_signal_with_one_warning(caplog):
    obj = types.SimpleNamespace(_reqs_to_send={})
    off = hooks.missing_attrs(obj, {"stale": ("_reqs_to_send", "_reqs_to_process"), "other": ("_reqs_to_send",)})
    assert off == {"stale"}
    assert "_reqs_to_process" in caplog.text and "'stale' is disabled" in caplog.text
    hooks.missing_attrs(obj, {"stale": ("_reqs_to_process",)})
    assert caplog.text.count("'stale' is disabled") == 1


def test_a_failing_table_leaves_vllm_untouched():
    """A table that raises inside a hook: logged once, vLLM's result as is."""

    class Boom(HandoffTable):
        def close(self, rid, outcome):
            raise RuntimeError("kvlens bug")

    t = Boom("pull", "prefill")
    w = _worker(worker.InstrumentedNixlPullConnectorWorker, "prefill", t)
    w._reqs_to_send[P_RID] = time.perf_counter() - 1
    w._reqs_to_process.add(P_RID)
    done: set[str] = set()
    w._reap_expired_send_leases(done)
    assert done == {P_RID} and P_RID not in w._reqs_to_send


def test_pull_p_outcome_counts_where_the_worker_runs_apart_from_the_scheduler():
    """vLLM runs the worker in its own process: pull P's handoff is open in
    the scheduler's table, its end seen by the worker. The worker counts the
    outcome (counters add up across the instance's processes); the
    scheduler's table closes it when vLLM frees the blocks."""
    worker_table = HandoffTable("pull", "prefill")  # the worker process's: nothing open in it
    w = _worker(worker.InstrumentedNixlPullConnectorWorker, "prefill", worker_table)
    w.nixl_wrapper = NixlTap(_Wrapper({"d": [f"{P_RID}:1".encode()]}), hooks.Pending(), w._kvl_notifs_cb())
    w._reqs_to_send[P_RID] = time.perf_counter() + 60
    w._reqs_to_process.add(P_RID)
    late = "cmpl-" + "cd" * 16 + "-0-33333333"
    w._reqs_to_send[late] = time.perf_counter() - 1
    w._reqs_to_process.add(late)
    assert w._get_new_notifs() == {P_RID}
    w._reap_expired_send_leases(set())
    assert worker_table.outcomes["ok"] == 1 and worker_table.outcomes["expired"] == 1 and len(worker_table) == 0
    assert worker_table.attempts == 0  # counted by the scheduler's process, where it opened
