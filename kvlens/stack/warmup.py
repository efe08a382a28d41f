"""Warming a new stack up: tiny requests end to end before it is reported
ready (:func:`warm_up`). Blocks the calling thread (HTTP, up to
``timeout_s`` per request).
"""

from __future__ import annotations

import time
from typing import Callable, Mapping

from kvrecord.ids import new_trace_id
from kvlens.stack.errors import StackError


#: The pause after a warm-up try answered with an error, seconds (doubling each time, at most :data:`PAUSE_MAX_S`).
PAUSE_S = 2.0
PAUSE_MAX_S = 30.0


def warm_up(
    router_url: str,
    headers: Mapping[str, str],
    say: Callable[[str], None],
    dead_child: Callable,
    tries: int = 3,
    timeout_s: float = 90.0,
    rounds: int = 1,
    deadline: float | None = None,
    where_stuck: Callable[[str], str | None] | None = None,
    pause_s: float = PAUSE_S,
) -> None:
    """``rounds`` tiny requests through the router at ``router_url`` (one per
    (P, D) pair: kvlens' router cycles over the pairs, so every pair's
    first-contact handshake happens here), each tried up to ``tries`` times. ``dead_child()``: a child
    that died (then StackError), else None.

    ``deadline`` (``time.monotonic()``): the stack's start timeout; no request
    waits past it, and a warm-up still unanswered then is a StackError saying
    where it is stuck: ``where_stuck(trace_id)`` (which side waits, in which
    phase, from the store), so a start that hangs fails within its timeout
    and names the side (issue 43 item 7), instead of reporting ready. With a
    deadline the last try waits until it (not ``timeout_s``), a try answered
    with an error (HTTP 500: a handshake that missed vLLM's 5 s, below) is
    tried again after a pause (``pause_s``, doubling, at most
    :data:`PAUSE_MAX_S`) for as long as the deadline leaves time, even past
    ``tries``, and a request that failed every try is a StackError too:
    ``tries`` times ``timeout_s``
    (270 s by default) is shorter than a mixed fleet's start timeout (600 s),
    so a hung D used to run the tries out and the stack reported ready with a
    warning while its D hung (vLLM ends a hung worker only after
    ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, 300 s). Without a deadline a
    request that failed every try is a warning, as before.

    The first request to a new P/D pair pays for kernel warm-up and the
    first-contact NIXL handshakes; vLLM gives a handshake reply 5 s, and
    on a loaded machine a cold engine can miss that, which strands that
    request until vLLM's registration timeout. Paying it here keeps it
    out of the user's (and the tests') first measured request. A failed
    handshake is retried by vLLM on the next request, hence the retries.
    """
    last: str | None = None  # the trace id of the last request that got no answer
    last_error = ""  # how it failed: HTTP status or transport error
    for n in range(1, rounds + 1):
        tag = f" {n}/{rounds}" if rounds > 1 else ""
        i = 0
        while True:
            i += 1
            left = timeout_s if deadline is None else deadline - time.monotonic()
            if deadline is not None and i < tries:
                left = min(timeout_s, left)  # the last try waits until the deadline
            tid = new_trace_id()
            if left < 1.0:
                raise StackError(_stuck_message(tag, tid, last, where_stuck))
            status, last_error = _request(router_url, headers, tid, left)
            if status == 200:
                say(f"warm-up request{tag} ok ({i}/{tries})")
                break
            answered = status is not None  # an answer that is an error (not a timeout): retried after a pause
            say(f"warm-up request{tag} {'returned' if answered else 'failed:'} {last_error} ({i}/{tries})")
            last = tid
            dead = dead_child()
            if dead is not None:
                raise StackError(dead.died_message())
            if deadline is not None and deadline - time.monotonic() < 1.0:
                raise StackError(_stuck_message(tag, tid, tid, where_stuck))
            pause = min(PAUSE_MAX_S, pause_s * 2 ** (i - 1))
            if deadline is None:
                if i >= tries:
                    say("warning: warm-up never succeeded; the stack is up but may be unhealthy")
                    return
            elif i >= tries and (not answered or deadline - time.monotonic() - pause < 1.0):
                # every try ended in an error before the deadline: the stack does not serve
                raise StackError(_failed_message(tag, i, last_error, last, where_stuck))
            if answered:
                time.sleep(pause)


def _request(router_url: str, headers: Mapping[str, str], tid: str, timeout_s: float) -> tuple[int | None, str]:
    """One tiny completion through the router: (its HTTP status, how it failed
    in words); status None where no answer came (a transport error, a timeout)."""
    import httpx  # start-up cost: ``kvlens --help`` imports this module

    try:
        r = httpx.post(
            router_url + "/v1/completions",
            json={"prompt": "kvlens warm-up", "max_tokens": 2, "temperature": 0},
            timeout=timeout_s,
            headers={"X-Request-Id": tid, **headers},
        )
    except httpx.HTTPError as e:
        return None, type(e).__name__
    return r.status_code, f"HTTP {r.status_code}"


def _stuck_message(tag: str, tid: str, last: str | None, where_stuck: Callable[[str], str | None] | None) -> str:
    """Why the start timed out in the warm-up, naming the stuck side where the store knows it."""
    last = last or tid
    return f"start timeout: the warm-up request{tag} (trace {last}) got no answer in time; " + _where(where_stuck, last)


def _failed_message(
    tag: str, tries: int, error: str, tid: str | None, where_stuck: Callable[[str], str | None] | None
) -> str:
    """Why the start failed when every warm-up try ended in an error before the deadline."""
    return (
        f"start failed: the warm-up request{tag} failed {tries} of {tries} tries (last: {error}, trace {tid}); "
        + _where(where_stuck, tid)
    )


def _where(where_stuck: Callable[[str], str | None] | None, tid: str | None) -> str:
    """Where the store says request ``tid`` is stuck, or why it cannot say."""
    where = None
    if where_stuck is not None and tid is not None:
        try:
            where = where_stuck(tid)
        except Exception as e:  # noqa: BLE001 - the failed start is the error; the store only explains it
            where = f"the trace store could not say where ({type(e).__name__}: {e})"
    return where or "the trace store holds no span of it that names a waiting side"


def where_stuck(loc, trace_id: str) -> str | None:
    """Where a request is stuck, from the trace store ``loc``: the sides its
    partial trace says still wait (side, engine, phase, how long), else which
    roles reported spans and which end of the handoff is missing; None when
    the store holds nothing of it."""
    from kvtrace import store, stuck

    with store.reading(loc) as conn:
        sides = [s for s in stuck.stuck(conn, since_ns=None) if s.trace_id == trace_id]
        spans = store.spans_for(conn, [trace_id]).get(trace_id) or []
        rows = store.slowest(conn, 1, order="start", trace_ids=[trace_id])
    if sides:
        return "; ".join(
            f"{s.mode or '?'} {s.side} ({s.engine or '?'}) still waits in {s.phase or '?'} "
            f"({s.waited_s:.1f} s at its last report)"
            for s in sides
        )
    if not spans and not rows:
        return None
    roles = sorted({str(sp.get("role") or "?") for sp in spans})
    row = rows[0] if rows else {}
    if row.get("prefill_finished_ns") is None:
        missing = "P never finished its prefill (no prefill.finished): P is stuck"
    elif row.get("kv_ready_ns") is None:
        missing = "P finished its prefill, D never reported kv.ready: D is stuck"
    else:
        missing = "both ends of the handoff arrived: stuck after the handoff (D's decode or the router)"
    return f"spans from {', '.join(roles) or 'no process'}; {missing}"
