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
from unittest import mock

from exporters import store
from exporters.pipeline import provider_factory
from instrumented_connector.recorder import Recorder
import store_fixture
from store_fixture import _request, bench_grid

ENGINES = {"router": None, "prefill": "p0", "decode": "d0"}


def build(store_name: Any, cfg: dict, base_ns: int, *, n_per_mode: int = 12, seed: int = 11,
          span_s: float = 600.0) -> dict[str, list[str]]:
    """Record ``n_per_mode`` push and pull requests starting at ``base_ns``
    over ``span_s`` seconds into the store ``cfg`` writes (``store_name``
    names it, for the bench rows); return the trace ids by mode."""
    rng = random.Random(seed)
    recs = {(r, m): Recorder(role=r, mode=m, engine_id=e,
                             pipeline_factory=provider_factory(role=r, mode=m, engine_id=e, config=cfg))
            for r, e in ENGINES.items() for m in ("push", "pull")}
    step = int(span_s * 1e9 / max(n_per_mode, 1))
    ids: dict[str, list[str]] = {"push": [], "pull": []}
    # store_fixture's P/D request ids end in a random suffix: draw it from the seeded RNG
    with mock.patch.object(store_fixture, "_rid", lambda tid: f"cmpl-{tid}-0-{rng.getrandbits(32):08x}"):
        for i in range(n_per_mode):
            for mode in ("push", "pull"):
                tid = format(rng.getrandbits(128), "032x")
                ids[mode].append(tid)
                t0 = base_ns + i * step + rng.randint(0, step // 2)
                _request(recs, mode, tid, t0, rng, first=(i == 0), i=i)
    for r in recs.values():
        r.flush()
        r.close()
    conn = store.connect(store_name)
    try:
        store.save_bench_rows(conn, "bench-fixture", bench_grid(rng))
    finally:
        conn.close()
    return ids
