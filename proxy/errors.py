"""How P's and D's failures reach the client: :class:`Upstream` (status,
message, outcome) and its JSON or SSE form. Pure except
:func:`from_status`, which reads the failed response's body (event loop),
and the warnings written to the router's log.

A client learns which side failed (``prefill`` / ``decode``) and the error's
class, never the instances' internal URLs or addresses: those, with the
error's own text, go to the router's log (logger ``proxy``). An
upstream answer the router cannot use (a 200 whose body is not JSON, JSON of
the wrong shape, no field the router needs) is a 502 naming the side, as a
transport failure is.
"""

from __future__ import annotations

import contextlib
import json
import logging

import httpx
from fastapi.responses import JSONResponse

logger = logging.getLogger("kvlens.proxy")


class Upstream(Exception):
    """P or D failed: carries the status the client gets and the outcome the
    root span records (``failed`` or ``timeout``)."""

    def __init__(self, who: str, status: int, message: str, outcome: str = "failed") -> None:
        super().__init__(message)
        self.who, self.status, self.message, self.outcome = who, status, message, outcome

    def response(self, tid: str) -> JSONResponse:
        return JSONResponse(
            {
                "error": {
                    "message": self.message,
                    "type": "upstream_error",
                    "upstream": self.who,
                    "upstream_status": self.status,
                    "trace_id": tid,
                }
            },
            status_code=self.status,
            headers={"X-Request-Id": tid},
        )


def from_http_error(who: str, url: str, e: Exception) -> Upstream:
    """A transport failure: 504 ``timeout`` for timeouts, else 502. The
    client's message names the side and the error class; ``url`` and the
    error's text go to the router's log only."""
    logger.warning("kvlens proxy: %s instance at %s: %s: %s", who, url, type(e).__name__, e)
    if isinstance(e, httpx.TimeoutException):
        return Upstream(who, 504, f"{who} instance timed out ({type(e).__name__})", "timeout")
    return Upstream(who, 502, f"{who} instance unreachable ({type(e).__name__})")


def unexpected(who: str, what: str, body: bytes | str = b"") -> Upstream:
    """A 200 the router cannot use (``what``: "a body that is not JSON", ...):
    502 naming the side; the body's head goes to the router's log."""
    logger.warning("kvlens proxy: %s instance answered 200 with %s: %r", who, what, body[:200])
    return Upstream(who, 502, f"{who} instance answered 200 with {what}")


def completion_problem(content: bytes) -> str | None:
    """What is wrong with a plain (non-streamed) completion body for the
    router to pass on as 200, or None: it must be a JSON object with a
    ``choices`` list, as every OpenAI-compatible completion is."""
    try:
        obj = json.loads(content)
    except ValueError:
        return "a body that is not JSON"
    if not isinstance(obj, dict):
        return f"JSON that is not an object ({type(obj).__name__})"
    if not isinstance(obj.get("choices"), list):
        return "JSON without a `choices` list"
    return None


async def from_status(who: str, resp: httpx.Response) -> Upstream:
    """A non-200 answer: its status (502 if not an error status) and the
    upstream's own error message when its body has one."""
    try:
        body = (await resp.aread()).decode("utf-8", "replace")
    except Exception:
        body = ""
    detail = body[:1000]
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        j = json.loads(body)
        err = j.get("error", j) if isinstance(j, dict) else j
        detail = err.get("message", detail) if isinstance(err, dict) else str(err)
    status = resp.status_code if resp.status_code >= 400 else 502
    return Upstream(who, status, f"{who} instance returned HTTP {resp.status_code}: {detail}")


def as_upstream(exc: BaseException) -> Upstream:
    """P's background call failed with ``exc``: as the client sees it (the
    error's text only in the router's log)."""
    if isinstance(exc, Upstream):
        return exc
    logger.warning("kvlens proxy: prefill call failed: %s: %s", type(exc).__name__, exc)
    return Upstream("prefill", 502, f"prefill failed ({type(exc).__name__})")


def sse_error(message: str, status: int) -> bytes:
    """An error event for a stream already answered 200."""
    ev = {"error": {"message": message, "type": "upstream_error", "code": status}}
    return b"data: " + json.dumps(ev).encode() + b"\n\n"
