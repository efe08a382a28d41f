"""Router (``kvlens proxy``) units: trace ids, request shaping, the SSE
first-token rule, and the app itself against fake P and D HTTP servers on
loopback (no vLLM): pull, overlapped push, P failing; and the hardening of
issue 12: one trace id per request, ``traceparent`` to P and D, the body
limit, field checks before the prefill, client disconnects, one retry on a
stale pooled connection, the API key."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from typing import Iterator

import httpx
import pytest
from opentelemetry.trace import format_span_id

from kvrecord import ids
from proxy.app import create_app
from proxy.bodies import P_KV_PARAMS, overlapped_d_params, prefill_body
from proxy.config import ProxyConfig
from proxy import telemetry
from proxy.sse import TextTimes
from uvicorn_thread import serve
from fakes import (
    P_KV,
    TID,
    FakeVllm,
    KeepAliveFakeVllm,
    closed_port_url,
    d_answers,
    d_echo,
    d_waits_for_push,
    p_echo_id,
    p_fails,
    p_ok,
    send_raw,
    wait_for_hang_up,
)


# ------------------------------------------------------------- unit: ids
def test_trace_id_from_traceparent_wins():
    tid, parent = ids.incoming_trace(
        {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "x-request-id": "f" * 32}
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
    body = {
        "prompt": "x",
        "max_tokens": 50,
        "stream": True,
        "min_tokens": 3,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 9,
    }
    p = prefill_body(body)
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1 and p["stream"] is False
    assert "min_tokens" not in p and "stream_options" not in p
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    assert body["max_tokens"] == 50  # not mutated
    cfg = ProxyConfig("http://p", "http://d", prefill_side_port=5600, kvlens_home="/tmp")
    d = overlapped_d_params(cfg, "/v1/completions", "ab" * 16)
    assert d["do_remote_prefill"] is True and d["remote_engine_id"] == "p0"
    assert d["remote_port"] == 5600 and d["tp_size"] == 1
    assert d["remote_request_id"] == f"cmpl-{'ab' * 16}-0"
    assert overlapped_d_params(cfg, "/v1/chat/completions", "ab" * 16)["remote_request_id"] == (f"chatcmpl-{'ab' * 16}")


def test_sse_first_text_across_chunks():
    """The router's rule (``TextTimes``): a role-only delta is no token; the
    first text event counts on the chunk that completes it, and only once."""
    w = TextTimes()
    role_only = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    assert not w.feed(role_only, 1.0)
    assert not w.feed(b'data: {"choices":[{"delta":{"cont', 2.0)
    assert w.feed(b'ent":"hi"}}]}\n\n', 3.0)
    assert not w.feed(b'data: {"choices":[{"delta":{"content":"!"}}]}\n\n', 4.0)
    assert (w.first_s, w.last_s, w.events) == (3.0, 4.0, 2)


# ------------------- the real router between fake P and D (tests/fakes.py)
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
def router(cfg: ProxyConfig) -> Iterator[str]:
    """The real router app served by uvicorn on a loopback port, in a thread."""
    with serve(create_app(cfg)) as url:
        yield url


@contextlib.contextmanager
def pair(p_answer, d_answer=d_answers) -> Iterator[tuple[FakeVllm, FakeVllm]]:
    d = FakeVllm(lambda h, b: None)
    d.answer = d_answer(d) if d_answer is d_waits_for_push else d_answer
    p = FakeVllm(p_answer)
    try:
        yield p, d
    finally:
        p.close()
        d.close()


def _cfg(p: FakeVllm, d: FakeVllm, mode: str, dispatch: str, tmp_path) -> ProxyConfig:
    return ProxyConfig(p.url, d.url, mode=mode, dispatch=dispatch, prefill_side_port=5600, kvlens_home=str(tmp_path))


# ------------------------------------------------------------ router app
def test_pull_hands_p_params_to_d_verbatim(tmp_path, recorder):
    with pair(p_ok) as (p, d), router(_cfg(p, d, "pull", "sequential", tmp_path)) as url:
        r = httpx.post(
            url + "/v1/completions",
            headers={"X-Request-Id": TID},
            timeout=20,
            trust_env=False,
            json={"prompt": "hi", "max_tokens": 7, "stream": True},
        )
    assert r.status_code == 200 and r.headers["x-request-id"] == TID
    assert "hello" in r.text and "[DONE]" in r.text
    (p_req,), (d_req,) = p.requests, d.requests
    assert p_req["headers"]["X-Request-Id"] == TID and d_req["headers"]["X-Request-Id"] == TID
    assert p_req["body"]["max_tokens"] == 1 and p_req["body"]["stream"] is False
    assert p_req["body"]["kv_transfer_params"] == P_KV_PARAMS
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
        r = httpx.post(
            url + "/v1/completions",
            headers={"traceparent": traceparent},
            timeout=20,
            trust_env=False,
            json={"prompt": "hi", "max_tokens": 7, "stream": stream},
        )
    assert r.status_code == 200 and r.headers["x-request-id"] == TID
    assert "hello" in r.text
    assert d_first.is_set(), "D got its request only after P answered"
    (d_req,) = d.requests
    assert d_req["body"]["kv_transfer_params"] == overlapped_d_params(cfg, "/v1/completions", TID)
    assert d_req["headers"]["X-Request-Id"] == TID == p.requests[0]["headers"]["X-Request-Id"]
    (root,) = recorder.roots
    assert root[:2] == (TID, 0xB7AD6B7169203331) and root[4] == "ok"
    assert root[5]["kvlens.dispatch"] == "overlapped" and not recorder.spans  # no relay in overlapped push


@pytest.mark.parametrize("mode,dispatch", [("pull", "sequential"), ("push", "overlapped")])
def test_prefill_failure_is_a_json_error(tmp_path, recorder, mode, dispatch):
    with pair(p_fails, d_waits_for_push) as (p, d), router(_cfg(p, d, mode, dispatch, tmp_path)) as url:
        t0 = time.monotonic()
        r = httpx.post(
            url + "/v1/completions",
            headers={"X-Request-Id": TID},
            timeout=20,
            trust_env=False,
            json={"prompt": "hi", "max_tokens": 7},
        )
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
        r = httpx.post(
            url + "/v1/completions",
            content=b"[1, 2]",
            headers={"X-Request-Id": TID, "Content-Type": "application/json"},
            timeout=20,
            trust_env=False,
        )
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
        r = httpx.post(
            url + "/v1/completions",
            headers={"X-Request-Id": TID},
            timeout=20,
            trust_env=False,
            json={"prompt": "hi", "max_tokens": 7, "stream": True},
        )
        assert hung_up.wait(5)
    assert r.status_code == 200 and r.headers["x-request-id"] == TID
    ev = json.loads(r.text.strip().removeprefix("data: "))
    assert ev["error"]["code"] == 500 and "prefill boom" in ev["error"]["message"]
    (root,) = recorder.roots
    assert root[4] == "failed" and root[5]["http.response.status_code"] == 500
    assert "kvlens.ttft_s" not in root[5]


# ------------------------------------------------- issue 12: isolation
def _post(
    url: str, body: dict, headers: dict | None = None, path: str = "/v1/completions", timeout: float = 20
) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers or {}, timeout=timeout, trust_env=False)


@pytest.mark.parametrize(
    "mode,dispatch,how", [("pull", "sequential", "x-request-id"), ("push", "overlapped", "traceparent")]
)
def test_concurrent_requests_with_one_client_id_get_distinct_ids(tmp_path, recorder, mode, dispatch, how):
    """Two requests in flight at once with the same client id: P and D see
    two different request ids (never one shared vLLM request id / KV), each
    client gets its own answer and the id actually used."""
    both_at_p = threading.Barrier(2, timeout=10)

    def p_waits_for_both(h, body):
        both_at_p.wait()  # BrokenBarrierError (a 500) unless both are at P at once
        p_echo_id(h, body)

    hdr = {"X-Request-Id": TID} if how == "x-request-id" else {"traceparent": f"00-{TID}-b7ad6b7169203331-01"}
    with pair(p_waits_for_both, d_echo) as (p, d), router(cfg := _cfg(p, d, mode, dispatch, tmp_path)) as url:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            rs = list(pool.map(lambda prompt: _post(url, {"prompt": prompt, "max_tokens": 3}, hdr), ["one", "two"]))
    assert [r.status_code for r in rs] == [200, 200]
    assert [r.json()["choices"][0]["text"] for r in rs] == ["echo one", "echo two"]
    used = [r.headers["x-request-id"] for r in rs]
    assert len(set(used)) == 2 and TID in used
    p_ids = {req["body"]["prompt"]: req["headers"]["X-Request-Id"] for req in p.requests}
    d_ids = {req["body"]["prompt"]: req["headers"]["X-Request-Id"] for req in d.requests}
    assert p_ids == d_ids == {"one": used[0], "two": used[1]}
    remote = {req["body"]["kv_transfer_params"]["remote_request_id"] for req in d.requests}
    assert len(remote) == 2
    if mode == "push":
        assert remote == {overlapped_d_params(cfg, "/v1/completions", u)["remote_request_id"] for u in used}
    roots = {r[0]: r for r in recorder.roots}
    assert set(roots) == set(used)
    fresh = next(u for u in used if u != TID)
    assert roots[TID][1] == (0xB7AD6B7169203331 if how == "traceparent" else None)
    assert roots[fresh][1] is None  # the client's parent span belongs to another trace
    key = "kvlens.client.request_id" if how == "x-request-id" else "kvlens.client.trace_id"
    assert roots[fresh][5][key] == TID and key not in roots[TID][5]


def test_client_id_reused_after_the_request_ended_is_not_reused(tmp_path, recorder):
    """P may still hold an ended request's KV (push waiting for registration,
    lease): an id is not given out again within the reuse window."""
    with pair(p_echo_id, d_echo) as (p, d), router(_cfg(p, d, "pull", "sequential", tmp_path)) as url:
        first = _post(url, {"prompt": "a", "max_tokens": 3}, {"X-Request-Id": TID})
        second = _post(url, {"prompt": "b", "max_tokens": 3}, {"X-Request-Id": TID})
        _post(url, {"prompt": "c", "max_tokens": 3}, {"X-Request-Id": "my-own-id-7"})
    assert first.headers["x-request-id"] == TID and second.headers["x-request-id"] != TID
    assert len({req["headers"]["X-Request-Id"] for req in p.requests}) == 3
    assert recorder.roots[2][5]["kvlens.client.request_id"] == "my-own-id-7"


def test_trace_ids_registry_window():
    from proxy.isolation import TraceIds

    reg = TraceIds(reuse_window_s=0.2)
    tid, parent, attrs = reg.claim({"x-request-id": TID})
    assert (tid, parent, attrs) == (TID, None, {})
    assert reg.claim({"x-request-id": TID})[0] != TID  # in flight
    reg.release(TID)
    assert reg.taken(TID)
    time.sleep(0.3)
    # after the window P's KV is safe, but the trace TID exists: a fresh id still (issue 42)
    tid, parent, attrs = reg.claim({"x-request-id": TID})
    assert tid != TID and attrs == {"kvlens.client.request_id": TID}
    # without the filter of used ids: the window's exact set alone, which forgets the oldest first
    small = TraceIds(reuse_window_s=60, max_remembered=2, used_bits=0)
    for t in ("1" * 32, "2" * 32, "3" * 32):
        small.claim({"x-request-id": t})
        small.release(t)
    assert not small.taken("1" * 32) and small.taken("3" * 32)
    # with it (the default), nothing used is ever forgotten, in a fixed 4 MiB
    kept = TraceIds(reuse_window_s=0.0, max_remembered=2)
    ids = [f"{i:032x}" for i in range(1, 5001)]
    for t in ids:
        kept.claim({"x-request-id": t})
        kept.release(t)
    assert all(kept.taken(t) for t in ids) and len(kept.used._field) == 4 << 20


def test_used_ids_filter_is_a_bloom_filter_with_few_false_positives():
    from proxy.isolation import UsedIds

    used = UsedIds(bits=1 << 20)
    mine = [f"{i:032x}" for i in range(1, 20_001)]
    for t in mine:
        used.add(t)
    assert all(t in used for t in mine)  # never a false negative
    others = [f"{i:032x}" for i in range(10**9, 10**9 + 20_000)]
    false_positive = sum(t in used for t in others) / len(others)
    assert false_positive < 0.01  # 20k ids in 2**20 bits, 4 hashes: ~0.25 % expected


def test_a_client_id_reused_after_the_window_does_not_join_the_old_trace(tmp_path, recorder):
    """P's KV is safe after the reuse window, but the old request's trace
    still exists: the same client id gets a fresh trace id again."""
    with pair(p_echo_id, d_echo) as (p, d):
        cfg = dataclasses.replace(_cfg(p, d, "pull", "sequential", tmp_path), reuse_window_s=0.1)
        with router(cfg) as url:
            first = _post(url, {"prompt": "a", "max_tokens": 3}, {"X-Request-Id": TID})
            time.sleep(0.3)  # past the window
            later = _post(url, {"prompt": "b", "max_tokens": 3}, {"X-Request-Id": TID})
    assert first.headers["x-request-id"] == TID and later.headers["x-request-id"] != TID
    assert [req["headers"]["X-Request-Id"] for req in p.requests] == [TID, later.headers["x-request-id"]]
    roots = {r[0]: r for r in recorder.roots}
    assert set(roots) == {TID, later.headers["x-request-id"]}  # two traces, not one with two roots
    assert roots[later.headers["x-request-id"]][5]["kvlens.client.request_id"] == TID


# ------------------------------------------------ issue 12: traceparent
def test_traceparent_of_the_root_span_reaches_p_and_d(tmp_path, recorder):
    with pair(p_ok) as (p, d), router(_cfg(p, d, "push", "overlapped", tmp_path)) as url:
        r = _post(url, {"prompt": "hi", "max_tokens": 3}, {"X-Request-Id": TID})
    assert r.status_code == 200
    want = f"00-{TID}-{format_span_id(ids.root_span_id(int(TID, 16)))}-01"
    assert p.requests[0]["headers"]["traceparent"] == want == d.requests[0]["headers"]["traceparent"]
    assert ids.parse_traceparent(want) == (TID, ids.root_span_id(int(TID, 16)))


# --------------------------------------------- issue 12: what is refused
def test_body_over_the_limit_is_413_before_any_upstream_call(tmp_path, recorder):
    big = json.dumps({"prompt": "x" * 5000, "max_tokens": 3}).encode()

    def chunked():
        for i in range(0, len(big), 500):
            yield big[i : i + 500]

    with pair(p_ok) as (p, d):
        cfg = _cfg(p, d, "pull", "sequential", tmp_path)
        cfg.max_body_bytes = 2000
        with router(cfg) as url:
            json_type = {"Content-Type": "application/json"}
            declared = httpx.post(
                url + "/v1/completions", content=big, headers={"X-Request-Id": TID, **json_type}, timeout=20,
                trust_env=False,
            )  # fmt: skip
            streamed = httpx.post(
                url + "/v1/completions", content=chunked(), headers=json_type, timeout=20, trust_env=False
            )
            ok = _post(url, {"prompt": "x" * 100, "max_tokens": 3})
    for r in (declared, streamed):
        assert r.status_code == 413 and r.headers["x-request-id"]
        err = r.json()["error"]
        assert err["code"] == 413 and "2000 bytes" in err["message"] and err["type"] == "invalid_request_error"
    assert declared.headers["x-request-id"] == TID
    assert ok.status_code == 200 and len(p.requests) == 1 and len(d.requests) == 1
    assert [r[5]["http.response.status_code"] for r in recorder.roots] == [413, 413, 200]


@pytest.mark.parametrize(
    "body,field",
    [
        ({"prompt": "hi", "max_tokens": -5}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": "abc"}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_completion_tokens": -1}, "max_completion_tokens"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": "hi", "min_tokens": -1}, "min_tokens"),
        ({"prompt": "hi", "max_tokens": 3, "min_tokens": 9}, "min_tokens"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": {"text": "hi"}}, "prompt"),
    ],
)
def test_bad_fields_are_400_naming_the_field_without_a_prefill(tmp_path, recorder, body, field):
    with pair(p_ok) as (p, d), router(_cfg(p, d, "push", "overlapped", tmp_path)) as url:
        r = _post(url, body, {"X-Request-Id": TID})
    assert r.status_code == 400 and r.headers["x-request-id"] == TID
    err = r.json()["error"]
    assert err["param"] == field and f"`{field}`" in err["message"]
    assert not p.requests and not d.requests and not [g for g in d.gets if g["path"] == "/v1/models"]
    assert recorder.roots[0][4] == "failed" and recorder.roots[0][5]["kvlens.error"] == err["message"]


@pytest.mark.parametrize("body", [{"messages": []}, {"messages": "hi"}, {"messages": ["hi"]}, {"prompt": "hi"}])
def test_chat_needs_a_list_of_messages(tmp_path, recorder, body):
    with pair(p_ok) as (p, d), router(_cfg(p, d, "pull", "sequential", tmp_path)) as url:
        r = _post(url, body, path="/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages" and not p.requests


def test_valid_edge_values_pass(tmp_path, recorder):
    with pair(p_ok) as (p, d), router(_cfg(p, d, "pull", "sequential", tmp_path)) as url:
        rs = [
            _post(url, {"prompt": [1, 2, 3], "max_tokens": None, "stream": None, "min_tokens": 0}),
            _post(
                url,
                {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4},
                path="/v1/chat/completions",
            ),
        ]
    assert [r.status_code for r in rs] == [200, 200] and len(p.requests) == 2


# ------------------------------------------- issue 12: client went away
def _hangs_up_noted(noted: threading.Event):
    def answer(h, body):
        if wait_for_hang_up(h):
            noted.set()

    return answer


def _root_when_recorded(recorder: FakeRecorder, n: int = 1) -> tuple:
    deadline = time.monotonic() + 10
    while len(recorder.roots) < n:
        assert time.monotonic() < deadline, "no root span recorded"
        time.sleep(0.02)
    return recorder.roots[n - 1]


@pytest.mark.parametrize(
    "mode,dispatch,waiting", [("pull", "sequential", "P"), ("pull", "sequential", "D"), ("push", "overlapped", "both")]
)
def test_non_streaming_client_disconnect_cancels_p_and_d(tmp_path, recorder, mode, dispatch, waiting):
    p_gone, d_gone = threading.Event(), threading.Event()
    p_answer = _hangs_up_noted(p_gone) if waiting in ("P", "both") else p_ok
    d_answer = _hangs_up_noted(d_gone) if waiting in ("D", "both") else d_answers
    with pair(p_answer, d_answer) as (p, d), router(_cfg(p, d, mode, dispatch, tmp_path)) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                url + "/v1/completions",
                json={"prompt": "hi", "max_tokens": 3},
                headers={"X-Request-Id": TID},
                timeout=httpx.Timeout(20, read=0.5),
                trust_env=False,
            )
        if waiting in ("P", "both"):
            assert p_gone.wait(10), "the router kept P's call open after the client left"
        if waiting in ("D", "both"):
            assert d_gone.wait(10), "the router kept D's call open after the client left"
        root = _root_when_recorded(recorder)
    assert root[0] == TID and root[4] == "failed"
    assert root[5]["http.response.status_code"] == 499 and root[5]["kvlens.error"] == "client disconnected"


def test_streaming_client_disconnect_cancels_d(tmp_path, recorder):
    d_gone = threading.Event()

    def d_one_event_then_wait(h, body):
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.end_headers()
        h.wfile.write(b'data: {"choices":[{"index":0,"text":"hello"}]}\n\n')
        h.wfile.flush()
        if wait_for_hang_up(h):
            d_gone.set()

    with pair(p_ok, d_one_event_then_wait) as (p, d), router(_cfg(p, d, "pull", "sequential", tmp_path)) as url:
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            json={"prompt": "hi", "max_tokens": 3, "stream": True},
            headers={"X-Request-Id": TID},
            timeout=20,
            trust_env=False,
        ) as r:
            assert b"hello" in next(r.iter_raw())
        assert d_gone.wait(10)
        root = _root_when_recorded(recorder)
    assert root[4] == "failed" and root[5]["http.response.status_code"] == 499
    assert root[5]["kvlens.error"] == "client disconnected" and 0 < root[5]["kvlens.ttft_s"] < 20


# ---------------------------------------- issue 12: stale pooled connection
@pytest.mark.parametrize(
    "served,expect,cut",
    [(1, 200, False), (0, 502, False), (1, 502, True)],
    ids=["pooled-retried", "fresh-not-retried", "answer-cut-not-retried"],
)
def test_retry_only_on_a_stale_pooled_connection(tmp_path, recorder, served, expect, cut):
    p, d = KeepAliveFakeVllm(served, cut), FakeVllm(d_answers)
    try:
        with router(_cfg(p, d, "pull", "sequential", tmp_path)) as url:
            first = _post(url, {"prompt": "a", "max_tokens": 3})
            second = _post(url, {"prompt": "b", "max_tokens": 3})
    finally:
        p.close()
        d.close()
    if cut:  # 2nd: P began answering on the pooled connection, then broke: no second prefill
        assert (first.status_code, second.status_code) == (200, expect)
        assert [("dropped" in r) for r in p.requests] == [False, True]
    elif served:  # 1st ok; 2nd dropped on the pooled connection, then answered on a new one
        assert (first.status_code, second.status_code) == (200, 200)
        assert [("dropped" in r) for r in p.requests] == [False, True, False]
    else:  # dropped on a connection opened for it: the server may have seen it, no retry
        assert (first.status_code, second.status_code) == (expect, expect)
        assert len(p.requests) == 2 and all("dropped" in r for r in p.requests)
        assert first.json()["error"]["upstream"] == "prefill"


def test_retry_rule():
    from proxy.retry import safe_to_retry

    req = httpx.Request("POST", "http://p/v1/completions")
    assert safe_to_retry(httpx.ConnectError("refused", request=req), new_connection=True)
    for exc in (httpx.RemoteProtocolError("gone", request=req), httpx.ReadError("reset", request=req)):
        assert safe_to_retry(exc, new_connection=False) and not safe_to_retry(exc, new_connection=True)
    for exc in (httpx.ReadTimeout("slow", request=req), httpx.ConnectTimeout("slow", request=req)):
        assert not safe_to_retry(exc, new_connection=False)
    # the answer had begun (a body cut short): the server saw the request
    assert not safe_to_retry(httpx.ReadError("reset", request=req), new_connection=False, answered=True)


# ------------------------------------------------------- issue 12: API key
def test_without_router_key_the_clients_authorization_reaches_every_call(tmp_path, recorder):
    with pair(p_ok) as (p, d), router(_cfg(p, d, "pull", "sequential", tmp_path)) as url:
        d.api_key = "sk-d"
        auth = {"Authorization": "Bearer sk-d"}
        models = httpx.get(url + "/v1/models", headers=auth, timeout=20, trust_env=False)
        denied = httpx.get(url + "/v1/models", timeout=20, trust_env=False)
        r = _post(url, {"prompt": "hi", "max_tokens": 3}, auth)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "fake-model"
    assert denied.status_code == 401  # D's own answer, passed on
    assert r.status_code == 200 and d.requests[0]["body"]["model"] == "fake-model"
    assert p.requests[0]["headers"]["Authorization"] == d.requests[0]["headers"]["Authorization"] == "Bearer sk-d"


def test_router_key_is_required_and_sent_upstream(tmp_path, recorder):
    with pair(p_ok) as (p, d):
        d.api_key = "sk-1"
        cfg = _cfg(p, d, "pull", "sequential", tmp_path)
        cfg.api_key = "sk-1"
        with router(cfg) as url:
            body = {"prompt": "hi", "max_tokens": 3}
            refused = [
                _post(url, body),
                _post(url, body, {"Authorization": "Bearer nope"}),
                httpx.get(url + "/v1/models", timeout=20, trust_env=False),
            ]
            ok = _post(url, body, {"Authorization": "Bearer sk-1"})
            models = httpx.get(
                url + "/v1/models", headers={"Authorization": "Bearer sk-1"}, timeout=20, trust_env=False
            )
            health = httpx.get(url + "/health", timeout=20, trust_env=False)
            refused.append(httpx.get(url + "/metrics", timeout=20, trust_env=False))  # the key guards it too
            metrics = httpx.get(
                url + "/metrics/", headers={"Authorization": "Bearer sk-1"}, timeout=20, trust_env=False
            )
    assert [r.status_code for r in refused] == [401, 401, 401, 401] and metrics.status_code == 200
    assert refused[0].json()["error"]["type"] == "authentication_error"
    assert ok.status_code == 200 and models.status_code == 200 and health.status_code == 200
    assert len(p.requests) == 1 and p.requests[0]["headers"]["Authorization"] == "Bearer sk-1"
    assert len(recorder.roots) == 1  # refused requests cost no span


def test_open_host_without_key_warns_once(caplog):
    from proxy.cli import warn_if_open

    with caplog.at_level("WARNING", logger="proxy"):
        assert warn_if_open("0.0.0.0", None, collect=True)  # --insecure
        assert not warn_if_open("0.0.0.0", "sk") and not warn_if_open("127.0.0.1", None)
        assert not warn_if_open("localhost", None) and not warn_if_open("::1", None)
    (msg,) = [r.getMessage() for r in caplog.records if "with no token" in r.getMessage()]
    assert "write spans" in msg


def test_api_key_from_flag_then_env(monkeypatch):
    import argparse

    from proxy import cli

    monkeypatch.delenv("KVLENS_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert cli.api_key(argparse.Namespace(api_key=None)) == "from-vllm"
    monkeypatch.setenv("KVLENS_API_KEY", "from-kvlens")
    assert cli.api_key(argparse.Namespace(api_key=None)) == "from-kvlens"
    assert cli.api_key(argparse.Namespace(api_key="flag")) == "flag"


# -------------------------- issue 12: errors name the side, never a URL
@pytest.mark.parametrize("dead", ["prefill", "decode"])
def test_unreachable_side_is_named_without_its_url(tmp_path, recorder, caplog, dead):
    dead_url = closed_port_url()
    with pair(p_ok) as (p, d):
        cfg = _cfg(p, d, "pull", "sequential", tmp_path)
        if dead == "prefill":
            cfg.prefill_url = dead_url
        else:
            cfg.decode_url = dead_url
        with caplog.at_level("WARNING", logger="proxy"), router(cfg) as url:
            r = _post(url, {"prompt": "hi", "max_tokens": 3}, {"X-Request-Id": TID})
            models = httpx.get(url + "/v1/models", timeout=20, trust_env=False) if dead == "decode" else None
    assert r.status_code == 502 and r.headers["x-request-id"] == TID
    err = r.json()["error"]
    assert err["upstream"] == dead and err["message"] == f"{dead} instance unreachable (ConnectError)"
    port = dead_url.rsplit(":", 1)[1]
    for body in (r.text, models.text if models is not None else ""):
        assert "127.0.0.1" not in body and port not in body
    if models is not None:
        assert models.status_code == 502 and models.json()["error"]["upstream"] == "decode"
    assert any(dead_url in rec.getMessage() for rec in caplog.records), "the URL belongs in the router's log"
    (root,) = recorder.roots
    assert root[4] == "failed" and root[5]["http.response.status_code"] == 502
    assert dead_url not in root[5]["kvlens.error"]


def test_transport_error_messages():
    from proxy.errors import as_upstream, from_http_error

    req = httpx.Request("POST", "http://10.1.2.3:8100/v1/completions")
    t = from_http_error("decode", "http://10.1.2.3:8100", httpx.ReadTimeout("read timed out at 10.1.2.3", request=req))
    assert (t.status, t.outcome, t.message) == (504, "timeout", "decode instance timed out (ReadTimeout)")
    u = as_upstream(RuntimeError("boom at http://10.1.2.3:8100"))
    assert (u.who, u.status, u.message) == ("prefill", 502, "prefill failed (RuntimeError)")


def _answers(data: bytes, ctype: str = "application/json"):
    return lambda h, body: send_raw(h, 200, data, ctype)


@pytest.mark.parametrize(
    "mode,dispatch,p_answer,d_answer,stream,side,words",
    [
        (
            "pull",
            "sequential",
            _answers(b"<html>oops</html>", "text/html"),
            d_answers,
            False,
            "prefill",
            "a body that is not JSON",
        ),
        ("pull", "sequential", _answers(b"[1, 2]"), d_answers, True, "prefill", "JSON that is not an object (list)"),
        ("push", "overlapped", _answers(b"[1, 2]"), d_waits_for_push, False, "prefill", "JSON that is not an object"),
        (
            "push",
            "sequential",
            _answers(b'{"id": "x", "choices": []}'),
            d_answers,
            False,
            "prefill",
            "no kv_transfer_params",
        ),
        (
            "pull",
            "sequential",
            p_ok,
            _answers(b"not json at all", "text/plain"),
            False,
            "decode",
            "a body that is not JSON",
        ),
        ("pull", "sequential", p_ok, _answers(b'{"id": "x"}'), False, "decode", "JSON without a `choices` list"),
        ("pull", "sequential", p_ok, _answers(b'"a string"'), False, "decode", "JSON that is not an object (str)"),
        (
            "pull",
            "sequential",
            p_ok,
            _answers(b'{"choices": [{"text": "x"}]}'),
            True,
            "decode",
            "a 'application/json' body to a streaming request",
        ),
    ],
    ids=[
        "p-html",
        "p-array",
        "p-array-overlapped",
        "p-no-kv-params",
        "d-text",
        "d-no-choices",
        "d-string",
        "d-json-to-stream",
    ],
)
def test_unexpected_upstream_reply_is_a_json_error_with_id_and_span(
    tmp_path, recorder, caplog, mode, dispatch, p_answer, d_answer, stream, side, words
):
    with (
        caplog.at_level("WARNING", logger="proxy"),
        pair(p_answer, d_answer) as (p, d),
        router(_cfg(p, d, mode, dispatch, tmp_path)) as url,
    ):
        with httpx.Client(timeout=20, trust_env=False) as client:
            r = client.post(
                url + "/v1/completions",
                headers={"X-Request-Id": TID},
                json={"prompt": "hi", "max_tokens": 3, "stream": stream},
            )
            again = client.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "stream": stream})
    assert r.status_code == 502 and r.headers["x-request-id"] == TID
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["upstream"] == side and err["type"] == "upstream_error" and err["trace_id"] == TID
    assert words in err["message"] and "127.0.0.1" not in r.text
    assert again.status_code == 502  # the client's keep-alive connection was not reset
    root = next(x for x in recorder.roots if x[0] == TID)
    assert root[4] == "failed" and root[5]["http.response.status_code"] == 502 and words in root[5]["kvlens.error"]
    assert any(f"{side} instance answered 200 with" in rec.getMessage() for rec in caplog.records)
