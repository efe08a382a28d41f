"""The load generator: streaming completions through a router, sent as an
open-loop Poisson process (asyncio + httpx).

Every request carries its own 32-hex ``X-Request-Id`` (a fresh trace id); the
router keeps it as the trace id, which is how a cell's traces are found in
the store afterwards. TTFT starts at the first SSE event with generated text
(:mod:`proxy.sse`), the rule the router's span TTFT uses, so the two can be
cross-checked. ``ignore_eos`` makes every request yield ``output_len`` tokens.

Tokens are timed per network read, not per event: every event of one read
gets that read's time, and the number of reads that carried text is kept
(``RequestResult.text_reads``). Tokens that reach the client together (a
starved client or router can deliver a whole answer in one read) are then
seen as such, and their TPOT is not reported (:mod:`kvlens.bench.results`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, Sequence

from kvrecord.ids import new_trace_id, trace_of_response
from kvlens.bench.results import RequestResult, Target
from proxy.sse import has_text, parse_data_line
from kvlens.stack.commands import auth_headers

logger = logging.getLogger(__name__)


#: The router header that names a request's mode (``proxy.app.MODE_HEADER``; not imported: it pulls in starlette).
MODE_HEADER = "X-Kvlens-Mode"


def mode_header(mode: str | None) -> dict[str, str]:
    """``{"X-Kvlens-Mode": mode}``, or nothing when ``mode`` is None."""
    return {MODE_HEADER: mode} if mode else {}


def forced_mode(target: Target) -> str | None:
    """The mode a target's requests name in their header (a mixed fleet's half), else None."""
    return target.mode if target.force_mode else None


def _body(prompt: str, output_len: int, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": output_len,
        "min_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    return body


async def _http_error(resp) -> str:
    """``HTTP <status>: <message>`` from an error response (its JSON error message when there is one)."""
    raw = (await resp.aread()).decode("utf-8", "replace")
    msg = raw[:300]
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        msg = json.loads(raw)["error"]["message"][:300]
    return f"HTTP {resp.status_code}: {msg}"


def _take_event(ev: dict, res: RequestResult, now: float) -> bool:
    """Apply one SSE event read at ``now`` to ``res``; True when it carried text."""
    if "error" in ev:
        err = ev["error"]
        res.error = str(err.get("message") if isinstance(err, dict) else err)[:300]
        return False
    if res.trace_id is None and isinstance(ev.get("id"), str):
        res.trace_id = trace_of_response(ev["id"], res.request_id)
    text = has_text(ev)
    if text:
        if res.ttft_s is None:
            res.ttft_s = now
        res.last_token_s = now
    usage = ev.get("usage")
    if isinstance(usage, dict):
        res.output_tokens = usage.get("completion_tokens")
        res.prompt_tokens = usage.get("prompt_tokens")
    return text


async def _read_stream(resp, res: RequestResult, t0: float) -> int:
    """Fill ``res`` from the SSE stream (TTFT, last token, reads with text,
    usage, in-stream error), timing each event by the read that completed
    it; returns the number of events that carried text."""
    n_text, buf, now, n = 0, b"", 0.0, 0
    res.text_reads = 0
    async for chunk in resp.aiter_bytes():
        now = time.perf_counter() - t0
        buf += chunk
        *lines, buf = buf.split(b"\n")
        n = sum(1 for ev in map(parse_data_line, lines) if ev is not None and _take_event(ev, res, now))
        n_text += n
        res.text_reads += 1 if n else 0
    ev = parse_data_line(buf)  # a last line without its newline: part of the last read
    if ev is not None and _take_event(ev, res, now):
        n_text += 1
        res.text_reads += 0 if n else 1
    return n_text


async def one_request(
    client,
    url: str,
    model: str | None,
    prompt: str,
    output_len: int,
    rid: str,
    api_key: str | None = None,
    mode: str | None = None,
) -> RequestResult:
    """One streaming completion through the router (``client``: an
    ``httpx.AsyncClient``; ``api_key`` sent as a bearer token; ``mode``:
    sent as ``X-Kvlens-Mode``, the half of a mixed fleet it goes to); never
    raises (except on cancellation)."""
    import httpx  # here for start-up cost: `kvlens --help` imports this module

    res = RequestResult(request_id=rid, ok=False)
    t0 = res.send_s = time.perf_counter()
    try:
        async with client.stream(
            "POST",
            url.rstrip("/") + "/v1/completions",
            json=_body(prompt, output_len, model),
            headers={"X-Request-Id": rid, **auth_headers(api_key), **mode_header(mode)},
        ) as resp:
            res.status = resp.status_code
            res.kvlens_router = resp.headers.get("x-request-id") == rid
            if resp.status_code != 200:
                res.error = await _http_error(resp)
                return res
            n_text = await _read_stream(resp, res, t0)
        res.latency_s = time.perf_counter() - t0
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
        return res
    if res.output_tokens is None:
        res.output_tokens = n_text
    if res.error is None and res.ttft_s is None:
        res.error = "stream ended without any generated text"
    res.ok = res.error is None
    return res


async def _send_all(
    client, target: Target, model: str | None, prompts: Sequence[str], gaps: Sequence[float], output_len: int, pbar
) -> list[RequestResult]:
    """Send prompt i at the sum of gaps[:i+1] seconds; cancel all on any exception."""
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Future] = []
    start, due, n_failed = loop.time(), 0.0, 0

    async def go(p: str) -> RequestResult:
        nonlocal n_failed
        r = await one_request(
            client, target.url, model, p, output_len, new_trace_id(), target.api_key, forced_mode(target)
        )
        if pbar is not None:
            if not r.ok:
                n_failed += 1
                pbar.set_postfix_str(f"failed {n_failed}", refresh=False)
            pbar.update(1)
        return r

    try:
        for p, gap in zip(prompts, gaps):
            due += gap
            delay = start + due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(go(p)))
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def run_cell_async(
    target: Target,
    model: str | None,
    prompts: Sequence[str],
    qps: float,
    output_len: int,
    rng,
    *,
    timeout_s: float = 120.0,
    pbar=None,
) -> tuple[list[RequestResult], float]:
    """Open-loop Poisson arrivals at ``qps`` (gaps drawn from ``rng``, a numpy
    Generator); returns (results in send order, seconds from first send to
    last completion). ``pbar``: an optional tqdm bar, one tick per request."""
    import httpx  # here for start-up cost

    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    gaps = [0.0] + [float(g) for g in rng.exponential(1.0 / qps, size=max(0, len(prompts) - 1))]
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits, trust_env=False
    ) as client:
        results = await _send_all(client, target, model, prompts, gaps, output_len, pbar)
    t_first = min(r.send_s for r in results)
    t_last = max(r.send_s + (r.latency_s or 0.0) for r in results)
    return results, max(t_last - t_first, 1e-9)


async def warm_up(target: Target, model: str | None, prompts: Sequence[str], timeout_s: float) -> None:
    """Send ``prompts`` one after another (2 output tokens each); a failure is logged, not raised."""
    import httpx  # here for start-up cost

    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as c:
        for p in prompts:
            r = await one_request(c, target.url, model, p, 2, new_trace_id(), target.api_key, forced_mode(target))
            if not r.ok:
                logger.warning("warm-up request to %s failed: %s", target.label, r.error)
