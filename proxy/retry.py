"""One retry for a call to P or D that failed before the server could have
seen it (:func:`send_once_more`).

Which failures are safe to retry, and why:

* ``httpx.ConnectError``: no connection was made (refused, reset during the
  TCP handshake, no route), so not one byte of the request left the router.
* ``httpx.RemoteProtocolError`` ("server disconnected without sending a
  response"), ``httpx.ReadError`` / ``httpx.WriteError`` (connection reset)
  **on a pooled keep-alive connection**, before any response byte: vLLM's
  server (uvicorn) closes a keep-alive connection after a few idle seconds;
  when the router sends on it in that same instant, the request lands on a
  socket the server had already closed and was never read. The pool drops
  that connection, so the retry goes out on another live or a new one.

Never retried: the same errors on a connection opened for this very request
(the server accepted it, so it may have read the request and died working
on it: a second prefill with the same request id must not happen),
timeouts (the server may be working on it; retrying doubles the wait), and
anything after the response started (a body cut short). Whether the
connection was new and whether the answer began are read from httpcore's
trace events (``connection.connect_tcp.started``,
``http11.receive_response_headers.complete``).
"""

from __future__ import annotations

import logging
from typing import Callable

import httpx

logger = logging.getLogger("kvlens.proxy")

#: Errors that mean "the server never read it" when the connection was reused.
STALE_CONNECTION_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
_CONNECT_EVENTS = ("connection.connect_tcp.started", "connection.connect_unix_socket.started")


class _Attempt:
    """httpcore trace hook noting whether this attempt opened a connection
    and whether the server's answer had begun (its headers arrived)."""

    def __init__(self) -> None:
        self.new_connection = False
        self.answered = False

    async def __call__(self, event: str, info: dict) -> None:
        if event in _CONNECT_EVENTS:
            self.new_connection = True
        elif event.endswith("receive_response_headers.complete"):
            self.answered = True


def safe_to_retry(exc: BaseException, new_connection: bool, answered: bool = False) -> bool:
    """True when ``exc`` proves the request never reached the server (module docstring)."""
    if answered:
        return False
    if isinstance(exc, httpx.ConnectError):
        return True
    return isinstance(exc, STALE_CONNECTION_ERRORS) and not new_connection


async def send_once_more(
    client: httpx.AsyncClient, build: Callable[[dict], httpx.Request], stream: bool = False
) -> httpx.Response:
    """``client.send(build(extensions))``, sent a second time (on a fresh
    request object) when the first failed in a way :func:`safe_to_retry`
    allows. Raises the httpx error otherwise. Event loop only."""
    attempt = _Attempt()
    try:
        return await client.send(build({"trace": attempt}), stream=stream)
    except httpx.HTTPError as e:
        if not safe_to_retry(e, attempt.new_connection, attempt.answered):
            raise
        logger.debug("retrying once after %s: the request never reached the server", type(e).__name__)
    return await client.send(build({}), stream=stream)
