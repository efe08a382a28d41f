"""Build a trace store with real-looking push and pull traces through the
real pipeline (Recorder -> OTel SDK -> StoreSpanExporter), for the
dashboard tests. Timestamps are plausible for a 1P1D pair on one host.
"""

from __future__ import annotations

import random
import secrets
import time
from pathlib import Path

from kvtrace import store
from exporters.pipeline import provider_factory
from kvrecord import semconv as sc
from kvrecord.recorder import Recorder

MS = 1_000_000


def _recorder(role: str, mode: str, home: Path) -> Recorder:
    engine = {"router": None, "prefill": "p0", "decode": "d0"}[role]
    return Recorder(
        role=role,
        mode=mode,
        engine_id=engine,
        pipeline_factory=provider_factory(
            role=role, mode=mode, engine_id=engine, config={"kvlens_home": str(home), "kvlens_metrics": "off"}
        ),
    )


def make_store(home: Path, n_per_mode: int = 30, seed: int = 7, span_s: float = 600.0, bench: bool = True) -> Path:
    """Write ``n_per_mode`` push and pull requests spread over the last
    ``span_s`` seconds into ``home/traces.db``; return its path. Roughly 1 in
    10 pull requests fails its READ, 1 in 15 push requests times out."""
    rng = random.Random(seed)
    recs = {(r, m): _recorder(r, m, home) for r in ("router", "prefill", "decode") for m in ("push", "pull")}
    record_requests(recs, rng, time.time_ns() - int(span_s * 1e9), n_per_mode, span_s)
    path = home / "traces.db"
    if bench:
        save_bench(path, rng)
    return path


def record_requests(
    recs, rng: random.Random, base_ns: int, n_per_mode: int, span_s: float, *, seeded_ids: bool = False
) -> dict[str, list[str]]:
    """Record ``n_per_mode`` push and pull requests from ``base_ns`` over
    ``span_s`` seconds through ``recs`` ((role, mode) -> Recorder), then
    flush and close them; the trace ids by mode. ``seeded_ids``: trace and
    request ids drawn from ``rng`` too, so two stores built alike hold the
    same traces (otherwise random, as in production)."""
    step = int(span_s * 1e9 / max(n_per_mode, 1))
    ids: dict[str, list[str]] = {"push": [], "pull": []}
    for i in range(n_per_mode):
        for mode in ("push", "pull"):
            tid = format(rng.getrandbits(128), "032x") if seeded_ids else secrets.token_hex(16)
            ids[mode].append(tid)
            t0 = base_ns + i * step + rng.randint(0, step // 2)
            _request(recs, mode, tid, t0, rng, first=(i == 0), i=i, id_rng=rng if seeded_ids else None)
    for r in recs.values():
        r.flush()
        r.close()
    return ids


def save_bench(store_name, rng: random.Random) -> None:
    """The fixture's bench grid as one saved run (``bench-fixture``)."""
    conn = store.connect(store_name)
    try:
        store.save_bench_rows(conn, "bench-fixture", bench_grid(rng))
    finally:
        conn.close()


def _rid(tid: str, rng: random.Random | None = None) -> str:
    return f"cmpl-{tid}-0-{rng.getrandbits(32):08x}" if rng else f"cmpl-{tid}-0-{secrets.token_hex(4)}"


def _request(
    recs, mode: str, tid: str, t0: int, rng: random.Random, *, first: bool, i: int, id_rng: random.Random | None = None
) -> None:
    P = sc.Phase
    router, pre, dec = recs[("router", mode)], recs[("prefill", mode)], recs[("decode", mode)]
    p_rid, d_rid = _rid(tid, id_rng), _rid(tid, id_rng)
    blocks = rng.choice([4, 8, 16, 32])
    kv_attrs = {
        sc.ATTR_BLOCKS: blocks,
        sc.ATTR_BYTES: blocks * 131072,
        sc.ATTR_DESCRIPTORS: blocks * 4,
        sc.ATTR_REMOTE_RANK: 0,
    }
    prefill_s = rng.uniform(0.020, 0.060) * (1 + i % 5 / 4)
    pf = t0 + 1 * MS + int(prefill_s * 1e9)
    # the prompt's tokens: P and D count the same prompt (the store keeps the first count that arrives,
    # which differs between backends and batches: two counts that disagree made the folded row vary)
    tokens = rng.choice([128, 512, 1024])
    pre.record(P.PREFILL, p_rid, t0 + 1 * MS, pf, "ok", {sc.ATTR_TOKENS: tokens})
    pre.record(P.PREFILL_FINISHED, p_rid, pf, pf, "ok", {sc.ATTR_BLOCKS: blocks})
    outcome = "ok"
    if mode == "push":
        # overlapped: D gets its request with P, queues and registers while P computes
        reg = t0 + 2 * MS
        dec.record(P.DECODE_QUEUE, d_rid, t0 + int(0.6 * MS), reg, "ok", {sc.ATTR_TOKENS: tokens})
        dec.record(P.REGISTRATION_STAGE, d_rid, reg, reg, "ok", {sc.ATTR_BLOCKS: blocks})
        snd = reg + int(0.3 * MS)  # D's step hands it to the writer thread (registration.dispatch, derived)
        dec.record(P.REGISTRATION_SEND, d_rid, snd, snd + int(0.8 * MS), "ok", {sc.ATTR_REMOTE_ENGINE_ID: "p0"})
        rcv = reg + int(1.5 * MS)
        pre.record(P.REGISTRATION_RECEIVE, p_rid, rcv, rcv, "ok", {sc.ATTR_REMOTE_ENGINE_ID: "d0"})
        # P's next step hands the finished blocks to the worker (prefill.dispatch, derived),
        # the writer thread wakes up for them (writer.wake); D registered long before
        enq = pf + int(rng.uniform(1.0, 3.0) * MS)
        pre.record(P.MATCH, p_rid, rcv, enq, "ok", {sc.ATTR_MATCH_FIRST: "registration"})
        t = enq + int(rng.uniform(0.1, 2.0) * MS)
        pre.record(P.WRITER_WAKE, p_rid, enq, t, "ok")
        if first:
            pre.record(
                P.HANDSHAKE, p_rid, t, t + 12 * MS, "ok", {sc.ATTR_REMOTE_ENGINE_ID: "d0", sc.ATTR_DEFERRED: True}
            )
            t += 12 * MS
        dp = int(rng.uniform(0.2, 0.5) * MS)
        pre.record(P.DESCRIPTOR_PREP, p_rid, t, t + dp, "ok", kv_attrs)
        t += dp
        wp = int(rng.uniform(0.3, 0.9) * MS)
        pre.record(P.WRITE_POST, p_rid, t, t + wp, "ok", kv_attrs)
        t += wp
        wc = int(rng.uniform(1.0, 4.0) * MS * (1 + blocks / 16))
        outcome = "timeout" if i % 15 == 7 else "ok"
        pre.record(P.WRITE_COMPLETE, p_rid, t, t + wc, outcome, {**kv_attrs, sc.ATTR_NIXL_XFER_S: wc / 1e9})
        t += wc
        kv = t + int(rng.uniform(2.0, 14.0) * MS)  # D learning the WRITE is done (write.notify, derived)
    else:
        t = pf + int(rng.uniform(5.0, 12.0) * MS)  # P's response path (prefill.respond, derived)
        relay = int(rng.uniform(0.05, 0.3) * MS)
        router.record(P.RELAY, tid, t, t + relay, "ok")
        t += relay + int(rng.uniform(0.5, 1.0) * MS)  # D's HTTP intake (decode.intake, derived)
        q = int(rng.uniform(5.0, 30.0) * MS)
        dec.record(P.DECODE_QUEUE, d_rid, t, t + q, "ok", {sc.ATTR_TOKENS: tokens})
        t += q
        dec.record(P.ALLOC, d_rid, t, t, "ok", {sc.ATTR_BLOCKS: blocks})
        t += int(rng.uniform(0.5, 2.0) * MS)  # D's step reaching its worker (decode.dispatch, derived)
        if first:
            dec.record(P.HANDSHAKE, d_rid, t, t + 15 * MS, "ok", {sc.ATTR_REMOTE_ENGINE_ID: "p0"})
            t += 15 * MS
        dp = int(rng.uniform(0.2, 0.5) * MS)
        dec.record(P.DESCRIPTOR_PREP, d_rid, t, t + dp, "ok", kv_attrs)
        t += dp
        rp = int(rng.uniform(0.3, 0.9) * MS)
        dec.record(P.READ_POST, d_rid, t, t + rp, "ok", kv_attrs)
        t += rp
        rc = int(rng.uniform(1.5, 5.0) * MS * (1 + blocks / 16))
        outcome = "failed" if i % 10 == 3 else "ok"
        dec.record(
            P.READ_COMPLETE,
            d_rid,
            t,
            t + rc,
            outcome,
            {
                **kv_attrs,
                sc.ATTR_NIXL_XFER_S: rc / 1e9,
                **({sc.ATTR_ERROR: "NIXL_ERR_REMOTE_DISCONNECT"} if outcome != "ok" else {}),
            },
        )
        t += rc
        kv = t + int(rng.uniform(0.2, 0.6) * MS)
        pre.record(P.KV_RELEASED, p_rid, t + int(0.1 * MS), t + int(0.1 * MS), "ok")
    ttft = None
    if outcome == "ok":
        dec.record(P.KV_READY, d_rid, kv, kv, "ok", {sc.ATTR_BLOCKS: blocks})
        ttft = (kv + int(rng.uniform(8, 15) * MS) - t0) / 1e9
    end = (t0 + int(ttft * 1e9) + 40 * MS) if ttft else kv + 5 * MS
    attrs = {
        sc.ATTR_TTFT_S: ttft,
        sc.ATTR_DISPATCH: "overlapped" if mode == "push" else "sequential",
        sc.ATTR_STATUS_CODE: 200 if outcome == "ok" else 502,
    }
    router.record_root(tid, None, t0, end, outcome, attrs)


def bench_grid(rng: random.Random) -> list[dict]:
    rows = []
    for mode in ("push", "pull"):
        for input_len in (128, 1024):
            for qps in (1.0, 2.0, 4.0):
                f = (0.8 if mode == "push" else 1.0) * (1 + input_len / 1024) * (1 + qps / 8)
                rows.append(
                    {
                        "mode": mode,
                        "dispatch": "overlapped" if mode == "push" else "sequential",
                        "qps": qps,
                        "input_len": input_len,
                        "output_len": 16,
                        "num_prompts": 20,
                        "completed": 20,
                        "failed": 0,
                        "ttft_mean_s": 0.08 * f,
                        "ttft_p50_s": 0.075 * f,
                        "ttft_p99_s": 0.15 * f,
                        "tpot_mean_s": 0.012 * (1 + qps / 10),
                        "handoff_p50_s": 0.004 * f,
                        "handoff_p99_s": 0.009 * f,
                        "req_per_s": qps * 0.98,
                    }
                )
    return rows
