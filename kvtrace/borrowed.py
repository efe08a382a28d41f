"""The figures the what-if borrows (:mod:`kvtrace.whatif`): each measured
in the traces of the mode the prediction starts from, with its source and
the assumption that lets the other mode use it, in words; and the few
per-trace readings the prediction needs (a phase's duration, the handoff's
tiling by phase). Pure functions of :class:`~kvtrace.tracemodel.Trace`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvrecord import semconv as sc
from kvtrace import ranks, stats
from kvtrace.tracemodel import Trace

P = sc.Phase
PUSH, PULL = sc.Mode.PUSH.value, sc.Mode.PULL.value


@dataclass(frozen=True)
class Borrowed:
    """A figure the prediction borrows: its measured values (seconds, or
    bytes/s for ``bandwidth``), where they come from, and the assumption."""

    name: str
    values: tuple[float, ...]
    source: str
    assumption: str
    unit: str = "s"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "n": len(self.values),
            "p50": stats.percentile(self.values, 50),
            "unit": self.unit,
            "source": self.source,
            "assumption": self.assumption,
        }


def _ns(v: int) -> float:
    return v / 1e9


def _span(t: Trace, name: P, role: str | None = None):
    """The trace's longest span of ``name`` (one per rank with TP), or None."""
    got = [s for s in t.spans if s.name == name.value and (role is None or s.role == role)]
    return max(got, key=lambda s: s.end_ns - s.start_ns) if got else None


def duration(t: Trace, name: P) -> float | None:
    """The trace's longest span of ``name`` (recorded or derived), seconds; None without one."""
    s = _span(t, name)
    return None if s is None else _ns(s.end_ns - s.start_ns)


def tiled_phases(t: Trace) -> dict[str, float]:
    """Phase name -> its exclusive share of the handoff, seconds (roles merged)."""
    til = t.tiling()
    out: dict[str, float] = {}
    for (_, name), ns in til.phases.items() if til else ():
        out[name] = out.get(name, 0.0) + _ns(ns)
    return out


# ------------------------------------------------------------------ borrowed figures
def _bandwidth(t: Trace) -> float | None:
    """The request's bytes / NIXL's transfer time, bytes/s (None: unknown or above the link ceiling)."""
    tot = ranks.transfer_totals(t.spans)
    g = None if tot is None else ranks.gbps(tot.bytes, tot.xfer_s)
    return None if g is None or g > ranks.link_gbps() else tot.bytes / tot.xfer_s


def _notify(t: Trace) -> float | None:
    """Pull: D's read-done notification reaching P (D's ``read.complete`` end ->
    P's ``kv.released``, on P's clock): a side-channel one-way plus P's next step."""
    done, rel = _span(t, P.READ_COMPLETE), _span(t, P.KV_RELEASED)
    return None if done is None or rel is None or rel.end_ns < done.end_ns else _ns(rel.end_ns - done.end_ns)


def _intake(t: Trace) -> float | None:
    """Overlapped push: the router's arrival (root span start) -> D's frontend stamping it (``decode.queue`` start)."""
    root, q = _span(t, P.REQUEST), _span(t, P.DECODE_QUEUE)
    return None if root is None or q is None or q.start_ns < root.start_ns else _ns(q.start_ns - root.start_ns)


def _pool(traces: Sequence[Trace], f: Callable[[Trace], float | None]) -> tuple[float, ...]:
    return tuple(v for v in (f(t) for t in traces) if v is not None)


def borrowed(from_mode: str, traces: Sequence[Trace]) -> list[Borrowed]:
    """The figures the prediction from ``from_mode`` borrows, measured in ``traces``."""
    bw = Borrowed(
        "bandwidth",
        _pool(traces, _bandwidth),
        f"bytes / NIXL's transfer time of each {from_mode} request's {'READ' if from_mode == PULL else 'WRITE'}",
        "the link carries the other direction as fast (same NICs, same memory)",
        "bytes/s",
    )
    if from_mode == PULL:
        return [
            Borrowed(
                "P's engine step to its worker",
                _pool(traces, lambda t: duration(t, P.DECODE_DISPATCH)),
                "D's scheduler-to-worker hop (decode.dispatch) in the pull traces",
                "P's engine hands its finished blocks to the worker (prefill.dispatch + writer.wake) as fast as "
                "D's hands its allocation on: the same vLLM engine loop",
            ),
            Borrowed(
                "the WRITE's notification to D",
                _pool(traces, _notify),
                "D's read-done notification reaching P (read.complete end -> kv.released) in the pull traces",
                "the notification P->D after the WRITE costs what D->P costs after the READ: one side-channel "
                "crossing and the receiver's next engine step (write.notify)",
            ),
            bw,
        ]
    return [
        Borrowed(
            "D's engine step to its worker",
            _pool(traces, lambda t: duration(t, P.PREFILL_DISPATCH)),
            "P's scheduler-to-worker hop (prefill.dispatch) in the push traces",
            "D hands its allocation to the worker (decode.dispatch) as fast as P hands its finished blocks on",
        ),
        Borrowed(
            "the router hop",
            _pool(traces, lambda t: None if (x := _intake(t)) is None else 2 * x),
            "twice D's HTTP intake (the router's arrival -> D's decode.queue start) in the overlapped push traces",
            "P's response path to the router (prefill.respond, relay) costs what D's HTTP intake does: "
            "one HTTP hop each way; the weakest assumption here (P's detokenize and output path are not measured "
            "in push)",
        ),
        bw,
    ]
