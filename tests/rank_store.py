"""A trace store written by several real processes, one per TP rank, as
vLLM's multiprocess executor runs them: each rank's worker records through
its own recorder, wrapped as the worker hooks wrap it
(``taps.RankedRecorder``: every span carries ``kvlens.rank``), and the real
sidecar (span building off the engine's GIL) into the real store. Used by
tests/unit/test_ranks.py and the dashboard's browser test.
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
import time
from pathlib import Path

from exporters import pipeline
from kvtrace import store, tracemodel
from kvrecord import semconv as sc
from kvrecord.recorder import Recorder
from instrumented_connector.taps import RankedRecorder

MS = 1_000_000
P = sc.Phase


def _cfg(home: Path) -> dict:
    return {"kvlens_home": str(home), "kvlens_metrics": "off"}


def _recorder(role: str, engine: str, home: Path) -> Recorder:
    """A scheduler's recorder of its own (spans built in this process)."""
    return Recorder(
        role=role,
        mode="pull",
        engine_id=engine,
        pipeline_factory=pipeline.provider_factory(role=role, mode="pull", engine_id=engine, config=_cfg(home)),
    )


def _rank_worker(home: str, role: str, rank: int, size: int, p_rid: str, d_rid: str, t0: int, lag_ms: int) -> None:
    """One TP rank's worker process (spawned): its own recorder and sidecar."""
    rec = pipeline.get_recorder(
        role, "pull", "d0" if role == "decode" else "p0", _cfg(Path(home)), span_builder="sidecar"
    ).start()
    r = RankedRecorder(rec, rank, size)
    if role == "decode":
        t = t0 + 50 * MS
        r.record(P.DESCRIPTOR_PREP, d_rid, t, t + MS, "ok", {sc.ATTR_JOIN_REQUEST_ID: p_rid})
        r.record(
            P.READ_POST,
            d_rid,
            t + MS,
            t + 2 * MS,
            "ok",
            {sc.ATTR_REMOTE_RANKS: [rank], sc.ATTR_BYTES: 1000, sc.ATTR_JOIN_REQUEST_ID: p_rid},
        )
        done = t + (5 + lag_ms) * MS
        r.record(
            P.READ_COMPLETE,
            d_rid,
            t + 2 * MS,
            done,
            "ok",
            {sc.ATTR_BYTES: 4096 * (rank + 1), sc.ATTR_DESCRIPTORS: 8, sc.ATTR_NIXL_XFER_S: (3 + lag_ms) / 1e3},
        )
        r.record(P.KV_READY, d_rid, done + MS, done + MS)
    else:
        r.record(P.KV_RELEASED, p_rid, t0 + (58 + lag_ms) * MS, t0 + (58 + lag_ms) * MS)
    rec.flush()
    rec.close()


def make_rank_store(tmp_path: Path) -> tracemodel.Trace:
    """One pull request recorded into ``tmp_path/traces.db`` by P's and D's
    schedulers and by two spawned rank processes per side (their own
    recorders and sidecars), D's rank 1 4 ms behind rank 0; its trace."""
    p_rid, d_rid = f"cmpl-{secrets.token_hex(16)}-0-0000abcd", f"cmpl-{secrets.token_hex(16)}-0-0000beef"
    t0 = time.time_ns()
    # P's scheduler (EngineCore: no rank)
    # fresh recorders: pipeline.get_recorder's process-wide one for (prefill, pull, p0)
    # may be an earlier test's, writing to that test's store
    sched = _recorder("prefill", "p0", tmp_path)
    sched.record(P.PREFILL, p_rid, t0, t0 + 30 * MS, "ok")
    sched.record(P.PREFILL_FINISHED, p_rid, t0 + 30 * MS, t0 + 30 * MS, "ok")
    dsched = _recorder("decode", "d0", tmp_path)
    q = t0 + 40 * MS
    dsched.record(P.DECODE_QUEUE, d_rid, q, q + 5 * MS, "ok", {sc.ATTR_JOIN_REQUEST_ID: p_rid})
    dsched.record(P.ALLOC, d_rid, q + 5 * MS, q + 5 * MS, "ok", {sc.ATTR_JOIN_REQUEST_ID: p_rid})
    for r in (sched, dsched):
        r.flush()
        r.close()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_worker, args=(str(tmp_path), role, rank, 2, p_rid, d_rid, t0, 4 * rank))
        for role in ("decode", "prefill")
        for rank in (0, 1)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)  # spawned: imports the pipeline; minutes when vLLM shares the 2 cores
        assert p.exitcode == 0
    deadline = time.time() + 30
    while True:
        with store.reading(tmp_path / "traces.db") as conn:
            got = tracemodel.slowest(conn, 10, order="start")
        if got and sum(1 for s in got[0].spans if s.name == "kv.ready") == 2 or time.time() > deadline:
            break
        time.sleep(0.2)
    assert len(got) == 1, got
    return got[0]
