"""Getting D's response for one request, one function per mode/dispatch
(docs/phases.md describes the phases each produces):

* :func:`pull`: P first; D gets P's ``kv_transfer_params`` and pulls the KV.
* :func:`push_sequential`: P first, then D, as pull; P pushes the KV.
* :func:`push_overlapped`: D's request goes out at once, concurrently with
  P's, with the chosen P's identity known in advance; a P failure cancels D.

P and D are the ones the balancer chose for this request (``ex.route``).

Each returns D's open 200 response (body not read; the caller relays and
closes it) or raises :class:`~proxy.errors.Upstream`. Event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Awaitable, Callable

import httpx

from proxy.bodies import decode_body, overlapped_d_params
from proxy.config import ProxyConfig
from proxy.errors import unexpected
from proxy.exchange import Exchange, prompt_tokens, settle

Dispatch = Callable[[Exchange], Awaitable[httpx.Response]]


async def _prefill_then_decode(ex: Exchange) -> httpx.Response:
    """P answers; its ``kv_transfer_params`` go to D verbatim (``relay`` span)."""
    ex.tel.now()  # a reading of the loop's CPU counters as P's request goes out (RouterTelemetry.relay)
    p_json = await ex.call_prefill()
    t_p = ex.tel.now()
    ex.prompt_tokens = prompt_tokens(p_json)
    kv = p_json.get("kv_transfer_params")
    if not isinstance(kv, dict):
        ex.tel.relay(ex.trace_id, t_p, time.time_ns(), "failed", ex.mode)
        raise unexpected(
            "prefill",
            "no kv_transfer_params object (is it started with a NIXL kv_producer kv-transfer-config?)",
            repr(p_json),
        )
    d_body = decode_body(ex.body, kv)
    ex.tel.relay(ex.trace_id, t_p, time.time_ns(), mode=ex.mode)
    return await ex.open_decode(d_body)


async def pull(ex: Exchange) -> httpx.Response:
    """Pull: D reads the KV from P after P's prefill."""
    return await _prefill_then_decode(ex)


async def push_sequential(ex: Exchange) -> httpx.Response:
    """Sequential push: D registers after P answered; P writes the KV."""
    return await _prefill_then_decode(ex)


async def _cancel_decode(d_task: asyncio.Task) -> None:
    d_task.cancel()
    with contextlib.suppress(BaseException):
        r = await d_task
        await r.aclose()


async def push_overlapped(ex: Exchange) -> httpx.Response:
    """Overlapped push: P's call runs as ``ex.p_task``, still running when
    this returns for a stream (the relay watches it). Until D has answered
    (headers), a P failure cancels D: D would otherwise wait for a push that
    never comes. When this is cancelled (client gone), both calls are."""
    d_body = decode_body(ex.body, overlapped_d_params(ex.route.prefill, ex.endpoint, ex.trace_id))
    p_task = ex.p_task = asyncio.create_task(ex.call_prefill())
    d_task = asyncio.create_task(ex.open_decode(d_body))
    try:
        done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        p_task.cancel()
        await _cancel_decode(d_task)
        raise
    if p_task in done and p_task.exception() is not None:
        await _cancel_decode(d_task)
        raise p_task.exception()
    try:
        d_resp = await d_task
    except BaseException:
        p_task.cancel()
        d_task.cancel()
        raise
    if p_task.done() and not p_task.cancelled() and p_task.exception() is not None:
        # both finished in the same tick: P's failure still wins
        await d_resp.aclose()
        raise p_task.exception()
    if not ex.stream:
        # non-streaming D answers only at the end: P is long done
        try:
            await settle(p_task)
        except asyncio.CancelledError:
            await d_resp.aclose()
            raise
    return d_resp


DISPATCH: dict[tuple[str, str], Dispatch] = {
    ("pull", "sequential"): pull,
    ("push", "sequential"): push_sequential,
    ("push", "overlapped"): push_overlapped,
}


def dispatcher(cfg: ProxyConfig, mode: str | None = None) -> Dispatch:
    """The dispatch function for ``mode`` (default: the router's) as this router dispatches it."""
    mode = mode or cfg.mode
    return DISPATCH[(mode, cfg.dispatch_for(mode))]
