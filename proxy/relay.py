"""Handing D's answer to the client, measuring client-seen TTFT, and ending
the request's root span (:meth:`Exchange.finish`) exactly once.

TTFT: for a stream, when the first SSE event with generated text
(:class:`proxy.sse.TextTimes`) passes through the router; for a
plain answer, when D's whole body has arrived. TPOT (streams only): the
time from the first text event to the last over the tokens after the first. An answer of D the router
cannot pass on (a plain body that is not a completion object, a "stream"
that is not ``text/event-stream``, a stream that breaks in an unforeseen
way) ends as a 502 naming the decode side, with the request's
``X-Request-Id`` and its root span. Event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator

import httpx
from fastapi.responses import Response, StreamingResponse

from proxy.errors import Upstream, as_upstream, completion_problem, from_http_error, sse_error, unexpected
from proxy.exchange import Exchange, settle
from proxy.sse import TextTimes


logger = logging.getLogger("kvlens.proxy")

#: The root span's error when the client went away before its answer ended
#: (status 499, nginx's "client closed request").
CLIENT_GONE = "client disconnected"


async def whole(ex: Exchange, d_resp: httpx.Response) -> Response:
    """A non-streamed answer: D's body read in full, then returned. A
    cancellation (client gone) closes D's response and goes on."""
    try:
        content = await d_resp.aread()
    except httpx.HTTPError as e:
        u = from_http_error("decode", ex.route.decode.url, e)
        ex.finish(u.status, u.outcome, None, u.message)
        return u.response(ex.trace_id)
    finally:
        await d_resp.aclose()
    problem = completion_problem(content)
    if problem is not None:
        u = unexpected("decode", problem, content)
        ex.finish(u.status, u.outcome, None, u.message)
        return u.response(ex.trace_id)
    ex.finish(200, "ok", ex.elapsed_s())
    return Response(content, status_code=200, media_type="application/json", headers={"X-Request-Id": ex.trace_id})


class _Relayed(StreamingResponse):
    """D's stream relayed by :func:`_relay`. Whatever ends the response (the
    stream's end, the client going away even before the first byte, an ASGI
    error), leaving :meth:`__call__` closes D's stream, settles P's call and
    records the root span: a generator that never started runs no
    ``finally`` of its own."""

    def __init__(self, ex: Exchange, d_resp: httpx.Response) -> None:
        self._ex, self._d = ex, d_resp
        super().__init__(
            _relay(ex, d_resp),
            status_code=200,
            media_type=d_resp.headers.get("content-type", "text/event-stream"),
            headers={"X-Request-Id": ex.trace_id},
        )

    async def __call__(self, scope, receive, send) -> None:
        try:
            ctype = self._d.headers.get("content-type")
            if ctype is not None and not ctype.lower().startswith("text/event-stream"):
                u = unexpected("decode", f"a {ctype.split(';')[0]!r} body to a streaming request")
                self._ex.finish(u.status, u.outcome, None, u.message)
                await u.response(self._ex.trace_id)(scope, receive, send)
            else:
                await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(BaseException):
                await self.body_iterator.aclose()
            await self._d.aclose()
            if self._ex.p_task is not None:
                await settle(self._ex.p_task, cancel=True)
            self._ex.finish(499, "failed", None, CLIENT_GONE)  # no-op when _relay ended it


def streamed(ex: Exchange, d_resp: httpx.Response) -> StreamingResponse:
    """A streamed answer: D's SSE bytes passed on as they come."""
    return _Relayed(ex, d_resp)


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


class _DecodeChunks:
    """D's raw stream, chunk by chunk. While an overlapped P call is still
    running, each read also watches it: D's stream is open but would wait
    forever for a push that never comes if P fails."""

    def __init__(self, d_resp: httpx.Response, p_task: asyncio.Task | None) -> None:
        self._it = d_resp.aiter_raw().__aiter__()
        self._p = p_task
        self._watch_p = p_task is not None and not p_task.done()

    async def next(self) -> bytes | None:
        """The next chunk, None at the end; raises :class:`Upstream` when P
        failed before D sent more, httpx errors when D's stream breaks."""
        if not self._watch_p:
            try:
                return await self._it.__anext__()
            except StopAsyncIteration:
                return None
        nxt = asyncio.ensure_future(self._it.__anext__())
        # if the client goes away while this read is pending, closing D's
        # stream fails it: retrieve that error instead of logging "Task
        # exception was never retrieved"
        nxt.add_done_callback(_retrieve)
        done, _ = await asyncio.wait({nxt, self._p}, return_when=asyncio.FIRST_COMPLETED)
        if self._p in done:
            self._watch_p = False
            exc = self._p.exception()
            if exc is not None and nxt not in done:
                nxt.cancel()
                with contextlib.suppress(BaseException):
                    await nxt
                raise as_upstream(exc)
        try:
            return await nxt
        except StopAsyncIteration:
            return None


async def _relay(ex: Exchange, d_resp: httpx.Response) -> AsyncIterator[bytes]:
    watcher = TextTimes()
    ttft = None
    status, outcome, error = 200, "ok", None
    chunks = _DecodeChunks(d_resp, ex.p_task)
    try:
        while (chunk := await chunks.next()) is not None:
            if watcher.feed(chunk, ex.elapsed_s()):
                ttft = watcher.first_s
            yield chunk
    except Upstream as u:  # overlapped P failed after D's headers
        status, outcome, error = u.status, u.outcome, u.message
        yield sse_error(u.message, u.status)
    except httpx.TimeoutException:
        status, outcome, error = 504, "timeout", "decode instance timed out while streaming"
        yield sse_error(error, 504)
    except httpx.HTTPError as e:
        status, outcome, error = 502, "failed", f"decode stream broke ({type(e).__name__})"
        logger.warning("kvlens proxy: %s: decode stream broke: %s: %s", ex.trace_id, type(e).__name__, e)
        yield sse_error(error, 502)
    except Exception as e:  # not foreseen: still an error event, the status and the span
        status, outcome, error = 502, "failed", f"decode stream failed ({type(e).__name__})"
        logger.exception("kvlens proxy: %s: relaying decode's stream failed", ex.trace_id)
        yield sse_error(error, 502)
    except (asyncio.CancelledError, GeneratorExit):
        status, outcome, error = 499, "failed", CLIENT_GONE
        raise
    finally:
        await d_resp.aclose()
        if ex.p_task is not None:
            await settle(ex.p_task, cancel=status != 200)
        if status == 200:
            ex.tpot_s = watcher.tpot_s()
        ex.finish(status, outcome, ttft, error)
