"""Partial and stale traces, written as the connector writes them (the real
pipeline: Recorder -> OTel SDK -> store exporter; ``handoff.open`` spans as
``exporters.handoffhealth`` records them, docs/handoff-health.md), into any store, beside
the complete traces other fixtures write.

:func:`add_health_traces` writes, around ``now_ns``:

* ``push_stuck``: push, D waiting in ``awaiting_kv`` for 20 s (three
  snapshots, the last flagged ``registration_timeout``); P's lease expired
  (its side ended).
* ``pull_stuck``: pull, P holding the blocks in ``awaiting_read`` for 30 s
  (two snapshots); D never started.
* ``pull_stale``: pull, D was reported open (``reading``), then D's READ came
  after P's lease released the blocks: P ``expired``, then a late ``kv.released``
  with outcome ``stale``; D's ``kv.ready`` ok. Ended on both sides.
* ``abandoned``: push, D open, last reported 10 minutes ago, no end (its
  process stopped reporting): not "stuck now" within the last minute.
"""

from __future__ import annotations

import random
from typing import Any

from exporters.pipeline import provider_factory
from kvrecord import semconv as sc
from kvrecord.recorder import Recorder

S = 1_000_000_000
P = sc.Phase
OPEN = sc.SPAN_HANDOFF_OPEN


def _rid(tid: str, rng: random.Random) -> str:
    return f"cmpl-{tid}-0-{rng.getrandbits(32):08x}"


def _open_attrs(role: str, mode: str, phase: str, blocks: int, **more: Any) -> dict[str, Any]:
    return {
        sc.ATTR_OPEN: True,
        sc.ATTR_OPEN_PHASE: phase,
        sc.ATTR_ROLE: role,
        sc.ATTR_MODE: mode,
        sc.ATTR_OPEN_BLOCKS: blocks,
        **more,
    }


def add_health_traces(cfg: dict, now_ns: int, seed: int = 5) -> dict[str, str]:
    """Write the four traces above through the real pipeline configured by
    ``cfg`` (``kv_connector_extra_config``); return their trace ids by name."""
    rng = random.Random(seed)
    recs = {
        (r, m): Recorder(
            role=r, mode=m, engine_id=e, pipeline_factory=provider_factory(role=r, mode=m, engine_id=e, config=cfg)
        )
        for r, e in (("prefill", "p0"), ("decode", "d0"))
        for m in ("push", "pull")
    }
    ids = {
        name: format(rng.getrandbits(128), "032x") for name in ("push_stuck", "pull_stuck", "pull_stale", "abandoned")
    }

    # push, D stuck in awaiting_kv since now-20s; P's lease ran out at now-14s
    tid = ids["push_stuck"]
    pre, dec = recs[("prefill", "push")], recs[("decode", "push")]
    p_rid, d_rid = _rid(tid, rng), _rid(tid, rng)
    t0 = now_ns - 20 * S
    dec.record(P.DECODE_QUEUE, d_rid, t0 - S // 100, t0, "ok", {sc.ATTR_TOKENS: 512})
    dec.record(P.REGISTRATION_STAGE, d_rid, t0, t0, "ok", {sc.ATTR_BLOCKS: 8})
    pre.record(P.PREFILL, p_rid, t0 - S // 50, t0 + S // 50, "ok", {sc.ATTR_TOKENS: 512})
    pre.record(P.PREFILL_FINISHED, p_rid, t0 + S // 50, t0 + S // 50, "ok", {sc.ATTR_BLOCKS: 8})
    exp = now_ns - 14 * S
    pre.record(P.WRITE_COMPLETE, p_rid, exp, exp, "expired", {sc.ATTR_ERROR: "KV lease expired"})
    for k, snap in enumerate((now_ns - 12 * S, now_ns - 7 * S, now_ns - 2 * S)):
        flags = {sc.ATTR_REGISTRATION_TIMEOUT: True, sc.ATTR_REGISTRATION_TIMEOUT_WAIT_S: 8.0} if k == 2 else {}
        dec.record(OPEN, d_rid, t0, snap, "ok", _open_attrs("decode", "push", "awaiting_kv", 8, **flags))

    # pull, P holding blocks for D's READ since now-30s
    tid = ids["pull_stuck"]
    pre = recs[("prefill", "pull")]
    p_rid = _rid(tid, rng)
    t0 = now_ns - 30 * S
    pre.record(P.PREFILL, p_rid, t0 - S // 20, t0, "ok", {sc.ATTR_TOKENS: 1024})
    pre.record(P.PREFILL_FINISHED, p_rid, t0, t0, "ok", {sc.ATTR_BLOCKS: 16})
    for snap in (now_ns - 8 * S, now_ns - 3 * S):
        pre.record(OPEN, p_rid, t0, snap, "ok", _open_attrs("prefill", "pull", "awaiting_read", 16))

    # pull, stale: D read after P's lease released the blocks (ended on both sides)
    tid = ids["pull_stale"]
    pre, dec = recs[("prefill", "pull")], recs[("decode", "pull")]
    p_rid, d_rid = _rid(tid, rng), _rid(tid, rng)
    t0 = now_ns - 60 * S
    pre.record(P.PREFILL, p_rid, t0 - S // 20, t0, "ok", {sc.ATTR_TOKENS: 256})
    pre.record(P.PREFILL_FINISHED, p_rid, t0, t0, "ok", {sc.ATTR_BLOCKS: 4})
    alloc = t0 + S // 100
    dec.record(P.DECODE_QUEUE, d_rid, t0 + S // 200, alloc, "ok", {sc.ATTR_TOKENS: 256})
    dec.record(P.ALLOC, d_rid, alloc, alloc, "ok", {sc.ATTR_BLOCKS: 4})
    join = {sc.ATTR_JOIN_REQUEST_ID: p_rid}
    for snap in (t0 + 6 * S, t0 + 11 * S, t0 + 16 * S):
        dec.record(OPEN, d_rid, alloc, snap, "ok", _open_attrs("decode", "pull", "reading", 4, **join))
    pre.record(OPEN, p_rid, t0, t0 + 5 * S, "ok", _open_attrs("prefill", "pull", "awaiting_read", 4))
    lease = t0 + 6 * S
    pre.record(P.READ_COMPLETE, p_rid, lease, lease, "expired", {sc.ATTR_ERROR: "KV lease expired"})
    rp = t0 + 20 * S
    kv_attrs = {sc.ATTR_BLOCKS: 4, sc.ATTR_REMOTE_ENGINE_ID: "p0", **join}
    dec.record(P.DESCRIPTOR_PREP, d_rid, rp - S // 1000, rp, "ok", kv_attrs)
    dec.record(P.READ_POST, d_rid, rp, rp + S // 1000, "ok", kv_attrs)
    dec.record(P.READ_COMPLETE, d_rid, rp + S // 1000, rp + S // 200, "ok", kv_attrs)
    dec.record(P.KV_READY, d_rid, rp + S // 100, rp + S // 100, "ok", {sc.ATTR_BLOCKS: 4, **join})
    late = rp + S // 150
    stale = {sc.ATTR_KV_STALE: True, sc.ATTR_KV_STALE_SEEN_BY: "prefill"}
    pre.record(P.KV_RELEASED, p_rid, late, late, sc.Outcome.STALE.value, stale)

    # push, D last reported open 10 minutes ago, never ended
    tid = ids["abandoned"]
    dec = recs[("decode", "push")]
    d_rid = _rid(tid, rng)
    t0 = now_ns - 700 * S
    dec.record(P.REGISTRATION_STAGE, d_rid, t0, t0, "ok", {sc.ATTR_BLOCKS: 2})
    dec.record(OPEN, d_rid, t0, now_ns - 600 * S, "ok", _open_attrs("decode", "push", "awaiting_kv", 2))

    for r in recs.values():
        r.flush()
        r.close()
    return ids
