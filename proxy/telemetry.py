"""The router's spans: the root ``request`` span and ``relay``, through the
process's recorder (:func:`exporters.pipeline.get_recorder`).

Telemetry can never fail a request: every method swallows and logs its
errors. All methods run on the event loop and never block (the recorder
only enqueues).
"""

from __future__ import annotations

import logging
import threading
import time

from exporters.pipeline import get_recorder
from kvrecord import semconv as sc
from kvrecord.cpuclock import CLOCK
from kvrecord.cpufigures import before_attrs
from proxy.config import ProxyConfig

logger = logging.getLogger("kvlens.proxy")


class RouterTelemetry:
    """Wraps the router's recorder; ``rec`` is None when telemetry is off or
    could not start (then every method does nothing)."""

    def __init__(self, cfg: ProxyConfig) -> None:
        self.rec = None
        if not cfg.telemetry:
            return
        try:
            self.rec = get_recorder(role="router", mode=cfg.mode, engine_id=None, config=cfg.options)
        except Exception as e:  # broken config / store: serve without spans
            logger.warning("kvlens proxy: telemetry disabled (%s: %s)", type(e).__name__, e)

    def request(
        self,
        tid: str,
        parent: int | None,
        t0: int,
        t1: int,
        outcome: str,
        ttft_s: float | None,
        dispatch: str,
        status: int,
        error: str | None = None,
        attrs: dict | None = None,
    ) -> None:
        """The root span of trace ``tid``; times in wall-clock ns, TTFT in s.
        ``error``: why it failed, in words; ``attrs``: more attributes
        (the client's own ids, :mod:`proxy.isolation`; a mixed
        fleet's request mode, split weight, prompt tokens and TPOT)."""
        if self.rec is None:
            return
        try:
            a = dict(attrs or {})
            a.update({sc.ATTR_DISPATCH: dispatch, sc.ATTR_STATUS_CODE: status})
            if ttft_s is not None:
                a[sc.ATTR_TTFT_S] = ttft_s
            if error:
                a[sc.ATTR_ERROR] = error
            self.rec.record_root(tid, parent, t0, t1, outcome, a)
        except Exception:
            logger.debug("request span failed", exc_info=True)

    def now(self) -> int:
        """Wall-clock ns; with telemetry on, also a reading of this (the event
        loop's) thread's CPU counters stamped with it (:mod:`kvrecord.cpuclock`):
        taken as the request goes to P and as P's answer is in, :meth:`relay`
        puts the thread's CPU wait between the two on its span."""
        if self.rec is None:
            return time.time_ns()
        return CLOCK.now()

    def relay(self, tid: str, t0: int, t1: int, outcome: str = "ok", mode: str | None = None) -> None:
        """The ``relay`` span: P's answer handed on to D (pull, sequential
        push); ``mode``: the request's (a mixed fleet's), else the router's.
        ``t0`` from :meth:`now`: the span carries the event loop's CPU
        readings before it (``kvlens.cpu.before.*``): the router's share of
        ``prefill.respond``'s CPU wait (:mod:`kvtrace.cpusplit`)."""
        if self.rec is None:
            return
        try:
            a = before_attrs(CLOCK, t0, {sc.ATTR_MODE: mode} if mode else {})
            # the loop's thread stamped t0: where the kernel's record is kept, prefill.respond's walk starts here
            a[sc.ATTR_CPU_TID] = threading.get_native_id()
            self.rec.record(sc.Phase.RELAY, tid, t0, t1, outcome, a or None)
        except Exception:
            logger.debug("relay span failed", exc_info=True)

    def close(self) -> None:
        if self.rec is None:
            return
        try:
            self.rec.close()
        except Exception:
            logger.debug("recorder close failed", exc_info=True)
