"""End-to-end: real vLLM P/D with the instrumented connector -> one trace per
request with every phase of its mode, in causal order (issue: walking skeleton)."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from kvtrace import store
from kvrecord import semconv as sc

pytestmark = pytest.mark.e2e

N = 4


def _send(url: str, n: int, *, max_tokens: int = 6, stream: bool = False, timeout: float = 180) -> list[str]:
    """n completions through the router; returns the trace ids (our X-Request-Id)."""
    ids = []
    with httpx.Client(timeout=timeout) as c:
        for i in range(n):
            tid = uuid.uuid4().hex
            body = {
                "prompt": f"kvlens request {i} " + "tokens " * (40 + 30 * i),
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": stream,
            }
            r = c.post(url + "/v1/completions", json=body, headers={"X-Request-Id": tid})
            assert r.status_code == 200, r.text
            ids.append(tid)
    return ids


def _wait_traces(db, ids, phases, timeout=60.0):
    """Spans arrive asynchronously from three processes: poll until complete."""
    deadline = time.time() + timeout
    while True:
        conn = store.connect(db, readonly=True)
        try:
            rows = {r["trace_id"]: r for r in store.slowest(conn, 10_000, trace_ids=ids)}
            spans = store.spans_for(conn, ids)
        finally:
            conn.close()
        done = all(
            t in rows
            and rows[t]["handoff_s"] is not None
            and rows[t]["ttft_source"] == "router"
            and {p.value for p in phases} <= {s["name"] for s in spans[t]}
            for t in ids
        )
        if done or time.time() > deadline:
            return rows, spans
        time.sleep(0.5)


def _one(spans, name, role=None):
    found = [s for s in spans if s["name"] == name and (role is None or s["role"] == role)]
    assert len(found) == 1, (name, [(s["name"], s["role"]) for s in spans])
    return found[0]


def _check_common(rows, spans, ids, mode, phases):
    assert set(rows) == set(ids), "N requests -> N traces"
    for tid in ids:
        row, sp = rows[tid], spans[tid]
        names = {s["name"] for s in sp}
        missing = {p.value for p in phases} - names
        assert not missing, f"{tid} lacks {missing}"
        assert row["mode"] == mode and row["outcome"] == "ok", row
        for s in sp:
            assert s["end_ns"] >= s["start_ns"], s
            assert s["trace_id"] == tid and s["mode"] == mode
            assert s["outcome"] == "ok", s
        pf, kv = _one(sp, "prefill.finished", "prefill"), _one(sp, "kv.ready", "decode")
        assert row["handoff_s"] == pytest.approx((kv["end_ns"] - pf["end_ns"]) / 1e9)
        assert row["handoff_s"] > 0
        root = _one(sp, "request", "router")
        assert root["parent_id"] is None
        assert all(s["parent_id"] == root["span_id"] for s in sp if s is not root)
        assert 0 < row["ttft_s"] <= (root["end_ns"] - root["start_ns"]) / 1e9 + 1e-6
        assert root["start_ns"] <= pf["end_ns"] <= kv["end_ns"] <= root["end_ns"]


def _check_push_order(sp):
    pf = _one(sp, "prefill.finished")
    rr = _one(sp, "registration.receive")
    rs = _one(sp, "registration.send")
    m = _one(sp, "match")
    dp = _one(sp, "descriptor.prep")
    wp, wc, kv = _one(sp, "write.post"), _one(sp, "write.complete"), _one(sp, "kv.ready")
    # The PUSH_REG notification leaves inside registration.send; P can decode it
    # before D's send call returns (seen: 0.6 ms, sequential push, P idle and
    # waiting), so only the send's start must precede the receive.
    assert _one(sp, "registration.stage")["end_ns"] <= rs["end_ns"]
    assert rs["start_ns"] <= rr["end_ns"]
    assert m["end_ns"] >= pf["end_ns"] and m["end_ns"] >= rr["end_ns"]
    # writer.wake: P's engine thread queued the finished blocks (after prefill.finished)
    # -> the writer took them, before it prepared the WRITE; match ends where the
    # blocks were queued when D registered first, starts there when P was first
    ww = _one(sp, "writer.wake")
    assert pf["end_ns"] <= ww["start_ns"] <= ww["end_ns"] <= dp["start_ns"]
    first = m["attributes"][sc.ATTR_MATCH_FIRST]
    assert (m["end_ns"] if first == "registration" else m["start_ns"]) == ww["start_ns"]
    # decode.queue: D's arrival -> its blocks staged
    dq = _one(sp, "decode.queue")
    assert dq["start_ns"] <= dq["end_ns"] == _one(sp, "registration.stage")["end_ns"] and dq["role"] == "decode"
    assert m["attributes"][sc.ATTR_MATCH_FIRST] in ("registration", "prefill")
    assert m["end_ns"] <= dp["start_ns"] <= dp["end_ns"] == wp["start_ns"] <= wp["end_ns"]
    # write.complete spans post -> DONE seen by P's engine loop. P may observe
    # DONE after D got the completion notif, so only its start precedes kv.ready.
    # Likewise the WRITE and its notification can complete before P's post call
    # returns (seen: kv.ready 16 ms before write.post's end, P's writer thread
    # descheduled on 2 busy cores), so only the post's start must precede kv.ready.
    assert wc["start_ns"] == wp["end_ns"] and wp["start_ns"] <= kv["end_ns"]
    assert wc["attributes"][sc.ATTR_BYTES] > 0 and wc["attributes"][sc.ATTR_DESCRIPTORS] > 0
    assert wp["attributes"][sc.ATTR_BLOCKS] > 0
    assert wp["role"] == wc["role"] == m["role"] == rr["role"] == "prefill"
    assert rs["role"] == kv["role"] == "decode"


def _derived(db, ids, traces=None) -> dict[str, set[str]]:
    """The derived phases tracemodel builds for each trace (issue 14); the
    traces themselves (D's spans on P's clock) into ``traces`` if given."""
    from kvtrace import tracemodel

    conn = store.connect(db, readonly=True)
    try:
        trs = tracemodel.find(conn, ids)
    finally:
        conn.close()
    out = {}
    for tid, tr in trs.items():
        out[tid] = {s.name for s in tr.spans if s.attributes.get(sc.ATTR_DERIVED)}
        til = tr.tiling()
        assert til is not None and til.named_ns <= til.handoff_ns
    if traces is not None:
        traces.update(trs)
    return out


def _check_wire_and_release(trs: dict, mode: str) -> None:
    """Each rank's completion span split into NIXL's own time (``*.wire``)
    and the rest (``*.noticed``), summing to it; P's release against D's
    kv.ready, with ``kv.hold`` exactly where P let go after it; the tiling
    still names >= 90 % of the handoff at the median."""
    import statistics

    from kvtrace import ranks

    kind, side = ("write", "prefill") if mode == "push" else ("read", "decode")
    shares = []
    for tid, tr in trs.items():
        done = [s for s in tr.spans if s.name == f"{kind}.complete" and s.role == side and s.outcome == "ok"]
        assert done, tid
        for c in done:
            assert c.attributes[sc.ATTR_NIXL_XFER_S] > 0, c  # vLLM asks NIXL for its telemetry
            parts = [
                s
                for s in tr.spans
                if s.name in (f"{kind}.wire", f"{kind}.noticed")
                and ranks.rank_of(s) == ranks.rank_of(c)
                and c.start_ns <= s.start_ns < c.end_ns
            ]
            wire = [s for s in parts if s.name == f"{kind}.wire"]
            assert len(wire) == 1 and wire[0].start_ns == c.start_ns, (tid, parts)
            assert sum(s.end_ns - s.start_ns for s in parts) == c.end_ns - c.start_ns
        rel = tr.to_json()["release"]
        assert rel is not None and rel["by"] == ("kv.released" if mode == "pull" else "write.complete"), rel
        holds = [s for s in tr.spans if s.name == "kv.hold"]
        assert len(holds) == (1 if rel["after_kv_ready_s"] > 0 else 0), (rel, holds)
        assert all(not h.critical and h.role == "prefill" for h in holds)
        shares.append(tr.tiling().unattributed_share)
    assert statistics.median(shares) <= 0.10, shares


def test_push_overlapped_every_phase_in_causal_order(push_stack):
    ids = _send(push_stack.router_url, N)
    phases = sc.PUSH_PHASES + (sc.Phase.REQUEST, sc.Phase.PREFILL)
    rows, spans = _wait_traces(push_stack.store, ids, phases)
    _check_common(rows, spans, ids, "push", phases)
    trs: dict = {}
    derived = _derived(push_stack.store, ids, trs)
    for tid in ids:
        _check_push_order(spans[tid])
        assert rows[tid]["dispatch"] == "overlapped"
        assert "prefill.dispatch" in derived[tid]
        # P may see its WRITE done after D reported it: then no write.notify
        wc = next(s for s in trs[tid].spans if s.name == "write.complete")
        assert ("write.notify" in derived[tid]) == (wc.end_ns < trs[tid].kv_ready_ns)
        assert "write.wire" in derived[tid]
    _check_wire_and_release(trs, "push")


def test_push_sequential_every_phase_in_causal_order(push_stack):
    url = push_stack.sequential_router_url
    ids = _send(url, N, stream=True)
    phases = sc.PUSH_PHASES + (sc.Phase.REQUEST, sc.Phase.RELAY)
    rows, spans = _wait_traces(push_stack.store, ids, phases)
    _check_common(rows, spans, ids, "push", phases)
    for tid in ids:
        sp = spans[tid]
        _check_push_order(sp)
        relay = _one(sp, "relay")
        # sequential: D is asked only after P answered, so D registers after prefill
        assert _one(sp, "prefill.finished")["end_ns"] <= relay["end_ns"] <= _one(sp, "registration.stage")["end_ns"]
        assert _one(sp, "match")["attributes"][sc.ATTR_MATCH_FIRST] == "prefill"
        assert rows[tid]["dispatch"] == "sequential"
        assert relay["end_ns"] <= _one(sp, "decode.queue")["start_ns"]
    derived = _derived(push_stack.store, ids)
    for tid in ids:
        assert {"prefill.respond", "decode.intake", "prefill.dispatch"} <= derived[tid], derived[tid]


def test_pull_every_phase_in_causal_order(pull_stack):
    ids = _send(pull_stack.router_url, N)
    phases = sc.PULL_PHASES + (sc.Phase.REQUEST, sc.Phase.RELAY, sc.Phase.PREFILL)
    rows, spans = _wait_traces(pull_stack.store, ids, phases)
    _check_common(rows, spans, ids, "pull", phases)
    for tid in ids:
        sp = spans[tid]
        pf, relay, alloc = _one(sp, "prefill.finished"), _one(sp, "relay"), _one(sp, "alloc")
        dp, rp, rc, kv = (_one(sp, n) for n in ("descriptor.prep", "read.post", "read.complete", "kv.ready"))
        assert pf["end_ns"] <= relay["end_ns"] <= alloc["end_ns"] <= dp["start_ns"]
        dq = _one(sp, "decode.queue")
        assert relay["end_ns"] <= dq["start_ns"] <= dq["end_ns"] == alloc["end_ns"]
        assert dp["end_ns"] == rp["start_ns"] <= rp["end_ns"] == rc["start_ns"] <= rc["end_ns"] <= kv["end_ns"]
        assert rc["attributes"][sc.ATTR_BYTES] > 0 and rc["attributes"][sc.ATTR_DESCRIPTORS] > 0
        assert {alloc["role"], dp["role"], rp["role"], rc["role"], kv["role"]} == {"decode"}
    # the first request to a new P waits for the NIXL handshake: recorded once
    hs = [s for t in ids for s in spans[t] if s["name"] == "handshake"]
    assert len(hs) <= 1
    trs: dict = {}
    derived = _derived(pull_stack.store, ids, trs)
    for tid in ids:
        assert {"prefill.respond", "decode.intake", "decode.dispatch", "read.wire"} <= derived[tid], derived[tid]
    _check_wire_and_release(trs, "pull")


def test_traces_cli_json_matches_the_store(pull_stack, capsys):
    from kvlens.cli import main

    # outcome ok: the store also holds a pull request whose KV failed to load (test_e2e_kv_use), with no READ
    assert (
        main(
            [
                "traces",
                "--store",
                pull_stack.store.text,
                "--mode",
                "pull",
                "--outcome",
                "ok",
                "--slowest",
                "2",
                "--json",
            ]
        )
        == 0
    )
    import json

    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert 1 <= len(lines) <= 2
    for rec in lines:
        assert rec["mode"] == "pull" and rec["handoff_s"] > 0
        assert {s["name"] for s in rec["spans"]} >= {p.value for p in sc.PULL_PHASES}
        for s in rec["spans"]:
            assert set(s) >= {"name", "role", "start_ns", "end_ns", "attributes"}
    assert lines == sorted(lines, key=lambda r: -r["handoff_s"])
    assert main(["traces", "--store", pull_stack.store.text, "--slowest", "1"]) == 0
    out = capsys.readouterr().out
    assert "critical path" in out and "kv.ready" in out


GREEDY_PROMPTS = [f"greedy check {i}: " + "alpha beta gamma " * (10 + 25 * i) for i in range(3)]


def _greedy(url: str) -> list[str]:
    out = []
    with httpx.Client(timeout=180) as c:
        for p in GREEDY_PROMPTS:
            r = c.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 12, "temperature": 0})
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["text"])
    return out


# Greedy equality with vLLM's own connector. The conftest runs the stock stack
# of a mode before the instrumented one, so the stock outputs are recorded first.
def test_greedy_stock_push_reference(stock_push_stack, greedy_outputs):
    greedy_outputs["push"] = _greedy(stock_push_stack.router_url)
    assert all(greedy_outputs["push"])


def test_greedy_stock_pull_reference(stock_pull_stack, greedy_outputs):
    greedy_outputs["pull"] = _greedy(stock_pull_stack.router_url)
    assert all(greedy_outputs["pull"])


def test_greedy_push_identical_to_vllms_own_connector(push_stack, greedy_outputs):
    if "push" not in greedy_outputs:
        pytest.skip("stock push reference not recorded (run the whole module)")
    assert _greedy(push_stack.router_url) == greedy_outputs["push"]


def test_greedy_pull_identical_to_vllms_own_connector(pull_stack, greedy_outputs):
    if "pull" not in greedy_outputs:
        pytest.skip("stock pull reference not recorded (run the whole module)")
    assert _greedy(pull_stack.router_url) == greedy_outputs["pull"]


def test_dashboard_pages_on_the_real_run_store(pull_stack, monkeypatch):
    """The dashboard against the store this session's real P/D runs wrote
    (push traces from the push tests, pull traces from this stack)."""
    import sys
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    app = str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py")
    monkeypatch.setattr(sys, "argv", ["app.py", "--store", pull_stack.store.text])
    at = AppTest.from_file(app, default_timeout=90)
    at.run()
    at.select_slider(key="ov_range").set_value("all").run()
    assert not at.exception, [e.value for e in at.exception]
    with store.reading(pull_stack.store) as conn:  # push too when the push tests ran first (make test)
        modes = {r["mode"] for r in store.slowest(conn, 10_000, order="start")}
    assert len([m for m in at.metric if m.label.startswith("handoff p50 (")]) == len(modes)  # side by side

    at = AppTest.from_file(app, default_timeout=90)
    at.query_params["page"] = "traces"
    at.query_params["mode"] = "pull"
    at.query_params["outcome"] = "ok"  # not the request whose KV failed to load (test_e2e_kv_use)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    spans = at.dataframe[-1].value
    assert {p.value for p in sc.PULL_PHASES} <= set(spans["phase"])


def test_malformed_kv_transfer_params_leave_serving_intact(push_stack):
    """Garbage kv_transfer_params sent straight to P: vLLM answers as it
    does without kvlens (whatever its status), and the stack keeps serving."""
    with httpx.Client(timeout=180) as c:
        for params in (
            {"do_remote_decode": True, "remote_block_ids": "not-a-list", "remote_engine_id": 7},
            {"do_remote_decode": "maybe"},
            ["not", "a", "dict"],
        ):
            r = c.post(
                push_stack.prefill_url + "/v1/completions",
                json={"prompt": "malformed", "max_tokens": 1, "kv_transfer_params": params},
            )
            assert r.status_code < 500, r.text
    assert _send(push_stack.router_url, 1)
    assert push_stack.dead_child() is None
