"""Warming a new stack up: tiny requests end to end before it is reported
ready (:func:`warm_up`). Blocks the calling thread (HTTP, up to
``timeout_s`` per request).
"""

from __future__ import annotations

from typing import Callable, Mapping

from kvrecord.ids import new_trace_id
from kvlens.stack.errors import StackError


def warm_up(
    router_url: str,
    headers: Mapping[str, str],
    say: Callable[[str], None],
    dead_child: Callable,
    tries: int = 3,
    timeout_s: float = 90.0,
    rounds: int = 1,
) -> None:
    """``rounds`` tiny requests through the router at ``router_url`` (one per
    (P, D) pair: kvlens' router cycles over the pairs, so every pair's
    first-contact handshake happens here), each tried up to ``tries`` times. ``dead_child()``: a child
    that died (then StackError), else None.

    The first request to a new P/D pair pays for kernel warm-up and the
    first-contact NIXL handshakes; vLLM gives a handshake reply 5 s, and
    on a loaded machine a cold engine can miss that, which strands that
    request until vLLM's registration timeout. Paying it here keeps it
    out of the user's (and the tests') first measured request. A failed
    handshake is retried by vLLM on the next request, hence the retries.
    """
    import httpx  # start-up cost: ``kvlens --help`` imports this module

    for n in range(1, rounds + 1):
        tag = f" {n}/{rounds}" if rounds > 1 else ""
        for i in range(1, tries + 1):
            try:
                r = httpx.post(
                    router_url + "/v1/completions",
                    json={"prompt": "kvlens warm-up", "max_tokens": 2, "temperature": 0},
                    timeout=timeout_s,
                    headers={"X-Request-Id": new_trace_id(), **headers},
                )
                if r.status_code == 200:
                    say(f"warm-up request{tag} ok ({i}/{tries})")
                    break
                say(f"warm-up request{tag} returned HTTP {r.status_code} ({i}/{tries})")
            except httpx.HTTPError as e:
                say(f"warm-up request{tag} failed: {type(e).__name__} ({i}/{tries})")
            dead = dead_child()
            if dead is not None:
                raise StackError(dead.died_message())
        else:
            say("warning: warm-up never succeeded; the stack is up but may be unhealthy")
            return
