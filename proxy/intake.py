"""What the router checks before it spends anything on P or D: the client's
key (:func:`client_auth`, in front of every route),
the body's size, that it is a JSON object, and the few fields the router
itself relies on. A failed check is a :class:`Refused` (4xx, OpenAI-style
JSON error naming the field).

Why these fields and no others: P gets a rewritten copy of the body
(:func:`proxy.bodies.prefill_body`: ``max_tokens=1``, ``stream=false``,
no ``min_tokens`` / ``stream_options``), so vLLM on P never sees the
client's values of those fields; only D would reject them, after P has
spent a full prefill. ``stream`` also decides how the router relays the
answer, and ``prompt`` / ``messages`` are checked so that a body without
them costs nothing. Everything else is vLLM's to validate.
"""

from __future__ import annotations

import json
from typing import AsyncIterator, Mapping

from fastapi.responses import JSONResponse

from collector.bodycap import read_capped
from frontdoor.bearer import BearerAuth, Refusal, json_body
from frontdoor.credentials import Security


class Refused(Exception):
    """A request refused before any upstream call: ``status`` (4xx), a
    message, the OpenAI error ``type`` and the offending ``param``."""

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def response(self, tid: str | None) -> JSONResponse:
        """The client's answer; ``X-Request-Id`` when a trace id exists."""
        return JSONResponse(
            {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}},
            status_code=self.status,
            headers={"X-Request-Id": tid} if tid else None,
        )


# ------------------------------------------------------------------ API key
UNAUTHORIZED = Refused(
    401, "missing or invalid token (send Authorization: Bearer <token>)", kind="authentication_error"
)
#: Routes served without the router's key: liveness (``/health`` says only ok without the read role).
OPEN_PATHS = frozenset({"/health"})
#: The receiver's path (``--collect``): the ingest role.
TRACES_PATH = "/v1/traces"


def route_role(scope: dict) -> str:
    """The credential a route needs: ``ingest`` (``POST /v1/traces``),
    ``admin`` (``/admin/*``), ``read`` (``/metrics``), else ``api`` (the
    OpenAI routes)."""
    path = scope.get("path", "")
    if path == TRACES_PATH:
        return "ingest"
    if path == "/admin" or path.startswith("/admin/"):
        return "admin"
    if path == "/metrics" or path.startswith("/metrics/"):
        return "read"
    return "api"


def _refusal_body(scope: dict, refusal: Refusal) -> tuple[bytes, bytes]:
    """401: :data:`UNAUTHORIZED`, an OpenAI-style error; 429: the front door's own JSON."""
    if refusal.status == 401:
        return b"application/json", UNAUTHORIZED.response(None).body
    return json_body(scope, refusal)


def client_auth(app, security: Security, api_key: str | None = None, backoff=None) -> BearerAuth:
    """The router's bearer check (:class:`frontdoor.bearer.BearerAuth`) in
    front of every route. Each route needs its role's credential (:func:`route_role`):

    * ``api`` (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``):
      the all-roles token (``$KVLENS_TOKEN``) or the API key; open when
      neither is set;
    * ``read`` (``/metrics``): the read token, the all-roles token or the API key;
    * ``ingest`` (``POST /v1/traces``) and ``admin`` (``/admin/split``): their
      own token or the all-roles token, **never the API key** (every OpenAI
      client has it); closed once any credential is set and theirs is not.

    With no credential at all everything passes (loopback; the bind check
    refuses beyond it). A refused request gets 401 (:data:`UNAUTHORIZED`, an
    OpenAI-style error, and ``WWW-Authenticate: Bearer``) before any route
    runs: no trace id, no span, no body read, nothing written; a client
    refused too often gets 429 (:class:`frontdoor.backoff.FailureBackoff`).
    :data:`OPEN_PATHS` pass, with :data:`frontdoor.bearer.DETAILS_SCOPE_KEY`
    set (the read role proved). Comparisons in constant time."""
    key = (api_key.encode(),) if api_key else ()
    return BearerAuth(
        app,
        security,
        exempt=OPEN_PATHS,
        body=_refusal_body,
        realm="kvlens proxy",
        role_of=route_role,
        also={"api": key, "read": key},
        open_roles=("api",),
        backoff=backoff,
    )


# --------------------------------------------------------------------- body
async def read_limited(headers: Mapping[str, str], chunks: AsyncIterator[bytes], limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit``
    bytes (:func:`~collector.bodycap.read_capped`; a
    ``Content-Length`` that is not a number is left to the cap while reading)."""
    return await read_capped(headers, chunks, limit, lambda _n: too_large(limit))


def too_large(limit: int) -> Refused:
    return Refused(413, f"request body larger than the router's limit of {limit} bytes (kvlens proxy --max-body-mb)")


def parse_object(raw: bytes) -> dict:
    """The body as a JSON object, else 400."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise Refused(400, f"invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise Refused(400, "invalid JSON body: must be a JSON object")
    return body


# ------------------------------------------------------------------- fields
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive_int(body: dict, name: str) -> None:
    v = body.get(name)
    if v is not None and not (_is_int(v) and v > 0):
        raise Refused(400, f"`{name}` must be a positive integer, got {json.dumps(v)[:40]}", name)


def check_fields(body: dict, endpoint: str) -> None:
    """400 naming the first bad field the router relies on (module docstring)."""
    for name in ("max_tokens", "max_completion_tokens"):
        _positive_int(body, name)
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise Refused(400, "`stream` must be true or false", "stream")
    mt = body.get("min_tokens")
    if mt is not None and not (_is_int(mt) and mt >= 0):
        raise Refused(400, "`min_tokens` must be an integer >= 0", "min_tokens")
    cap = body.get("max_completion_tokens") or body.get("max_tokens")
    if mt is not None and cap is not None and mt > cap:
        raise Refused(400, f"`min_tokens` ({mt}) must not exceed the maximum tokens ({cap})", "min_tokens")
    so = body.get("stream_options")
    if so is not None and (not isinstance(so, dict) or (so and not body.get("stream"))):
        raise Refused(400, "`stream_options` must be an object, and only with `stream: true`", "stream_options")
    if endpoint.endswith("chat/completions"):
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise Refused(400, "`messages` must be a non-empty list of message objects", "messages")
        return
    prompt = body.get("prompt")
    if prompt is None and body.get("prompt_embeds") is None:
        raise Refused(400, "`prompt` is required", "prompt")
    if prompt is not None and not isinstance(prompt, (str, list)):
        raise Refused(400, "`prompt` must be a string or a list", "prompt")
