"""Spans in the store are the same whatever carries them there, and stay the
same across refactors of the event path.

One fixed set of recorded events (a push request and a pull request: the
router's root span, P's and D's phases with ranks, a point phase, a failed
phase, attributes of every type) goes to a fresh store by the three roads
kvlens has:

* ``inline``: the recorder builds the spans in-process (the router, and
  ``KVLENS_SPAN_BUILDER=inline``);
* ``sidecar``: vLLM's processes ship raw events to a sidecar process that
  builds them (the default in P and D);
* ``otlp``: the SDK spans encoded as OTLP/protobuf and decoded by the
  collector (several hosts).

Each store is read back through the store API and normalised (random span
ids become names; the process-dependent resource attributes are not in the
store). The result must equal ``tests/golden/store_spans.json``, written once
before the house's second step moved the event path
(``KVLENS_WRITE_GOLDEN=1`` rewrites it, after a change that means to alter
what is stored).
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from exporters import pipeline
from kvtrace import store
from collector import otlp
from kvrecord import semconv as sc
from kvrecord.recorder import Recorder

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "store_spans.json"
P = sc.Phase
MS = 1_000_000
T0 = 1_790_000_000_000_000_000  # fixed wall-clock ns
PUSH_TRACE = "0123456789abcdef0123456789abcdef"
PULL_TRACE = "fedcba9876543210fedcba9876543210"
_SUFFIX = "~golden~"


def _events() -> list[tuple[str, str, str, list]]:
    """(role, mode, engine, calls): each call is (method, args) on that recorder."""
    p_push, d_push = f"cmpl-{PUSH_TRACE}-0-0000aaaa", f"cmpl-{PUSH_TRACE}-0-0000bbbb"
    p_pull, d_pull = f"cmpl-{PULL_TRACE}-0-0000cccc", f"cmpl-{PULL_TRACE}-0-0000dddd"
    t = T0
    return [
        (
            "router",
            "push",
            None,
            [
                (
                    "record_root",
                    (PUSH_TRACE, None, t, t + 900 * MS, "ok", {sc.ATTR_DISPATCH: "overlapped", "kvlens.ttft_s": 0.31}),
                ),
                ("record", (P.RELAY, PUSH_TRACE, t + 300 * MS, t + 900 * MS, "ok", {"kvlens.relay.chunks": 17})),
            ],
        ),
        (
            "prefill",
            "push",
            "p0",
            [
                ("record", (P.PREFILL, p_push, t + 10 * MS, t + 200 * MS, "ok", {"kvlens.num_tokens": 2048})),
                ("record", (P.PREFILL_FINISHED, p_push, t + 200 * MS, t + 200 * MS, "ok", None)),
                (
                    "record",
                    (
                        P.MATCH,
                        p_push,
                        t + 201 * MS,
                        t + 202 * MS,
                        "ok",
                        {sc.ATTR_JOIN_REQUEST_ID: d_push, sc.ATTR_REMOTE_RANKS: [0, 1]},
                    ),
                ),
                (
                    "record",
                    (
                        P.WRITE_COMPLETE,
                        p_push,
                        t + 203 * MS,
                        t + 240 * MS,
                        "ok",
                        {
                            sc.ATTR_BYTES: 1 << 20,
                            sc.ATTR_DESCRIPTORS: 64,
                            sc.ATTR_NIXL_XFER_S: 0.031,
                            "kvlens.rank": 1,
                            "kvlens.tp_size": 2,
                        },
                    ),
                ),
            ],
        ),
        (
            "decode",
            "push",
            "d0",
            [
                (
                    "record",
                    (P.REGISTRATION_SEND, d_push, t + 20 * MS, t + 25 * MS, "ok", {sc.ATTR_JOIN_REQUEST_ID: p_push}),
                ),
                ("record", (P.KV_READY, d_push, t + 245 * MS, t + 245 * MS, "ok", None)),
                (
                    "record",
                    (
                        P.DECODE_FIRST_STEP,
                        d_push,
                        t + 250 * MS,
                        t + 290 * MS,
                        "ok",
                        {"kvlens.kv.recomputed_tokens": 0, "kvlens.block_size": 16, "kvlens.flag": True},
                    ),
                ),
            ],
        ),
        (
            "prefill",
            "pull",
            "p1",
            [
                ("record", (P.PREFILL, p_pull, t + 1000 * MS, t + 1150 * MS, "ok", None)),
                ("record", (P.PREFILL_FINISHED, p_pull, t + 1150 * MS, t + 1150 * MS, "ok", None)),
                ("record", (P.KV_RELEASED, p_pull, t + 1400 * MS, t + 1400 * MS, "ok", None)),
            ],
        ),
        (
            "decode",
            "pull",
            "d1",
            [
                (
                    "record",
                    (P.DECODE_QUEUE, d_pull, t + 1160 * MS, t + 1170 * MS, "ok", {sc.ATTR_JOIN_REQUEST_ID: p_pull}),
                ),
                (
                    "record",
                    (
                        P.READ_COMPLETE,
                        d_pull,
                        t + 1175 * MS,
                        t + 1390 * MS,
                        "failed",
                        {sc.ATTR_BYTES: 12345, "kvlens.error": "handshake_setup_failed", "kvlens.ratio": 0.5},
                    ),
                ),
                ("record", (P.KV_READY, d_pull, t + 1395 * MS, t + 1395 * MS, "ok", None)),
            ],
        ),
    ]


def _cfg(home: Path) -> dict:
    return {"kvlens_home": str(home), "kvlens_metrics": "off"}


def _replay(make) -> None:
    """Every event of :func:`_events` onto the recorder ``make(role, mode, engine)`` returns."""
    for role, mode, engine, calls in _events():
        rec = make(role, mode, engine)
        for method, args in calls:
            getattr(rec, method)(*args)
        rec.flush()
        rec.close()


def _inline(home: Path, finished: list | None = None) -> None:
    def make(role, mode, engine):
        build = pipeline.provider_factory(role=role, mode=mode, engine_id=engine, config=_cfg(home))

        def factory(id_generator):
            provider = build(id_generator)
            if finished is not None:  # one exporter per provider: closing the recorder shuts it down
                memory = InMemorySpanExporter()
                finished.append(memory)
                provider.add_span_processor(SimpleSpanProcessor(memory))
            return provider

        return Recorder(role=role, mode=mode, engine_id=engine, pipeline_factory=factory)

    _replay(make)


def _sidecar(home: Path) -> None:
    def make(role, mode, engine):
        if role == "router":  # the router always builds inline
            return Recorder(
                role=role,
                mode=mode,
                engine_id=engine,
                pipeline_factory=pipeline.provider_factory(role=role, mode=mode, engine_id=engine, config=_cfg(home)),
            )
        # an engine id of this test's own: get_recorder keeps one recorder per (pid, role, mode, engine)
        rec = pipeline.get_recorder(
            role, mode, f"{engine}{_SUFFIX}{home.parent.name}", _cfg(home), span_builder="sidecar"
        )
        assert type(rec).__name__ == "ShippingRecorder", type(rec)
        return rec

    _replay(make)


def _otlp(home: Path) -> None:
    memories: list[InMemorySpanExporter] = []
    _inline(home / "scratch", memories)
    body = encode_spans([s for m in memories for s in m.get_finished_spans()]).SerializeToString()
    with store.connect(home / "traces.db") as conn:
        store.write_spans(conn, otlp.decode(body, "application/x-protobuf"))


def _read(db: Path) -> dict:
    with store.reading(db) as conn:
        traces = sorted(store.slowest(conn, 100, order="start"), key=lambda r: r["trace_id"])
        ids = [r["trace_id"] for r in traces]
        spans = store.spans_for(conn, ids)
        handoffs = store.handoffs(conn, ids)
    names: dict[str, str] = {}
    out_spans = []
    for tid in ids:
        for i, s in enumerate(sorted(spans[tid], key=lambda s: (s["start_ns"], s["end_ns"], s["name"], s["role"]))):
            names[s["span_id"]] = f"{tid[:4]}:{s['role']}:{s['name']}:{i}"
    for tid in ids:
        for s in spans[tid]:
            s = dict(s)
            s["span_id"] = names[s["span_id"]]
            s["parent_id"] = names.get(s["parent_id"], "root-of:" + str(s["parent_id"]) if s["parent_id"] else None)
            out_spans.append(s)
    out_spans.sort(key=lambda s: s["span_id"])
    text = json.dumps({"traces": traces, "handoffs": handoffs, "spans": out_spans}, sort_keys=True)
    return json.loads(re.sub(_SUFFIX + r'[^"]*"', '"', text))  # the sidecar road's engine ids


def test_the_roads_agree_but_for_the_senders_resource():
    g = json.loads(GOLDEN.read_text())
    assert g["sidecar"] == g["inline"]
    for s in g["otlp"]["spans"]:
        s["attributes"].pop("service.name")
        s["attributes"].pop("service.instance.id", None)
    assert g["otlp"] == g["inline"]


@pytest.fixture(scope="module")
def golden() -> dict | None:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else None


@pytest.mark.parametrize("road", ["inline", "sidecar", "otlp"])
def test_the_store_holds_the_same_spans_by_every_road(road, tmp_path, golden):
    """Each road's store equals its golden copy; the roads agree with each
    other but for what the collector adds (each span's resource attributes:
    the sending service)."""
    home = tmp_path / "h"
    home.mkdir()
    {"inline": _inline, "sidecar": _sidecar, "otlp": _otlp}[road](home)
    got = _read(home / "traces.db")
    assert len(got["spans"]) == sum(len(c) for *_, c in _events())
    if os.environ.get("KVLENS_WRITE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        old = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        GOLDEN.write_text(json.dumps({**old, road: got}, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"wrote {GOLDEN}")
    assert golden is not None and road in golden, f"{GOLDEN} lacks {road}: run with KVLENS_WRITE_GOLDEN=1 once"
    golden = golden[road]
    if got != golden:
        diff = difflib.unified_diff(
            json.dumps(golden, indent=1, sort_keys=True).splitlines(),
            json.dumps(got, indent=1, sort_keys=True).splitlines(),
            "golden",
            road,
            lineterm="",
        )
        pytest.fail("the store differs from the golden spans:\n" + "\n".join(list(diff)[:80]))
