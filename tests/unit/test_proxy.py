"""Router (``kvlens proxy``) units: trace ids, request shaping, the SSE
first-token rule, and the app itself against fake P and D HTTP servers on
loopback (no vLLM): pull, overlapped push, P failing."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterator

import httpx
import pytest
import uvicorn

from instrumented_connector import ids
from kvlens import proxy
from kvlens.proxy import telemetry
from kvlens.sse import FirstTextWatcher

TID = "ab" * 16
P_KV = {  # what a real P answers: D must get exactly this in pull mode
    "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p0",
    "remote_block_ids": [3, 1, 4], "remote_host": "127.0.0.1", "remote_port": 5601,
    "remote_request_id": f"cmpl-{TID}-0-1234abcd", "tp_size": 1,
}


# ------------------------------------------------------------- unit: ids
def test_trace_id_from_traceparent_wins():
    tid, parent = ids.incoming_trace(
        {
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "x-request-id": "f" * 32,
        }
    )
    assert tid == "0af7651916cd43dd8448eb211c80319c"
    assert parent == 0xB7AD6B7169203331


def test_trace_id_from_hex_request_id_then_fresh():
    assert ids.incoming_trace({"x-request-id": "ab" * 16}) == ("ab" * 16, None)
    tid, parent = ids.incoming_trace({"x-request-id": "not-a-trace-id"})
    assert len(tid) == 32 and int(tid, 16) and parent is None
    bad = ids.incoming_trace({"traceparent": "00-" + "0" * 32 + "-b7ad6b7169203331-01"})
    assert bad[0] != "0" * 32


def test_prefill_body_and_overlapped_params():
    body = {"prompt": "x", "max_tokens": 50, "stream": True, "min_tokens": 3,
            "stream_options": {"include_usage": True}, "max_completion_tokens": 9}
    p = proxy.prefill_body(body)
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1 and p["stream"] is False
    assert "min_tokens" not in p and "stream_options" not in p
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    assert body["max_tokens"] == 50  # not mutated
    cfg = proxy.ProxyConfig("http://p", "http://d", prefill_side_port=5600, kvlens_home="/tmp")
    d = proxy.overlapped_d_params(cfg, "/v1/completions", "ab" * 16)
    assert d["do_remote_prefill"] is True and d["remote_engine_id"] == "p0"
    assert d["remote_port"] == 5600 and d["tp_size"] == 1
    assert d["remote_request_id"] == f"cmpl-{'ab' * 16}-0"
    assert proxy.overlapped_d_params(cfg, "/v1/chat/completions", "ab" * 16)["remote_request_id"] == (
        f"chatcmpl-{'ab' * 16}"
    )


def test_sse_watcher_finds_first_text():
    w = FirstTextWatcher()
    role_only = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    assert not w.feed(role_only)
    assert not w.feed(b'data: {"choices":[{"delta":{"cont')
    assert w.feed(b'ent":"hi"}}]}\n\n')


# ------------------------------------------------ fake P and D on loopback
class Fake:
    """A fake vLLM server (P or D) on loopback. Records every POST (path,
    headers, JSON body, arrival time) and answers it with ``answer(handler,
    body)``; ``/health`` and ``/v1/models`` answer like vLLM."""

    def __init__(self, answer: Callable[[BaseHTTPRequestHandler, dict], None]) -> None:
        self.answer = answer
        self.requests: list[dict] = []
        self.got_request = threading.Event()
        self.release = threading.Event()  # ends any answer that waits
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    send_json(self, 200, {"data": [{"id": "fake-model"}]})
                else:
                    send_json(self, 200, {})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append({"path": self.path, "headers": dict(self.headers), "body": body,
                                      "t": time.monotonic()})
                fake.got_request.set()
                fake.answer(self, body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def send_json(h: BaseHTTPRequestHandler, status: int, obj: dict) -> None:
    data = json.dumps(obj).encode()
    h.send_response(status)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)


def p_ok(h: BaseHTTPRequestHandler, body: dict) -> None:
    send_json(h, 200, {"id": "cmpl-p", "choices": [{"index": 0, "text": "A"}], "kv_transfer_params": P_KV})


def p_fails(h: BaseHTTPRequestHandler, body: dict) -> None:
    send_json(h, 500, {"error": {"message": "prefill boom", "type": "InternalServerError"}})


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


def d_waits_for_push(fake: Fake) -> Callable[[BaseHTTPRequestHandler, dict], None]:
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


class FakeRecorder:
    """Stands in for the pipeline's recorder: keeps what the router records."""

    def __init__(self) -> None:
        self.roots: list[tuple] = []
        self.spans: list[tuple] = []

    def record_root(self, trace_id, parent_span_id, t0, t1, outcome="ok", attrs=None) -> None:
        self.roots.append((trace_id, parent_span_id, t0, t1, outcome, dict(attrs or {})))

    def record(self, phase, request_id, t0, t1, outcome="ok", attrs=None) -> None:
        self.spans.append((phase, request_id, t0, t1, outcome))

    def close(self) -> None:
        pass


@pytest.fixture
def recorder(monkeypatch) -> FakeRecorder:
    rec = FakeRecorder()
    monkeypatch.setattr(telemetry, "get_recorder", lambda **kw: rec)
    return rec


@contextlib.contextmanager
def router(cfg: proxy.ProxyConfig) -> Iterator[str]:
    """The real router app served by uvicorn on a loopback port, in a thread."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(proxy.create_app(cfg), log_level="warning", lifespan="on"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert t.is_alive() and time.monotonic() < deadline, "router did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        t.join(10)
        sock.close()


@contextlib.contextmanager
def pair(p_answer, d_answer=d_answers) -> Iterator[tuple[Fake, Fake]]:
    d = Fake(lambda h, b: None)
    d.answer = d_answer(d) if d_answer is d_waits_for_push else d_answer
    p = Fake(p_answer)
    try:
        yield p, d
    finally:
        p.close()
        d.close()


def _cfg(p: Fake, d: Fake, mode: str, dispatch: str, tmp_path) -> proxy.ProxyConfig:
    return proxy.ProxyConfig(p.url, d.url, mode=mode, dispatch=dispatch, prefill_side_port=5600,
                             kvlens_home=str(tmp_path))


# ------------------------------------------------------------ router app
def test_pull_hands_p_params_to_d_verbatim(tmp_path, recorder):
    with pair(p_ok) as (p, d), router(_cfg(p, d, "pull", "sequential", tmp_path)) as url:
        r = httpx.post(url + "/v1/completions", headers={"X-Request-Id": TID}, timeout=20, trust_env=False,
                       json={"prompt": "hi", "max_tokens": 7, "stream": True})
    assert r.status_code == 200 and r.headers["x-request-id"] == TID
    assert "hello" in r.text and "[DONE]" in r.text
    (p_req,), (d_req,) = p.requests, d.requests
    assert p_req["headers"]["X-Request-Id"] == TID and d_req["headers"]["X-Request-Id"] == TID
    assert p_req["body"]["max_tokens"] == 1 and p_req["body"]["stream"] is False
    assert p_req["body"]["kv_transfer_params"] == proxy.P_KV_PARAMS
    assert d_req["body"]["kv_transfer_params"] == P_KV
    assert d_req["body"]["max_tokens"] == 7 and d_req["body"]["model"] == "fake-model"
    assert d_req["t"] >= p_req["t"]
    (root,) = recorder.roots
    assert root[0] == TID and root[1] is None and root[4] == "ok"
    assert root[5]["http.response.status_code"] == 200 and root[5]["kvlens.dispatch"] == "sequential"
    assert 0 < root[5]["kvlens.ttft_s"] < 20
    assert [(s[0].value, s[1], s[4]) for s in recorder.spans] == [("relay", TID, "ok")]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_overlapped_push_sends_d_at_once(tmp_path, recorder, stream):
    d_first = threading.Event()

    def p_after_d(h, body):  # P answers only once D has its request
        if d.got_request.wait(10):
            d_first.set()
        p_ok(h, body)

    traceparent = f"00-{TID}-b7ad6b7169203331-01"
    with pair(p_after_d) as (p, d), router(cfg := _cfg(p, d, "push", "overlapped", tmp_path)) as url:
        r = httpx.post(url + "/v1/completions", headers={"traceparent": traceparent}, timeout=20,
                       trust_env=False, json={"prompt": "hi", "max_tokens": 7, "stream": stream})
    assert r.status_code == 200 and r.headers["x-request-id"] == TID
    assert "hello" in r.text
    assert d_first.is_set(), "D got its request only after P answered"
    (d_req,) = d.requests
    assert d_req["body"]["kv_transfer_params"] == proxy.overlapped_d_params(cfg, "/v1/completions", TID)
    assert d_req["headers"]["X-Request-Id"] == TID == p.requests[0]["headers"]["X-Request-Id"]
    (root,) = recorder.roots
    assert root[:2] == (TID, 0xB7AD6B7169203331) and root[4] == "ok"
    assert root[5]["kvlens.dispatch"] == "overlapped" and not recorder.spans  # no relay in overlapped push


@pytest.mark.parametrize("mode,dispatch", [("pull", "sequential"), ("push", "overlapped")])
def test_prefill_failure_is_a_json_error(tmp_path, recorder, mode, dispatch):
    with pair(p_fails, d_waits_for_push) as (p, d), router(_cfg(p, d, mode, dispatch, tmp_path)) as url:
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", headers={"X-Request-Id": TID}, timeout=20, trust_env=False,
                       json={"prompt": "hi", "max_tokens": 7})
        took = time.monotonic() - t0
        if mode == "push":  # D had its request at once and is hung up on, not left waiting
            assert d.hung_up.wait(5)
    assert r.status_code == 500 and r.headers["x-request-id"] == TID
    err = r.json()["error"]
    assert err["upstream"] == "prefill" and err["upstream_status"] == 500 and err["trace_id"] == TID
    assert "prefill boom" in err["message"] and err["type"] == "upstream_error"
    assert took < 10
    assert len(d.requests) == (1 if mode == "push" else 0)
    (root,) = recorder.roots
    assert root[4] == "failed" and root[5]["http.response.status_code"] == 500


def test_bad_body_is_400_with_request_id(tmp_path, recorder):
    with pair(p_ok) as (p, d), router(_cfg(p, d, "pull", "sequential", tmp_path)) as url:
        r = httpx.post(url + "/v1/completions", content=b"[1, 2]", headers={"X-Request-Id": TID},
                       timeout=20, trust_env=False)
    assert r.status_code == 400 and r.headers["x-request-id"] == TID
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert not p.requests and not d.requests
    assert recorder.roots[0][4] == "failed" and recorder.roots[0][5]["http.response.status_code"] == 400


def test_overlapped_prefill_failure_mid_stream_ends_with_sse_error(tmp_path, recorder):
    """D has answered 200 (headers) and waits for the push; P then fails: the
    stream ends with an error event and D is hung up on."""
    hung_up = threading.Event()

    def d_headers_then_wait(h, body):
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.end_headers()
        h.wfile.flush()
        if wait_for_hang_up(h):
            hung_up.set()

    def p_fails_later(h, body):
        d.got_request.wait(10)
        time.sleep(0.3)  # D's headers reach the router first
        p_fails(h, body)

    with pair(p_fails_later, d_headers_then_wait) as (p, d), router(_cfg(p, d, "push", "overlapped", tmp_path)) as url:
        r = httpx.post(url + "/v1/completions", headers={"X-Request-Id": TID}, timeout=20, trust_env=False,
                       json={"prompt": "hi", "max_tokens": 7, "stream": True})
        assert hung_up.wait(5)
    assert r.status_code == 200 and r.headers["x-request-id"] == TID
    ev = json.loads(r.text.strip().removeprefix("data: "))
    assert ev["error"]["code"] == 500 and "prefill boom" in ev["error"]["message"]
    (root,) = recorder.roots
    assert root[4] == "failed" and root[5]["http.response.status_code"] == 500
    assert "kvlens.ttft_s" not in root[5]
