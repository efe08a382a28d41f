"""How P's and D's failures reach the client: :class:`Upstream` (status,
message, outcome) and its JSON or SSE form. Pure except
:func:`from_status`, which reads the failed response's body (event loop)."""

from __future__ import annotations

import contextlib
import json

import httpx
from fastapi.responses import JSONResponse


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
    """A transport failure: 504 ``timeout`` for timeouts, else 502."""
    if isinstance(e, httpx.TimeoutException):
        return Upstream(who, 504, f"{who} instance at {url} timed out ({type(e).__name__})", "timeout")
    return Upstream(who, 502, f"{who} instance at {url} unreachable: {type(e).__name__}: {e}")


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
    """P's background call failed with ``exc``: as the client sees it."""
    if isinstance(exc, Upstream):
        return exc
    return Upstream("prefill", 502, f"prefill failed: {type(exc).__name__}: {exc}")


def sse_error(message: str, status: int) -> bytes:
    """An error event for a stream already answered 200."""
    ev = {"error": {"message": message, "type": "upstream_error", "code": status}}
    return b"data: " + json.dumps(ev).encode() + b"\n\n"
