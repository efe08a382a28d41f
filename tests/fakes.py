"""The unit tests' fake upstreams, in one style: ``http.server`` on a free
loopback port, served by a daemon thread (:class:`LoopbackServer`), no vLLM.
The plain standard-library server is what most of them need: a fake reads
the raw request, answers byte by byte, and can hang up or wait without
answering, which the router's tests check for.

* :class:`FakeVllm`: a vLLM server, P or D, that records every request and
  answers it with a function (``p_ok``, ``d_answers``, ``d_echo``, ...);
  :class:`KeepAliveFakeVllm`: one whose pooled connections go stale.
* :class:`FakeRouter`: a P/D stack's router for ``kvlens bench``, writing one
  trace row per request through the store API.
* :class:`FakePrometheus`: the Prometheus HTTP API the dashboard queries.
* :class:`RecordingServer`: 200 to everything, keeping each request's headers.
* :class:`SilentServer`: accepts connections, reads, never answers.
* :func:`wait_for`: poll a condition until it holds or a generous timeout
  passes (an eventual check, never a speed bound).

``tests/`` is on ``sys.path``: ``from fakes import FakeVllm, p_ok``.
"""

from __future__ import annotations

import json
import select
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, urlparse

#: The trace id the canned answers name (``P_KV``'s remote request).
TID = "ab" * 16
P_KV = {  # what a real P answers: D must get exactly this in pull mode
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "p0",
    "remote_block_ids": [3, 1, 4],
    "remote_host": "127.0.0.1",
    "remote_port": 5601,
    "remote_request_id": f"cmpl-{TID}-0-1234abcd",
    "tp_size": 1,
}

Answer = Callable[[BaseHTTPRequestHandler, dict], None]


def wait_for(cond: Callable[[], Any], timeout_s: float = 10.0, step_s: float = 0.02) -> Any:
    """``cond()`` once it is true, polled every ``step_s`` for up to
    ``timeout_s``; then its last value (false: the caller's assert fails)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(step_s)
    return cond()


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that keeps the test output clean."""

    def log_message(self, *a) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        # a client hanging up mid-answer is what some tests do on purpose
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class LoopbackServer:
    """A ``ThreadingHTTPServer`` with ``handler`` on a free loopback port,
    serving from a daemon thread from construction on; :meth:`close` (or
    leaving a ``with`` block) stops it."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = _Server(("127.0.0.1", 0), handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def send_json(h: BaseHTTPRequestHandler, status: int, obj: Any) -> None:
    send_raw(h, status, json.dumps(obj).encode())


def send_raw(h: BaseHTTPRequestHandler, status: int, data: bytes, ctype: str = "application/json") -> None:
    h.send_response(status)
    h.send_header("Content-Type", ctype)
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)


def closed_port_url() -> str:
    """The URL of a loopback port nothing listens on (an upstream that is down)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed


# ------------------------------------------------------------ fake P and D
class FakeVllm(LoopbackServer):
    """A fake vLLM server (P or D) on loopback. Records every POST (path,
    headers, JSON body, arrival time) and answers it with ``answer(handler,
    body)``; ``/health`` and ``/v1/models`` answer like vLLM."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests: list[dict] = []
        self.gets: list[dict] = []  # GET path and headers
        self.api_key: str | None = None  # when set, GET /v1/models needs it (as vLLM --api-key)
        self.got_request = threading.Event()
        self.release = threading.Event()  # ends any answer that waits
        fake = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                fake.gets.append({"path": self.path, "headers": dict(self.headers)})
                if (
                    self.path == "/v1/models"
                    and fake.api_key
                    and (self.headers.get("Authorization") != f"Bearer {fake.api_key}")
                ):
                    send_json(self, 401, {"error": "Unauthorized"})
                elif self.path == "/v1/models":
                    send_json(self, 200, {"data": [{"id": "fake-model"}]})
                else:
                    send_json(self, 200, {})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(
                    {"path": self.path, "headers": dict(self.headers), "body": body, "t": time.monotonic()}
                )
                fake.got_request.set()
                fake.answer(self, body)

        super().__init__(Handler)

    def close(self) -> None:
        self.release.set()
        super().close()


class KeepAliveFakeVllm(FakeVllm):
    """A P speaking HTTP/1.1 keep-alive whose connections each answer
    ``served`` requests; the next one on the same connection is read and the
    connection closed without an answer: what a request meets when it is
    sent on a pooled connection the server is closing for idleness."""

    def __init__(self, served: int, cut: bool = False) -> None:
        super().__init__(p_ok)
        fake, base = self, self.server.RequestHandlerClass

        class Handler(base):
            protocol_version = "HTTP/1.1"
            count = 0

            def do_POST(self) -> None:
                self.count += 1
                if self.count > served:
                    self.rfile.read(int(self.headers["Content-Length"]))
                    fake.requests.append({"dropped": True})
                    self.close_connection = True
                    if cut:  # the answer begins, then the connection breaks: it was seen
                        self.send_response(200)
                        self.send_header("Content-Length", "100")
                        self.end_headers()
                        self.wfile.write(b'{"choices"')
                    return
                super().do_POST()

        self.server.RequestHandlerClass = Handler


def p_ok(h: BaseHTTPRequestHandler, body: dict) -> None:
    send_json(h, 200, {"id": "cmpl-p", "choices": [{"index": 0, "text": "A"}], "kv_transfer_params": P_KV})


def p_fails(h: BaseHTTPRequestHandler, body: dict) -> None:
    send_json(h, 500, {"error": {"message": "prefill boom", "type": "InternalServerError"}})


def p_echo_id(h: BaseHTTPRequestHandler, body: dict) -> None:
    """P whose kv_transfer_params name the request id it was sent (as vLLM's do)."""
    rid = h.headers["X-Request-Id"]
    send_json(
        h,
        200,
        {
            "choices": [{"index": 0, "text": "A"}],
            "kv_transfer_params": {**P_KV, "remote_request_id": f"cmpl-{rid}-0-1234abcd"},
        },
    )


def d_answers(h: BaseHTTPRequestHandler, body: dict) -> None:
    if not body.get("stream"):
        send_json(h, 200, {"id": "cmpl-d", "choices": [{"index": 0, "text": "hello world"}]})
        return
    h.send_response(200)  # HTTP/1.0: the body ends when the connection closes
    h.send_header("Content-Type", "text/event-stream")
    h.end_headers()
    for ev in ({"choices": [{"index": 0, "text": "hello"}]}, {"choices": [{"index": 0, "text": " world"}]}):
        h.wfile.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
        h.wfile.flush()
    h.wfile.write(b"data: [DONE]\n\n")


def d_echo(h: BaseHTTPRequestHandler, body: dict) -> None:
    """D answering with the prompt it got (so each client can check it got its own answer)."""
    send_json(h, 200, {"choices": [{"index": 0, "text": f"echo {body['prompt']}"}]})


def d_waits_for_push(fake: FakeVllm) -> Answer:
    """D that never answers (its KV never arrives) and notes when the router
    hangs up on it (``fake.hung_up``)."""
    fake_hung_up = threading.Event()
    fake.hung_up = fake_hung_up  # type: ignore[attr-defined]

    def answer(h: BaseHTTPRequestHandler, body: dict) -> None:
        if wait_for_hang_up(h, fake.release):
            fake_hung_up.set()

    return answer


def wait_for_hang_up(h: BaseHTTPRequestHandler, release: threading.Event | None = None) -> bool:
    """Block (up to 20 s, or until ``release``) until the router closes this
    connection; True when it did."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not (release and release.is_set()):
        readable, _, _ = select.select([h.connection], [], [], 0.05)
        if readable and h.connection.recv(1, socket.MSG_PEEK) == b"":
            return True
    return False


# ------------------------------------------------------- a router for the bench
class FakeRouter(LoopbackServer):
    """An OpenAI-ish streaming router that writes one ``traces`` row per
    request (trace id = X-Request-Id) like the real one does, with a known
    handoff. No vLLM: tests the bench's generator, the join and Ctrl-C.

    ``fail_every``: every n-th request is a 504 with a ``timeout`` row;
    ``on_request(n)`` true: the n-th request is held open until the fake
    closes (the bench cannot finish the cell before the test's signal has
    been handled); ``one_chunk``: the whole answer in one write;
    ``api_key``: ``/v1/models`` and ``/v1/completions`` need it."""

    HANDOFF_NS = 3_000_000
    #: what its ``/metrics`` (standing in for D's) reports per completed request
    D_TPOT_S = 0.004

    def __init__(
        self,
        store_path: Path,
        mode: str = "push",
        dispatch: str = "overlapped",
        fail_every: int = 0,
        on_request: Callable[[int], bool] | None = None,
        one_chunk: bool = False,
        token_gap_s: float = 0.002,
        api_key: str | None = None,
    ) -> None:
        from kvtrace import store

        self.store_path, self.n = store_path, 0
        self.mode, self.dispatch = mode, dispatch
        self.fail_every, self.on_request, self.api_key = fail_every, on_request, api_key
        self.one_chunk, self.token_gap_s = one_chunk, token_gap_s
        self.tpot_sum = self.tpot_count = 0.0
        self.auth_seen: list[str | None] = []
        self.modes_seen: list[str | None] = []  # each completion's X-Kvlens-Mode (None: none sent)
        self.release = threading.Event()  # ends a held request
        self._conn = store.connect(store_path)
        self._lock = threading.Lock()  # one connection, handler threads take turns
        self._closed = False
        fake = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                fake._get(self)

            def do_POST(self) -> None:
                if self.path != "/v1/completions":
                    send_json(self, 404, {"detail": "Not Found"})
                    return
                fake._complete(self, json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

        super().__init__(Handler)

    def close(self) -> None:
        self.release.set()
        super().close()
        with self._lock:  # a request still streaming writes nothing after this
            self._closed = True
            self._conn.close()

    # ------------------------------------------------------------ answers
    def _refused(self, h: BaseHTTPRequestHandler) -> bool:
        auth = h.headers.get("authorization")
        self.auth_seen.append(auth)
        if self.api_key and auth != f"Bearer {self.api_key}":
            send_json(h, 401, {"error": {"message": "Unauthorized"}})
            return True
        return False

    def _get(self, h: BaseHTTPRequestHandler) -> None:
        if h.path == "/metrics":  # D's per-request TPOT histogram, as vLLM 0.32 names it
            name = "vllm:request_time_per_output_token_seconds"
            text = (
                f"# HELP {name} x\n# TYPE {name} histogram\n"
                f'{name}_bucket{{engine="0",model_name="fake",le="+Inf"}} {self.tpot_count}\n'
                f'{name}_count{{engine="0",model_name="fake"}} {self.tpot_count}\n'
                f'{name}_sum{{engine="0",model_name="fake"}} {self.tpot_sum}\n'
            )
            send_raw(h, 200, text.encode(), "text/plain; charset=utf-8")
        elif h.path == "/health":
            send_json(h, 200, {"status": "ok", "mode": self.mode, "dispatch": self.dispatch})
        elif h.path == "/v1/models":
            if not self._refused(h):
                send_json(h, 200, {"data": [{"id": "fake", "root": "/nonexistent", "max_model_len": 1024}]})
        else:
            send_json(h, 404, {"detail": "Not Found"})

    def _write_trace(self, **cols: Any) -> None:
        """One ``traces`` row as the router's writer leaves it."""
        from kvtrace import store

        row = tuple(cols.get(c, 0 if c == "n_spans" else None) for c in store.TRACE_COLUMNS)
        with self._lock:
            if not self._closed:
                store.bulk_insert(self._conn, [], [row])

    def _complete(self, h: BaseHTTPRequestHandler, body: dict) -> None:
        t0 = time.time_ns()
        if self._refused(h):
            return
        tid = h.headers["x-request-id"]
        with self._lock:
            self.n += 1
            n = self.n
        if self.on_request and self.on_request(n):
            self.release.wait(30)  # held open; at close the connection just ends
            return
        asked = h.headers.get("x-kvlens-mode")
        self.modes_seen.append(asked)
        mode = asked or self.mode  # a mixed fleet's router: the half the request names
        if self.fail_every and n % self.fail_every == 0:
            self._write_trace(
                trace_id=tid, request_id=tid, mode=mode, outcome="timeout", start_ns=t0, end_ns=time.time_ns()
            )
            send_json(h, 504, {"error": {"message": "decode timed out"}})
            return
        time.sleep(0.01)
        ttft = (time.time_ns() - t0) / 1e9
        usage = {"completion_tokens": body["max_tokens"], "prompt_tokens": 7}
        events = [b'data: {"choices":[{"text":"x"}]}\n\n'] * body["max_tokens"] + [
            ("data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n").encode(),
            b"data: [DONE]\n\n",
        ]
        h.send_response(200)  # HTTP/1.0: the body ends when the connection closes
        h.send_header("Content-Type", "text/event-stream")
        h.end_headers()
        if self.one_chunk:  # a starved router: the whole answer in one write
            h.wfile.write(b"".join(events))
        else:
            for ev in events:
                h.wfile.write(ev)
                h.wfile.flush()
                time.sleep(self.token_gap_s)
        h.wfile.flush()
        with self._lock:
            self.tpot_sum += self.D_TPOT_S
            self.tpot_count += 1
        pf = t0 + 5_000_000
        self._write_trace(
            trace_id=tid,
            request_id=tid,
            mode=mode,
            dispatch=self.dispatch,
            outcome="ok",
            start_ns=t0,
            end_ns=time.time_ns(),
            ttft_s=ttft,
            prefill_finished_ns=pf,
            kv_ready_ns=pf + self.HANDOFF_NS,
            handoff_s=self.HANDOFF_NS / 1e9,
            handoff_err_s=0.0005,
        )


# ------------------------------------------------------------ Prometheus
class FakePrometheus(LoopbackServer):
    """The Prometheus HTTP API (``/api/v1/query``) with canned answers by
    the shape of the query: push is the faster mode. ``queries``: every
    query it was asked, in order."""

    def __init__(self) -> None:
        self.queries: list[str] = []
        fake = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                q = parse_qs(urlparse(self.path).query).get("query", [""])[0]
                fake.queries.append(q)
                body = {"status": "success", "data": {"resultType": "vector", "result": _prom_result(q)}}
                send_json(self, 200, body)

        super().__init__(Handler)


def _prom_result(q: str) -> list:
    fast = 'mode="push"' in q
    if q.startswith("histogram_quantile(0.5,") and "handoff" in q:
        return [{"metric": {}, "value": [0, "0.004" if fast else "0.009"]}]
    if q.startswith("histogram_quantile") and "handoff" in q:
        return [{"metric": {}, "value": [0, "0.02" if fast else "0.03"]}]
    if q.startswith("histogram_quantile") and "ttft" in q:
        return [{"metric": {}, "value": [0, "0.07"]}]
    if "kvlens_ttft_seconds_sum" in q:
        return [{"metric": {}, "value": [0, "0.075"]}]
    if q.startswith("time() - min(min_over_time(timestamp(kvlens_requests_total)"):
        return [{"metric": {}, "value": [0, "60"]}]  # the data is a minute old: 90 requests over 60 s
    if "by (outcome)" in q:
        return [
            {"metric": {"outcome": "ok"}, "value": [0, "88"]},
            {"metric": {"outcome": "timeout"}, "value": [0, "2"]},
        ]
    if "kvlens_telemetry_dropped_total" in q:
        return [{"metric": {}, "value": [0, "5"]}]
    if "kvlens_phase_duration_seconds" in q:
        phases = (
            [("decode", "registration.send", 0.001), ("prefill", "write.complete", 0.003)]
            if fast
            else [("decode", "read.complete", 0.006)]
        )
        return [{"metric": {"role": r, "phase": p}, "value": [0, str(v)]} for r, p, v in phases]
    if "kvlens_handoff_seconds_bucket" in q and "increase" in q:
        return [
            {"metric": {"le": le}, "value": [0, v]}
            for le, v in (("0.005", "40"), ("0.01", "80"), ("0.05", "90"), ("+Inf", "90"))
        ]
    return []


# ------------------------------------------------------- any HTTP endpoint
class RecordingServer(LoopbackServer):
    """Answers 200 ``{}`` to every GET and POST, keeping each request as
    (method, path, headers) in ``seen``."""

    def __init__(self) -> None:
        seen = self.seen = []

        class Handler(QuietHandler):
            def _ok(self) -> None:
                if self.command == "POST":
                    self.rfile.read(int(self.headers.get("Content-Length", 0)))
                seen.append((self.command, self.path, dict(self.headers)))
                send_raw(self, 200, b"{}", "application/json")

            do_GET = do_POST = _ok

        super().__init__(Handler)


class SilentServer(LoopbackServer):
    """Accepts TCP connections, reads what comes, never answers (an OTLP
    endpoint that hangs)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        stop = self._stop

        class Handler(QuietHandler):
            def handle(self) -> None:
                self.connection.settimeout(0.2)
                while not stop.is_set():
                    try:
                        if not self.connection.recv(65536):
                            return
                    except socket.timeout:
                        continue
                    except OSError:
                        return

        super().__init__(Handler)

    def close(self) -> None:
        self._stop.set()
        super().close()
