"""What e2e tests send through a router: n greedy completions, each looked
up afterwards by the trace its spans are under."""

from __future__ import annotations

import uuid

import httpx

from kvrecord import ids


def send_completions(
    url: str,
    n: int,
    *,
    tag: str,
    kvlens_id: bool = True,
    base_tokens: int = 30,
    step_tokens: int = 20,
    timeout: float = 180,
) -> list[str]:
    """``n`` completions through the router at ``url`` (prompt ``i`` grows by
    ``step_tokens``), each with a fresh 32-hex ``X-Request-Id`` unless
    ``kvlens_id`` is False; the trace id of each, as a client finds it
    (``ids.trace_of_response``: the id sent, or the one the router gave)."""
    out = []
    with httpx.Client(timeout=timeout) as c:
        for i in range(n):
            sent = uuid.uuid4().hex
            body = {
                "prompt": f"{tag} request {i} " + "tokens " * (base_tokens + step_tokens * i),
                "max_tokens": 4,
                "temperature": 0,
            }
            r = c.post(url + "/v1/completions", json=body, headers={"X-Request-Id": sent} if kvlens_id else {})
            assert r.status_code == 200, r.text
            out.append(ids.trace_of_response(r.json().get("id"), sent))
    return out
