"""``kvlens proxy``: an OpenAI-compatible prefill/decode router that emits the
root ``request`` span (and ``relay`` for pull / sequential push) per request.

Per request:

* trace id: a W3C ``traceparent`` from the client wins (its span id becomes
  the root span's parent); else a client ``X-Request-Id`` that already is 32
  lowercase hex; else ``uuid4().hex``. The id goes to P and D as
  ``X-Request-Id``: vLLM makes it ``cmpl-<id>-0-<8 hex>`` on each side, and
  the instrumented connector reads the trace id back out of that.
* P gets the body with ``max_tokens=1``, ``stream=false`` and
  ``kv_transfer_params={"do_remote_decode": true, ...}``.
* pull and sequential push: D gets P's returned ``kv_transfer_params``
  verbatim, after P answered. Overlapped push: D gets its request at once,
  concurrently with P, with P's identity (engine id, side-channel host/port)
  known in advance; if P fails first, D's request is cancelled.
* D's answer is streamed back; client-visible TTFT is measured here.
"""

import argparse
import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from kvlens import home as kvhome

# httpx / fastapi are imported inside functions: ``kvlens --help`` imports
# this module to build its parser and must stay fast.

logger = logging.getLogger("kvlens.proxy")

_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")

#: What vLLM's own disaggregated proxy examples send to P.
P_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass
class ProxyConfig:
    prefill_url: str
    decode_url: str
    mode: str = "push"
    dispatch: str = "overlapped"
    prefill_engine_id: str = "p0"
    prefill_side_host: str = "127.0.0.1"
    prefill_side_port: int | None = None
    prefill_tp_size: int = 1
    kvlens_home: str | None = None
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 600.0
    max_connections: int = 256
    telemetry: bool = True

    def __post_init__(self) -> None:
        self.prefill_url = self.prefill_url.rstrip("/")
        self.decode_url = self.decode_url.rstrip("/")
        if self.mode not in ("push", "pull"):
            raise ValueError(f"mode must be push or pull, got {self.mode!r}")
        if self.dispatch not in ("overlapped", "sequential"):
            raise ValueError(f"dispatch must be overlapped or sequential, got {self.dispatch!r}")
        if self.kvlens_home is None:
            self.kvlens_home = str(kvhome.home())

    @property
    def overlapped_push(self) -> bool:
        return self.mode == "push" and self.dispatch == "overlapped"


# --------------------------------------------------------------- trace ids
def trace_ids(headers) -> tuple[str, int | None]:
    """(32-hex trace id, parent span id or None) for an incoming request."""
    tp = (headers.get("traceparent") or "").strip().lower()
    m = _TRACEPARENT.match(tp)
    if m and m.group(1) != "ff" and int(m.group(2), 16) and int(m.group(3), 16):
        return m.group(2), int(m.group(3), 16)
    rid = (headers.get("x-request-id") or "").strip()
    if _HEX32.match(rid) and int(rid, 16):
        return rid, None
    return uuid.uuid4().hex, None


def p_request_id_base(endpoint: str, trace_id: str) -> str:
    """P's request id without vLLM's random suffix (what push matching uses)."""
    if endpoint.endswith("chat/completions"):
        return f"chatcmpl-{trace_id}"
    return f"cmpl-{trace_id}-0"


def prefill_body(body: dict) -> dict:
    b = dict(body)
    b["max_tokens"] = 1
    if "max_completion_tokens" in b:
        b["max_completion_tokens"] = 1
    b["stream"] = False
    b.pop("stream_options", None)
    b.pop("min_tokens", None)
    b["kv_transfer_params"] = dict(P_KV_PARAMS)
    return b


def overlapped_d_params(cfg: ProxyConfig, endpoint: str, trace_id: str) -> dict:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": cfg.prefill_engine_id,
        # P's real id carries a random suffix we cannot know; push matching on
        # P strips suffixes (get_base_request_id), and D only uses this for
        # lease heartbeats, so the base id is what fits best.
        "remote_request_id": p_request_id_base(endpoint, trace_id),
        "remote_host": cfg.prefill_side_host,
        "remote_port": cfg.prefill_side_port,
        "tp_size": cfg.prefill_tp_size,
    }


def _has_text(event: dict) -> bool:
    for ch in event.get("choices") or ():
        if not isinstance(ch, dict):
            continue
        if ch.get("text"):
            return True
        delta = ch.get("delta")
        if isinstance(delta, dict) and (delta.get("content") or delta.get("reasoning_content")):
            return True
    return False


class _SSEWatcher:
    """Finds the first SSE event with generated text in a byte stream."""

    def __init__(self) -> None:
        self.buf = b""
        self.seen = False

    def feed(self, chunk: bytes) -> bool:
        if self.seen:
            return False
        self.buf += chunk
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if not data or data == b"[DONE]":
                continue
            try:
                ev = json.loads(data)
            except ValueError:
                continue
            if isinstance(ev, dict) and _has_text(ev):
                self.seen = True
                self.buf = b""
                return True
        return False


# --------------------------------------------------------------- telemetry
class _Telemetry:
    """Wraps the recorder so that telemetry can never fail a request."""

    def __init__(self, cfg: ProxyConfig) -> None:
        self.rec = None
        self.sc = None
        self.Phase = None
        if not cfg.telemetry:
            return
        try:
            from instrumented_connector import semconv as sc
            from instrumented_connector.recorder import get_recorder

            self.rec = get_recorder(
                role="router", mode=cfg.mode, engine_id=None, config={"kvlens_home": cfg.kvlens_home}
            )
            self.sc = sc
            self.Phase = sc.Phase
        except Exception as e:  # not built yet / broken: serve without spans
            logger.warning("kvlens proxy: telemetry disabled (%s: %s)", type(e).__name__, e)
            self.rec = None

    def request(self, tid: str, parent: int | None, t0: int, t1: int, outcome: str,
                ttft_s: float | None, dispatch: str, status: int) -> None:
        if self.rec is None:
            return
        try:
            sc = self.sc
            attrs = {
                "_trace_id": int(tid, 16),
                "_parent_span_id": parent,
                sc.ATTR_DISPATCH: dispatch,
                sc.ATTR_STATUS_CODE: status,
            }
            if ttft_s is not None:
                attrs[sc.ATTR_TTFT_S] = ttft_s
            self.rec.record(self.Phase.REQUEST, tid, t0, t1, outcome, attrs)
        except Exception:
            logger.debug("request span failed", exc_info=True)

    def relay(self, tid: str, t0: int, t1: int, outcome: str = "ok") -> None:
        if self.rec is None:
            return
        try:
            self.rec.record(self.Phase.RELAY, tid, t0, t1, outcome, {"_trace_id": int(tid, 16)})
        except Exception:
            logger.debug("relay span failed", exc_info=True)

    def close(self) -> None:
        if self.rec is None:
            return
        try:
            self.rec.close()
        except Exception:
            logger.debug("recorder close failed", exc_info=True)


# ----------------------------------------------------------------- errors
class Upstream(Exception):
    """P or D failed: carries the status the client gets."""

    def __init__(self, who: str, status: int, message: str, outcome: str = "failed") -> None:
        super().__init__(message)
        self.who, self.status, self.message, self.outcome = who, status, message, outcome

    def response(self, tid: str):
        from fastapi.responses import JSONResponse

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


def _from_http_error(who: str, url: str, e: Exception) -> Upstream:
    import httpx

    if isinstance(e, httpx.TimeoutException):
        return Upstream(who, 504, f"{who} instance at {url} timed out ({type(e).__name__})", "timeout")
    return Upstream(who, 502, f"{who} instance at {url} unreachable: {type(e).__name__}: {e}")


async def _upstream_status_error(who: str, resp) -> Upstream:
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


# -------------------------------------------------------------------- app
def create_app(config: ProxyConfig):
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    cfg = config
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state["client"] = httpx.AsyncClient(
            timeout=httpx.Timeout(cfg.read_timeout_s, connect=cfg.connect_timeout_s),
            limits=httpx.Limits(
                max_connections=cfg.max_connections, max_keepalive_connections=cfg.max_connections
            ),
            trust_env=False,
        )
        state["tel"] = _Telemetry(cfg)
        try:
            yield
        finally:
            await state["client"].aclose()
            state["tel"].close()

    app = FastAPI(title="kvlens proxy", lifespan=lifespan)
    app.state.kvlens_config = cfg
    try:
        from exporters.metrics import metrics_app

        # The router's span-derived metrics (TTFT, handoff with trace-id
        # exemplars, requests by outcome) for the Prometheus users already run.
        app.mount("/metrics", metrics_app())
    except Exception:
        logger.warning("kvlens proxy: /metrics unavailable", exc_info=True)

    def client() -> httpx.AsyncClient:
        return state["client"]

    async def model_name() -> str | None:
        if "model" not in state:
            try:
                r = await client().get(cfg.decode_url + "/v1/models", timeout=10)
                state["model"] = r.json()["data"][0]["id"]
            except Exception:
                return None
        return state["model"]

    @app.get("/health")
    async def health() -> Response:
        async def one(url: str) -> str:
            try:
                r = await client().get(url + "/health", timeout=5)
                return "ok" if r.status_code == 200 else f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                return f"{type(e).__name__}"

        p, d = await asyncio.gather(one(cfg.prefill_url), one(cfg.decode_url))
        ok = p == "ok" and d == "ok"
        return JSONResponse(
            {"status": "ok" if ok else "unhealthy", "prefill": p, "decode": d,
             "mode": cfg.mode, "dispatch": cfg.dispatch if cfg.mode == "push" else "sequential"},
            status_code=200 if ok else 503,
        )

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            r = await client().get(cfg.decode_url + "/v1/models", timeout=10)
        except httpx.HTTPError as e:
            return _from_http_error("decode", cfg.decode_url, e).response("")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "/v1/chat/completions")

    async def handle(request: Request, endpoint: str) -> Response:
        t0 = time.time_ns()
        tel: _Telemetry = state["tel"]
        tid, parent = trace_ids(request.headers)
        dispatch = cfg.dispatch if cfg.mode == "push" else "sequential"

        def finish(status: int, outcome: str, ttft: float | None) -> None:
            tel.request(tid, parent, t0, time.time_ns(), outcome, ttft, dispatch, status)

        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as e:
            finish(400, "failed", None)
            return JSONResponse(
                {"error": {"message": f"invalid JSON body: {e}", "type": "invalid_request_error"}},
                status_code=400, headers={"X-Request-Id": tid},
            )
        if "model" not in body:
            name = await model_name()
            if name:
                body["model"] = name
        stream = bool(body.get("stream"))
        headers = {"X-Request-Id": tid, "Content-Type": "application/json"}
        if auth := request.headers.get("authorization"):
            headers["Authorization"] = auth
        p_url = cfg.prefill_url + endpoint
        d_url = cfg.decode_url + endpoint

        async def call_p() -> dict:
            try:
                r = await client().post(p_url, json=prefill_body(body), headers=headers)
            except httpx.HTTPError as e:
                raise _from_http_error("prefill", cfg.prefill_url, e) from e
            if r.status_code != 200:
                raise await _upstream_status_error("prefill", r)
            try:
                return r.json()
            except ValueError as e:
                raise Upstream("prefill", 502, f"prefill instance returned invalid JSON: {e}") from e

        async def open_d(d_body: dict) -> httpx.Response:
            req = client().build_request("POST", d_url, json=d_body, headers=headers)
            try:
                resp = await client().send(req, stream=True)
            except httpx.HTTPError as e:
                raise _from_http_error("decode", cfg.decode_url, e) from e
            if resp.status_code != 200:
                try:
                    raise await _upstream_status_error("decode", resp)
                finally:
                    await resp.aclose()
            return resp

        d_resp: httpx.Response | None = None
        p_task: asyncio.Task | None = None
        try:
            if cfg.overlapped_push:
                d_body = dict(body)
                d_body["kv_transfer_params"] = overlapped_d_params(cfg, endpoint, tid)
                p_task = asyncio.create_task(call_p())
                d_task = asyncio.create_task(open_d(d_body))
                # Until D has answered (headers), a P failure cancels D: D
                # would otherwise wait for a push that never comes.
                done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
                if p_task in done and p_task.exception() is not None:
                    d_task.cancel()
                    with contextlib.suppress(BaseException):
                        r = await d_task
                        await r.aclose()
                    raise p_task.exception()
                try:
                    d_resp = await d_task
                except BaseException:
                    p_task.cancel()
                    raise
                if p_task.done() and not p_task.cancelled() and p_task.exception() is not None:
                    # both finished in the same tick: P's failure still wins
                    await d_resp.aclose()
                    raise p_task.exception()
                if not stream:
                    # non-streaming D answers only at the end: P is long done
                    await _settle(p_task)
            else:
                p_json = await call_p()
                t_p = time.time_ns()
                kv = p_json.get("kv_transfer_params")
                if not isinstance(kv, dict):
                    tel.relay(tid, t_p, time.time_ns(), "failed")
                    raise Upstream(
                        "prefill", 502,
                        "prefill instance returned no kv_transfer_params "
                        "(is it started with a NIXL kv_producer kv-transfer-config?)",
                    )
                d_body = dict(body)
                d_body["kv_transfer_params"] = kv
                tel.relay(tid, t_p, time.time_ns())
                d_resp = await open_d(d_body)
        except Upstream as u:
            finish(u.status, u.outcome, None)
            return u.response(tid)
        except asyncio.CancelledError:
            if p_task is not None:
                p_task.cancel()
            finish(499, "failed", None)
            raise

        out_headers = {"X-Request-Id": tid}
        if not stream:
            try:
                content = await d_resp.aread()
            except httpx.HTTPError as e:
                u = _from_http_error("decode", cfg.decode_url, e)
                finish(u.status, u.outcome, None)
                return u.response(tid)
            finally:
                await d_resp.aclose()
            ttft = (time.time_ns() - t0) / 1e9
            finish(200, "ok", ttft)
            return Response(content, status_code=200, media_type="application/json", headers=out_headers)

        async def relay_stream() -> AsyncIterator[bytes]:
            watcher = _SSEWatcher()
            ttft = None
            status, outcome = 200, "ok"
            it = d_resp.aiter_raw().__aiter__()
            watch_p = p_task is not None and not p_task.done()
            try:
                while True:
                    if watch_p:
                        # overlapped push: D's stream is open but P may still
                        # fail; then D would wait for a push that never comes.
                        nxt = asyncio.ensure_future(it.__anext__())
                        # if the client goes away while this read is pending,
                        # closing D's stream fails it: retrieve that error
                        # instead of logging "Task exception was never retrieved"
                        nxt.add_done_callback(_retrieve)
                        done, _ = await asyncio.wait({nxt, p_task}, return_when=asyncio.FIRST_COMPLETED)
                        if p_task in done:
                            watch_p = False
                            exc = p_task.exception()
                            if exc is not None and nxt not in done:
                                nxt.cancel()
                                with contextlib.suppress(BaseException):
                                    await nxt
                                u = exc if isinstance(exc, Upstream) else Upstream(
                                    "prefill", 502, f"prefill failed: {type(exc).__name__}: {exc}")
                                status, outcome = u.status, u.outcome
                                yield _sse_error(u.message, u.status)
                                return
                        try:
                            chunk = await nxt
                        except StopAsyncIteration:
                            return
                    else:
                        try:
                            chunk = await it.__anext__()
                        except StopAsyncIteration:
                            return
                    if ttft is None and watcher.feed(chunk):
                        ttft = (time.time_ns() - t0) / 1e9
                    yield chunk
            except httpx.TimeoutException:
                status, outcome = 504, "timeout"
                yield _sse_error("decode instance timed out while streaming", 504)
            except httpx.HTTPError as e:
                status, outcome = 502, "failed"
                yield _sse_error(f"decode stream broke: {type(e).__name__}: {e}", 502)
            except (asyncio.CancelledError, GeneratorExit):
                status, outcome = 499, "failed"  # client went away
                raise
            finally:
                await d_resp.aclose()
                if p_task is not None:
                    await _settle(p_task, cancel=status != 200)
                finish(status, outcome, ttft)

        return StreamingResponse(
            relay_stream(),
            status_code=200,
            media_type=d_resp.headers.get("content-type", "text/event-stream"),
            headers=out_headers,
        )

    return app


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


async def _settle(task: asyncio.Task, cancel: bool = False) -> None:
    """Wait for a background P call, swallowing its errors (already answered)."""
    if cancel and not task.done():
        task.cancel()
    with contextlib.suppress(BaseException):
        await asyncio.wait_for(task, timeout=30)


def _sse_error(message: str, status: int) -> bytes:
    ev = {"error": {"message": message, "type": "upstream_error", "code": status}}
    return b"data: " + json.dumps(ev).encode() + b"\n\n"


# --------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", required=True, help="P's base URL, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, help="D's base URL")
    p.add_argument("--mode", choices=["push", "pull"], required=True)
    p.add_argument("--dispatch", choices=["overlapped", "sequential"], default="overlapped",
                   help="push: send D's request at once (overlapped) or after P answers")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--prefill-engine-id", default="p0", help="P's kv_transfer_config.engine_id (overlapped push)")
    p.add_argument("--prefill-side-host", default="127.0.0.1", help="P's NIXL side-channel host (overlapped push)")
    p.add_argument("--prefill-side-port", type=int, default=None,
                   help="P's VLLM_NIXL_SIDE_CHANNEL_PORT (required for overlapped push)")
    p.add_argument("--prefill-tp-size", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0, help="read timeout towards P and D, seconds")
    p.add_argument("--no-telemetry", action="store_true", help="serve without recording spans")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    if args.mode == "push" and args.dispatch == "overlapped" and not args.prefill_side_port:
        print("kvlens proxy: error: overlapped push needs --prefill-side-port "
              "(P's VLLM_NIXL_SIDE_CHANNEL_PORT)", flush=True)
        return 2
    cfg = ProxyConfig(
        prefill_url=args.prefill,
        decode_url=args.decode,
        mode=args.mode,
        dispatch=args.dispatch,
        prefill_engine_id=args.prefill_engine_id,
        prefill_side_host=args.prefill_side_host,
        prefill_side_port=args.prefill_side_port,
        prefill_tp_size=args.prefill_tp_size,
        read_timeout_s=args.timeout,
        telemetry=not args.no_telemetry,
        kvlens_home=str(kvhome.home()),
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = create_app(cfg)
    logger.info("kvlens proxy %s/%s on %s:%d -> P %s, D %s", cfg.mode, cfg.dispatch,
                args.host, args.port, cfg.prefill_url, cfg.decode_url)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                access_log=False, timeout_graceful_shutdown=5)
    return 0
