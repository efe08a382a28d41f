"""End-to-end faults on a real push pair (issue 2, "Bad input and faults"):
a D registration that never matches ends its trace ``timeout``; a D killed
after registering ends the trace ``failed``/``expired`` on P; serving goes on
and kvlens logs no hook failure.

The pair runs with short vLLM timeouts (conftest ``FAULT_*``) so each fault
resolves in seconds. The requests are sent straight to P and D with exactly
the parameters the overlapped router sends, which lets the test hold back
P's half (never matched) or kill D between its registration and P's WRITE.
A WRITE of a ~1 MB KV cache takes about a millisecond here, so "killed while
the WRITE is in flight" cannot be timed from outside; killed after its
registration reached P is the same failure for P: it writes into a peer
that is gone.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
import uuid

import httpx
import pytest

from kvrecord import semconv as sc
from proxy.bodies import overlapped_d_params, prefill_body
from proxy.config import ProxyConfig
import fault_harness as fh
from stack_settings import FAULT_FREEZE_S, FAULT_KV_LEASE_S, FAULT_REGISTRATION_TIMEOUT_S

pytestmark = pytest.mark.e2e

ENDPOINT = "/v1/completions"
# Time for spans to reach the store from three processes on a loaded box,
# on top of the vLLM timeout being exercised.
SLACK_S = 90.0


def _cfg(stack) -> ProxyConfig:
    return ProxyConfig(
        prefill_url=stack.prefill_url,
        decode_url=stack.decode_url,
        mode="push",
        prefill_engine_id="p0",
        prefill_side_host=stack.host,
        prefill_side_port=stack.prefill_side_port,
        kvlens_home=str(stack.kvlens_home),
    )


def _body(tag: str) -> dict:
    return {"prompt": f"kvlens fault {tag} " + "tokens " * 60, "max_tokens": 4, "temperature": 0}


def _d_body(stack, tid: str) -> dict:
    b = _body(tid)
    b["kv_transfer_params"] = overlapped_d_params(_cfg(stack), ENDPOINT, tid)
    return b


def _spans(db, tid: str) -> list[dict]:
    return fh.spans_of(db, tid)  # [] until the store exists (a fresh session's first stack)


def _row(db, tid: str) -> dict | None:
    return fh.trace_row(db, tid)


async def _wait_span(db, tid: str, pred, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        found = [s for s in _spans(db, tid) if pred(s)]
        if found:
            return found[0]
        if time.monotonic() > deadline:
            seen = [(s["name"], s["role"], s["outcome"]) for s in _spans(db, tid)]
            pytest.fail(f"no {what} for trace {tid} within {timeout:.0f}s; spans seen: {seen}")
        await asyncio.sleep(0.5)


async def _post_d(stack, tid: str) -> int | str:
    """D's half of an overlapped push; waits for P's KV (the test cancels it)."""
    try:
        async with httpx.AsyncClient(timeout=None) as c:
            r = await c.post(stack.decode_url + ENDPOINT, json=_d_body(stack, tid), headers={"X-Request-Id": tid})
            return r.status_code
    except httpx.HTTPError as e:
        return type(e).__name__


def _is_reg_send(s: dict) -> bool:
    return s["name"] == sc.Phase.REGISTRATION_SEND.value and s["role"] == "decode"


def _assert_no_hook_failures(stack) -> None:
    """kvlens logs a failing hook once ("hook X failed"); none may fail here."""
    for c in stack.children:
        if c.name in ("prefill", "decode") and c.log.exists():
            text = c.log.read_text(errors="replace")
            assert "failed; this phase is skipped" not in text, c.log


def test_registration_that_never_matches_ends_timeout(fault_push_stack):
    """D registers its blocks with P, P never gets the request: D's watchdog
    fires after push_registration_timeout and the trace ends ``timeout``;
    D keeps serving."""
    stack = fault_push_stack
    tid = uuid.uuid4().hex

    async def scenario():
        d = asyncio.create_task(_post_d(stack, tid))
        try:
            sent = await _wait_span(stack.store, tid, _is_reg_send, SLACK_S, "registration.send on D")
            # while D keeps waiting after its watchdog, the handoff is open
            # and its partial trace carries the flag (docs/handoff-health.md)
            partial = await _wait_span(
                stack.store,
                tid,
                lambda s: (
                    s["name"] == sc.SPAN_HANDOFF_OPEN and s["attributes"].get(sc.ATTR_REGISTRATION_TIMEOUT) is True
                ),
                FAULT_REGISTRATION_TIMEOUT_S + SLACK_S,
                "handoff.open flagged registration_timeout",
            )
        finally:
            # vLLM 0.32 leaves D's request waiting after its watchdog; the
            # client (here: us) going away is what aborts it.
            d.cancel()
            await asyncio.gather(d, return_exceptions=True)
        ready = await _wait_span(
            stack.store, tid, lambda s: s["name"] == sc.Phase.KV_READY.value, SLACK_S, "kv.ready when D gave up"
        )
        return sent, partial, ready

    sent, partial, ready = asyncio.run(scenario())
    assert partial["role"] == "decode" and partial["attributes"][sc.ATTR_OPEN_PHASE] == "awaiting_kv", partial
    assert ready["role"] == "decode"
    assert ready["outcome"] == sc.Outcome.TIMEOUT.value, ready
    assert "timed out" in ready["attributes"].get(sc.ATTR_ERROR, "")
    # kv.ready ends when the request does: the wait after the watchdog is measured
    assert ready["attributes"][sc.ATTR_REGISTRATION_TIMEOUT] is True
    assert ready["attributes"][sc.ATTR_REGISTRATION_TIMEOUT_WAIT_S] >= 0
    # the watchdog fires no earlier than the configured timeout after staging
    stage = next(s for s in _spans(stack.store, tid) if s["name"] == sc.Phase.REGISTRATION_STAGE.value)
    assert ready["start_ns"] - stage["start_ns"] >= FAULT_REGISTRATION_TIMEOUT_S * 1e9 * 0.99
    assert sent["start_ns"] >= stage["start_ns"]
    # the warm-up request already did D's handshake with P: sent at once
    assert sent["attributes"][sc.ATTR_DEFERRED] is False, sent
    names = {s["name"] for s in _spans(stack.store, tid)}
    assert not names & {sc.Phase.MATCH.value, sc.Phase.WRITE_POST.value, sc.Phase.WRITE_COMPLETE.value}

    deadline = time.monotonic() + 30
    while (row := _row(stack.store, tid)) is None or row["outcome"] != "timeout":
        assert time.monotonic() < deadline, row
        time.sleep(0.5)
    assert row["handoff_s"] is None  # P never finished this prefill

    # serving goes on through the router, end to end
    with httpx.Client(timeout=180) as c:
        r = c.post(stack.router_url + ENDPOINT, json=_body("after-timeout"))
        assert r.status_code == 200, r.text
    assert stack.dead_child() is None
    _assert_no_hook_failures(stack)


# ---------------------------------------------------------------- handoff health (issue 37)
# Each fault is timed from its injection to the first scrape that shows it on
# an instance's /metrics and to the alert firing in a real Prometheus loaded
# with the shipped alert rules (fault_harness.Detect; recorded, never
# asserted). Healthy requests sent around each fault must carry no flag.


def _child(stack, name: str):
    return next(c for c in stack.children if c.name == name)


def _targets(stack) -> dict[str, str]:
    return {"prefill": stack.prefill_url, "decode": stack.decode_url}


def test_push_decode_frozen_past_the_lease_shows_open_expired_and_registration_timeout(
    fault_push_stack, fault_prometheus, fault_table
):
    """D's whole process tree frozen (SIGSTOP) for FAULT_FREEZE_S > the lease
    while one overlapped request is in flight. vLLM: P finishes the prefill,
    holds the KV without a registration, releases it at the lease; D resumes,
    registers, its watchdog fires after the registration timeout and the
    request waits on until the client gives up. kvlens: P's open handoff and
    its unregistered prefill show while D is frozen, ``expired`` on P at the
    lease, ``registration_timeout`` on D, the alerts fire, ``kvlens traces
    --open`` lists the request while it waits, and nothing else is flagged."""
    stack = fault_push_stack
    prom = fault_prometheus(stack)
    before = fh.healthy(stack.router_url, 2, "health-push-before")
    decode = _child(stack, "decode")
    tid = uuid.uuid4().hex
    det = fh.Detect("push: D frozen past the lease")
    with fh.Watcher(det, _targets(stack), "push", prom.url) as w:
        with fh.frozen(decode):
            det.start = time.time()
            req = fh.InFlight(stack.router_url + ENDPOINT, _body("frozen-d"), tid)
            while time.time() - det.start < FAULT_FREEZE_S:
                if fh.listed_open(stack.store.text, tid):
                    det.mark("traces --open")
                time.sleep(0.5)
        det.mark("resumed")
        # D registers now; P released the KV: D waits until its watchdog, then on
        fh.poll(lambda: det.after("decode:registration_timeouts") is not None, FAULT_REGISTRATION_TIMEOUT_S + SLACK_S)
        if fh.poll(lambda: fh.listed_open(stack.store.text, tid), 30):
            det.mark("traces --open")
        fh.poll(lambda: det.after("alert:KvlensHandoffStuck") is not None, 30)
        fh.poll(lambda: det.after("alert:KvlensRegistrationTimeouts") is not None, 15)
        still_waiting = not req.done()
        req.cancel()  # the client gives up
        req.wait(30)
        det.mark("client gave up")
        if fh.poll(lambda: not w.last["decode"].get("open"), 30):
            det.mark("decode open back to 0")
    gone_from_open = fh.poll(lambda: not fh.listed_open(stack.store.text, tid), 30)
    after = fh.healthy(stack.router_url, 2, "health-push-after")
    spans = fh.wait_trace(stack.store, tid, lambda s: fh.flags(s)["registration_timeout"], SLACK_S)
    ff = fh.false_flags(stack.store, before + after)
    fl = fh.flags(spans)
    c = fh.Checks()
    c.that("the request still waits after D's watchdog (vLLM 0.32)", still_waiting)
    c.that("P: open handoff while D is frozen", det.after("prefill:open") is not None, w.peak)
    c.that("P: oldest open start while D is frozen", det.after("prefill:oldest_open") is not None, w.peak)
    c.that("P: pinned unregistered_prefill", det.after("prefill:pinned:unregistered_prefill") is not None, w.peak)
    c.that("P: expired counted once", w.delta("prefill", "expired") == 1, w.last["prefill"])
    c.that("D: open handoff after resume", det.after("decode:open") is not None, w.peak)
    c.that("D: registration timeout counted once", w.delta("decode", "registration_timeouts") == 1, w.last["decode"])
    c.that("kvlens traces --open lists it while stuck", det.after("traces --open") is not None)
    c.that("kvlens traces --open drops it once ended", gone_from_open)
    c.that("alert KvlensHandoffStuck fired", "KvlensHandoffStuck" in w.alerts, sorted(w.alerts))
    c.that("alert KvlensRegistrationTimeouts fired", "KvlensRegistrationTimeouts" in w.alerts, sorted(w.alerts))
    c.that("trace: registration_timeout flag", fl["registration_timeout"], fh.summary(spans))
    c.that("trace: P expired", any(x.startswith("prefill:") and x.endswith("=expired") for x in fl["not_ok"]), fl)
    c.that("trace: partial handoff.open written while stuck", fl["open"], fh.summary(spans))
    c.that("trace: the complete trace replaces the partial one", not fl["open_shown"], fl["open_shown"])
    c.that("no healthy request flagged", not ff, ff)
    det.notes.update(
        {
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
    _assert_no_hook_failures(stack)
    c.done()


def test_push_registration_that_cannot_reach_p(fault_push_stack, fault_prometheus, fault_table):
    """D is given a side channel (host, port, engine id) that accepts TCP and
    never answers; P gets the request as usual. vLLM 0.32: D's handshake
    times out after 5 s (zmq receive timeout) and D fails the request
    (HTTP 500, ``push_reg_handshake_failed``) before its registration
    watchdog; P holds the finished prefill without a registration until the
    lease. kvlens: D's open handoff then ``failed``; P's unregistered prefill
    on its pinned gauges, then ``expired``; nothing else flagged."""
    stack = fault_push_stack
    prom = fault_prometheus(stack)
    before = fh.healthy(stack.router_url, 2, "health-unreach-before")
    tid = uuid.uuid4().hex
    det = fh.Detect("push: D's registration cannot reach P")
    with socket.socket() as hole, fh.Watcher(det, _targets(stack), "push", prom.url) as w:
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)  # accepts, never answers
        body = _body("unreachable")
        body["kv_transfer_params"] = {
            **overlapped_d_params(_cfg(stack), ENDPOINT, tid),
            "remote_engine_id": "p-unreachable",
            "remote_port": hole.getsockname()[1],
        }
        det.start = time.time()
        d = fh.InFlight(stack.decode_url + ENDPOINT, body, tid)
        with httpx.Client(timeout=180) as c:
            r = c.post(stack.prefill_url + ENDPOINT, json=prefill_body(_body(tid)), headers={"X-Request-Id": tid})
            assert r.status_code == 200, r.text
        d_status = d.wait(SLACK_S)
        det.mark("D answered")
        fh.poll(lambda: det.after("prefill:expired") is not None, FAULT_KV_LEASE_S + SLACK_S)
        fh.poll(lambda: det.after("alert:KvlensHandoffsFailing") is not None, 30)
    after = fh.healthy(stack.router_url, 2, "health-unreach-after")
    ff = fh.false_flags(stack.store, before + after)
    spans = fh.spans_of(stack.store, tid)
    c = fh.Checks()
    c.that("D fails the request (vLLM 0.32: handshake timeout)", d_status not in (200, None), d_status)
    c.that("D: open handoff while it waits", det.after("decode:open") is not None, w.peak)
    c.that("P: pinned unregistered_prefill", det.after("prefill:pinned:unregistered_prefill") is not None, w.peak)
    c.that("P: expired counted once", w.delta("prefill", "expired") == 1, w.last["prefill"])
    c.that(
        "D: failed or timeout counted once",
        (w.delta("decode", "failed") or 0) + (w.delta("decode", "timeout") or 0) == 1,
        w.last["decode"],
    )
    c.that("no healthy request flagged", not ff, ff)
    det.notes.update(
        {
            "D status": d_status,
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
    _assert_no_hook_failures(stack)
    c.done()


def test_decode_killed_before_the_write_fails_on_p_and_p_keeps_serving(fault_push_stack):
    """D registers, D is killed, then P finishes the prefill and writes into
    the dead peer: P's completion span ends ``failed`` (NIXL error) or
    ``expired`` (lease ran out), the trace carries it, and P keeps serving.
    This test leaves the pair without its D: keep it last in its module."""
    stack = fault_push_stack
    tid = uuid.uuid4().hex
    decode = next(c for c in stack.children if c.name == "decode")

    async def scenario():
        d = asyncio.create_task(_post_d(stack, tid))
        await _wait_span(stack.store, tid, _is_reg_send, SLACK_S, "registration.send on D")
        # P's NIXL agent takes the PUSH_REG in on its progress thread; P's
        # connector reads it when P next steps (vLLM's writer thread parks
        # while P is idle), i.e. when P's half arrives below.
        await asyncio.sleep(2)
        os.killpg(decode.proc.pid, signal.SIGKILL)
        await asyncio.to_thread(decode.proc.wait, 30)
        d_result = await asyncio.wait_for(d, 30)
        return d_result

    d_result = asyncio.run(scenario())
    assert d_result != 200, "D answered although it was killed"

    with httpx.Client(timeout=180) as c:
        r = c.post(stack.prefill_url + ENDPOINT, json=prefill_body(_body(tid)), headers={"X-Request-Id": tid})
        assert r.status_code == 200, r.text

    done = asyncio.run(
        _wait_span(
            stack.store,
            tid,
            lambda s: s["name"] == sc.Phase.WRITE_COMPLETE.value and s["role"] == "prefill",
            FAULT_KV_LEASE_S + SLACK_S,
            "write.complete on P",
        )
    )
    assert done["outcome"] in (sc.Outcome.FAILED.value, sc.Outcome.EXPIRED.value), done
    spans = _spans(stack.store, tid)
    names = {s["name"] for s in spans}
    assert sc.Phase.PREFILL_FINISHED.value in names, names
    # matched (the WRITE went to the dead peer) or never matched (the notif
    # died with D): either way the lease or NIXL ends it on P
    if done["outcome"] == sc.Outcome.FAILED.value:
        assert sc.Phase.MATCH.value in names, names
    deadline = time.monotonic() + 30
    while (row := _row(stack.store, tid)) is None or row["outcome"] == "ok":
        assert time.monotonic() < deadline, row
        time.sleep(0.5)
    # the trace carries the worst outcome of its spans (failed > timeout > expired)
    worst = max((s["outcome"] for s in _spans(stack.store, tid)), key=("ok", "expired", "timeout", "failed").index)
    assert row["outcome"] == worst != "ok", row

    # P is unharmed: health, and a plain completion on P alone
    prefill = next(c for c in stack.children if c.name == "prefill")
    assert prefill.alive()
    with httpx.Client(timeout=180) as c:
        assert c.get(stack.prefill_url + "/health").status_code == 200
        r = c.post(stack.prefill_url + ENDPOINT, json=_body("p-alone"))
        assert r.status_code == 200, r.text
        # the router names the dead upstream instead of hanging
        r = c.post(stack.router_url + ENDPOINT, json=_body("no-decode"))
        assert r.status_code in (502, 503, 504), r.text
        assert "decode" in r.text
    _assert_no_hook_failures(stack)
