"""Handoff health on a real pull pair (issue 37, item 8): faults injected on
real vLLM, and what kvlens shows while and after they happen.

One pull pair with a short KV lease (conftest ``fault_pull_stack``), a real
Prometheus per test loaded with the shipped alert rules (``for:`` cut to 5 s
for the test; bounds as shipped), and healthy requests sent around each
fault, which must carry no flag. Each fault is timed from its injection to
the first scrape of an instance's ``/metrics`` that shows it and to the
alert firing (fault_harness.Detect: recorded in the fault table, never
asserted; the box is shared).

1. D's process tree frozen (SIGSTOP) past P's lease with a request in
   flight, then resumed (SIGCONT). vLLM 0.32: P releases the KV at the lease
   ("Releasing expired KV blocks ... retrieved by 0 remote worker(s)"); D,
   resumed, READs the released blocks anyway (P: ERROR "Potentially invalid
   KV blocks for unrecognized request"); the client gets HTTP 200.
2. P killed in the middle of a handoff: D's engine worker frozen while the
   router relays P's answer to D, P SIGKILLed, D resumed: D's READ meets a
   dead peer (NIXL_ERR_REMOTE_DISCONNECT), vLLM fails the request (HTTP
   500). Killing P ends the pair: keep it last in this module.
"""

from __future__ import annotations

import time
import uuid

import pytest

import fault_harness as fh
from stack_settings import FAULT_FREEZE_S

pytestmark = pytest.mark.e2e

ENDPOINT = "/v1/completions"
#: time for spans to reach the store from three processes on a loaded box
SLACK_S = 90.0
#: kvlens writes a partial trace of a handoff open this long (its default)
OPEN_TRACE_AFTER_S = 5.0


def _body(tag: str) -> dict:
    return {"prompt": f"kvlens health {tag} " + "tokens " * 60, "max_tokens": 4, "temperature": 0}


def _child(stack, name: str):
    return next(c for c in stack.children if c.name == name)


def _targets(stack) -> dict[str, str]:
    return {"prefill": stack.prefill_url, "decode": stack.decode_url}


def test_pull_decode_frozen_past_the_lease_reads_released_kv(fault_pull_stack, fault_prometheus, fault_table):
    """The open handoff and its oldest start show on P while D is frozen;
    ``expired`` on P at the lease; D's late READ after resume is ``stale``
    on the trace and in ``kvlens_kv_stale_total``; the stale alert fires;
    the client still gets 200; the healthy requests carry no flag."""
    stack = fault_pull_stack
    prom = fault_prometheus(stack)
    before = fh.healthy(stack.router_url, 2, "health-pull-before")
    decode = _child(stack, "decode")
    tid = uuid.uuid4().hex
    det = fh.Detect("pull: D frozen past the lease")
    with fh.Watcher(det, _targets(stack), "pull", prom.url) as w:
        with fh.frozen(decode):
            det.start = time.time()
            req = fh.InFlight(stack.router_url + ENDPOINT, _body("frozen-d"), tid)
            # P holds the KV for D until the lease; kvlens writes the partial trace at 5 s
            while time.time() - det.start < FAULT_FREEZE_S:
                if fh.listed_open(stack.store.text, tid):
                    det.mark("traces --open")
                time.sleep(0.5)
        det.mark("resumed")
        status = req.wait(SLACK_S)
        det.mark("client answered")
        # vLLM's P takes D's read-done notification in when its engine next
        # steps: the healthy requests after the fault make it step
        after = fh.healthy(stack.router_url, 2, "health-pull-after")
        det.mark("healthy requests after")
        fh.poll(lambda: det.after("prefill:stale") is not None, 30)
        fh.poll(lambda: det.after("alert:KvlensStaleKV") is not None, 30)
        fh.poll(lambda: det.after("alert:KvlensHandoffsFailing") is not None, 20)
    spans = fh.wait_trace(stack.store, tid, lambda s: fh.flags(s)["stale"], SLACK_S)
    ff = fh.false_flags(stack.store, before + after)
    fl = fh.flags(spans)
    c = fh.Checks()
    c.that("the client gets 200 (vLLM 0.32 serves it from the released KV)", status == 200, status)
    c.that("P: open handoff while D is frozen", det.after("prefill:open") is not None, w.peak)
    c.that("P: oldest open start while D is frozen", det.after("prefill:oldest_open") is not None, w.peak)
    c.that("P: pinned awaiting_read", det.after("prefill:pinned:awaiting_read") is not None, w.peak)
    c.that("P: expired counted once", w.delta("prefill", "expired") == 1, w.last["prefill"])
    c.that("P: kvlens_kv_stale_total +1", w.delta("prefill", "stale") == 1, w.last["prefill"])
    c.that("kvlens traces --open lists it while stuck", det.after("traces --open") is not None)
    c.that("alert KvlensStaleKV fired", "KvlensStaleKV" in w.alerts, sorted(w.alerts))
    c.that("trace: stale flag", fl["stale"], fh.summary(spans))
    c.that("trace: P expired", any(x.endswith("=expired") for x in fl["not_ok"]), fl)
    c.that("trace: partial handoff.open written while stuck", fl["open"], fh.summary(spans))
    c.that("trace: the complete trace replaces the partial one", not fl["open_shown"], fl["open_shown"])
    c.that("no healthy request flagged", not ff, ff)
    det.notes.update(
        {
            "client": status,
            "detected_on": sorted(w.phases),
            "alerts": sorted(w.alerts),
            "false_flags": len(ff),
            "failed_checks": c.failed(),
            "trace": fh.summary(spans),
            "peak": {k: v for k, v in w.peak.items() if "open" in k or "pinned" in k},
        }
    )
    fh.mark_trace(det, spans)
    det.notes["alerts_before"] = sorted(w.before)
    fault_table.append(det.row())
    c.done()


def test_pull_prefill_killed_mid_handoff_fails_on_d_without_orphans(
    fault_pull_stack, fault_prometheus, fault_table, stack_factory
):
    """D's engine worker frozen, the request relayed to D, P killed
    (SIGKILL to its whole process group), D resumed: D's open handoff shows
    while it waits, then ends ``failed``; P leaves no process behind, and the
    stack stops cleanly without its P. Ends the pair: last in this module."""
    stack = fault_pull_stack
    prom = fault_prometheus(stack)
    before = fh.healthy(stack.router_url, 2, "health-killp-before")
    decode, prefill = _child(stack, "decode"), _child(stack, "prefill")
    tid = uuid.uuid4().hex
    det = fh.Detect("pull: P killed mid-handoff")
    p_pids = fh.group_pids(prefill)
    with fh.Watcher(det, _targets(stack), "pull", prom.url) as w:
        with fh.frozen(decode, only=fh.is_engine_worker):
            req = fh.InFlight(stack.router_url + ENDPOINT, _body("kill-p"), tid)
            # D's API server and scheduler take the request; its worker cannot READ
            fh.poll(lambda: det.after("decode:open") is not None, SLACK_S)
            det.start = time.time()
            fh.kill(prefill)
            det.mark("P killed")
            fh.poll(lambda: not fh.alive_pids(p_pids), 30)
            det.mark("P's processes gone")
            # long enough for D's partial trace (written after 5 s open) before D resumes
            opened = det.seen.get("decode:open", time.time())
            while time.time() < opened + OPEN_TRACE_AFTER_S + 2:
                if fh.listed_open(stack.store.text, tid):
                    det.mark("traces --open")
                time.sleep(0.5)
        det.mark("resumed")
        status = req.wait(SLACK_S)
        det.mark("client answered")
        fh.poll(lambda: det.after("decode:failed") or det.after("decode:timeout"), 30)
        fh.poll(lambda: det.after("alert:KvlensHandoffsFailing") is not None, 20)
    spans = fh.wait_trace(stack.store, tid, lambda s: fh.flags(s)["not_ok"], SLACK_S)
    ff = fh.false_flags(stack.store, before)
    all_pids = [p for c in stack.children if c.proc is not None for p in fh.group_pids(c)]
    stack_factory.stop()  # the pair is done; the factory must stop what is left of it
    no_leftover = fh.poll(lambda: not fh.alive_pids(all_pids + p_pids), 30)
    fl = fh.flags(spans)
    c = fh.Checks()
    c.that("the client gets an error", status != 200, status)
    c.that("P's processes all gone after SIGKILL", not fh.alive_pids(p_pids), fh.alive_pids(p_pids))
    c.that("D: open handoff while it waits", det.after("decode:open") is not None, w.peak)
    c.that(
        "D: failed or timeout counted once",
        (w.delta("decode", "failed") or 0) + (w.delta("decode", "timeout") or 0) == 1,
        w.last["decode"],
    )
    c.that("kvlens traces --open lists it while stuck", det.after("traces --open") is not None)
    c.that("trace: D's handoff not ok", any(x.startswith("decode:") for x in fl["not_ok"]), fh.summary(spans))
    c.that("trace: partial handoff.open written while stuck", fl["open"], fh.summary(spans))
    c.that("trace: the complete trace replaces the partial one", not fl["open_shown"], fl["open_shown"])
    c.that("no process left once the stack stopped", no_leftover, fh.alive_pids(all_pids + p_pids))
    c.that("no healthy request flagged", not ff, ff)
    det.notes.update(
        {
            "client": status,
            "detected_on": sorted(w.phases),
            "alerts": sorted(w.alerts),
            "false_flags": len(ff),
            "failed_checks": c.failed(),
            "trace": fh.summary(spans),
        }
    )
    fh.mark_trace(det, spans)
    det.notes["alerts_before"] = sorted(w.before)
    fault_table.append(det.row())
    c.done()
