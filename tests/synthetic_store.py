"""The same synthetic push/pull traces into any store, deterministically:
trace ids, timestamps and durations come from a seeded RNG and a given base
time, so a SQLite file and a PostgreSQL database built with the same
arguments hold the same traces (P/D request ids too; only span ids are
random, as in production). Spans go through the real pipeline (Recorder ->
OTel SDK -> store exporter), as in ``store_fixture``.
"""

from __future__ import annotations

import random
from typing import Any

from kvtrace import store
from exporters.pipeline import provider_factory
from kvtrace.store.schema import write_tx
from kvrecord.recorder import Recorder
from store_fixture import record_requests, save_bench

ENGINES = {"router": None, "prefill": "p0", "decode": "d0"}


def build(
    store_name: Any, cfg: dict, base_ns: int, *, n_per_mode: int = 12, seed: int = 11, span_s: float = 600.0
) -> dict[str, list[str]]:
    """Record ``n_per_mode`` push and pull requests starting at ``base_ns``
    over ``span_s`` seconds into the store ``cfg`` writes (``store_name``
    names it, for the bench rows); return the trace ids by mode."""
    rng = random.Random(seed)
    recs = {
        (r, m): Recorder(
            role=r, mode=m, engine_id=e, pipeline_factory=provider_factory(role=r, mode=m, engine_id=e, config=cfg)
        )
        for r, e in ENGINES.items()
        for m in ("push", "pull")
    }
    ids = record_requests(recs, rng, base_ns, n_per_mode, span_s, seeded_ids=True)
    # Settle every trace once more with all of them stored: the writer settles
    # each batch against the pair's window as it stands then, so a trace
    # settled before its neighbours arrived keeps a wider bound, which depends
    # on export timing; with every row present the tightest window is the
    # same on any backend and in any run.
    conn = store.connect(store_name)
    try:
        with write_tx(conn):
            store.settle(conn, [t for v in ids.values() for t in v])
    finally:
        conn.close()
    save_bench(store_name, rng)
    return ids
