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
import time
import uuid

import httpx
import pytest

from kvtrace import store
from kvtrace.store.errors import StoreMissing
from kvrecord import semconv as sc
from kvlens import proxy
from stack_settings import FAULT_KV_LEASE_S, FAULT_REGISTRATION_TIMEOUT_S

pytestmark = pytest.mark.e2e

ENDPOINT = "/v1/completions"
# Time for spans to reach the store from three processes on a loaded box,
# on top of the vLLM timeout being exercised.
SLACK_S = 90.0


def _cfg(stack) -> proxy.ProxyConfig:
    return proxy.ProxyConfig(
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
    b["kv_transfer_params"] = proxy.overlapped_d_params(_cfg(stack), ENDPOINT, tid)
    return b


def _spans(db, tid: str) -> list[dict]:
    try:
        conn = store.connect(db, readonly=True)
    except StoreMissing:  # a fresh stack's sidecar has not created it yet: nothing recorded so far
        return []
    try:
        return store.spans_for(conn, [tid]).get(tid, [])
    finally:
        conn.close()


def _row(db, tid: str) -> dict | None:
    conn = store.connect(db, readonly=True)
    try:
        rows = store.slowest(conn, 1, trace_ids=[tid])
        return dict(rows[0]) if rows else None
    finally:
        conn.close()


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
            # and its partial trace carries the flag (docs/health.md)
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
        r = c.post(stack.prefill_url + ENDPOINT, json=proxy.prefill_body(_body(tid)), headers={"X-Request-Id": tid})
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
