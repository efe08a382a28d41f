"""End-to-end: KV that moved but was not used, with a real fault.

The pull stack runs D with vLLM's ``kv_load_failure_policy: recompute``. A
request is prefilled on P as kvlens' router would send it; D then gets P's
``kv_transfer_params`` with the one thing a misconfigured fleet gets wrong:
P's side channel is not where D is told to find it (an engine id D has
never met, on a port nobody listens on). D's NIXL handshake times out, the
load fails, vLLM drops the blocks and D computes the whole prompt itself;
the client still gets its answer. kvlens must mark the trace
(``kvlens.kv.recomputed_tokens`` on D's ``decode.first_step``, ``kv_use`` in
the JSON), count it in D's ``kvlens_kv_recomputed_total{mode="pull"}`` and
show it on the Traces page; a normal request through the router is not
marked.
"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from kvtrace import store, tracemodel
from kvrecord import ids
from kvrecord.ports import free_port
from proxy.bodies import decode_body, prefill_body

pytestmark = pytest.mark.e2e

BODY = {"prompt": "kv use probe " + "tokens " * 150, "max_tokens": 4, "temperature": 0}


def _recomputed_count(decode_url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(decode_url + "/metrics", timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "kvlens_kv_recomputed_total" and s.labels.get("mode") == "pull"
    )


def _wait_first_step(db, tid: str, timeout: float = 60.0, outcome: str | None = None) -> tracemodel.Trace | None:
    """The trace once D's first step is in it (and, with ``outcome``, once
    its folded outcome is that: the failed load's span can reach the store
    after the first step's, from another thread of D's worker)."""
    deadline = time.time() + timeout
    while True:
        with store.reading(db) as conn:
            tr = tracemodel.find(conn, [tid]).get(tid)
        done = tr is not None and any(s.name == "decode.first_step" for s in tr.spans)
        if done and (outcome is None or tr.outcome == outcome) or time.time() > deadline:
            return tr
        time.sleep(0.5)


def test_a_load_that_fails_under_recompute_is_marked_counted_and_shown(pull_stack, monkeypatch):
    st = pull_stack
    before = _recomputed_count(st.decode_url)
    rid = uuid.uuid4().hex
    with httpx.Client(timeout=120) as c:
        rp = c.post(st.prefill_url + "/v1/completions", json=prefill_body(BODY), headers={"X-Request-Id": rid})
        assert rp.status_code == 200, rp.text
        params = rp.json()["kv_transfer_params"]
        wrong = {**params, "remote_engine_id": "p-gone", "remote_port": free_port()}
        rd = c.post(st.decode_url + "/v1/completions", json=decode_body(BODY, wrong), headers={"X-Request-Id": rid})
        assert rd.status_code == 200, rd.text  # recomputed on D: the client is served
        normal = c.post(st.router_url + "/v1/completions", json=BODY, headers={"X-Request-Id": uuid.uuid4().hex})
        assert normal.status_code == 200, normal.text
    assert rd.json()["choices"][0]["text"] == normal.json()["choices"][0]["text"]  # greedy: the same answer
    tid = ids.trace_of_response(rp.json().get("id"), rid)
    normal_tid = ids.trace_of_response(normal.json().get("id"), normal.headers.get("x-request-id"))
    tr = _wait_first_step(st.store, tid, outcome="failed")
    assert tr is not None, "no trace for the recomputed request"
    assert tr.outcome == "failed", tr.outcome  # the load failed; vLLM recomputed, the client was served
    use = tr.to_json()["kv_use"]
    assert use is not None and use["recomputed"], (use, [s.name for s in tr.spans])
    assert use["recomputed_tokens"] > 100, use  # the whole prompt (~150 tokens), not its last partial block
    ok = _wait_first_step(st.store, normal_tid)
    assert ok is not None and ok.to_json()["kv_use"] is not None and not ok.to_json()["kv_use"]["recomputed"], (
        ok and ok.to_json()["kv_use"]
    )
    deadline = time.time() + 30
    while _recomputed_count(st.decode_url) < before + 1 and time.time() < deadline:
        time.sleep(0.5)
    assert _recomputed_count(st.decode_url) == before + 1
    # the Traces page says so
    from streamlit.testing.v1 import AppTest

    monkeypatch.setattr(sys, "argv", ["app.py", "--store", st.store.text])
    at = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py"), default_timeout=60)
    at.query_params["page"] = "traces"
    at.query_params["trace"] = tid
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    warnings = " ".join(w.value for w in at.warning)
    assert "prompt tokens itself at its first step" in warnings and "not used" in warnings, warnings
