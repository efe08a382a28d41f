"""Router (``kvlens proxy``) units: trace ids, request shaping, SSE first-token rule."""

from __future__ import annotations

from kvlens import proxy


# ------------------------------------------------------------- unit: ids
def test_trace_id_from_traceparent_wins():
    tid, parent = proxy.trace_ids(
        {
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "x-request-id": "f" * 32,
        }
    )
    assert tid == "0af7651916cd43dd8448eb211c80319c"
    assert parent == 0xB7AD6B7169203331


def test_trace_id_from_hex_request_id_then_fresh():
    assert proxy.trace_ids({"x-request-id": "ab" * 16}) == ("ab" * 16, None)
    tid, parent = proxy.trace_ids({"x-request-id": "not-a-trace-id"})
    assert len(tid) == 32 and int(tid, 16) and parent is None
    bad = proxy.trace_ids({"traceparent": "00-" + "0" * 32 + "-b7ad6b7169203331-01"})
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
    w = proxy._SSEWatcher()
    role_only = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    assert not w.feed(role_only)
    assert not w.feed(b'data: {"choices":[{"delta":{"cont')
    assert w.feed(b'ent":"hi"}}]}\n\n')
