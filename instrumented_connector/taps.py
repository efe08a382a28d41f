"""Per-worker helpers of the worker hooks (:mod:`instrumented_connector.worker`):
a transparent tap on vLLM's NIXL wrapper that keeps NIXL's own transfer
telemetry, and the per-thread record of one request's transfer posts
(timestamps, the remote ranks they targeted)."""

from __future__ import annotations

import queue
import threading

from instrumented_connector.hooks import Pending, fail


class NixlTap:
    """Transparent proxy over vLLM's NixlWrapper that remembers NIXL's own
    per-transfer telemetry (bytes, descriptors, duration) by handle, so the
    completion span can carry it. Everything else is forwarded untouched."""

    __slots__ = ("_inner", "_telemetry", "_on_notifs")

    def __init__(self, inner, telemetry: Pending, on_notifs=None):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_telemetry", telemetry)
        object.__setattr__(self, "_on_notifs", on_notifs)

    def get_new_notifs(self):
        """NIXL's notifications, unchanged; ``on_notifs`` sees them first
        (pull P: D's read-done notifications, before vLLM matches them)."""
        res = self._inner.get_new_notifs()
        cb = self._on_notifs
        if cb is not None and res:
            try:
                cb(res)
            except Exception:
                fail("get_new_notifs")
        return res

    def get_xfer_telemetry(self, handle):
        res = self._inner.get_xfer_telemetry(handle)
        try:
            if res is not None:
                self._telemetry.put(handle, (res.totalBytes, res.descCount, res.xferDuration))
        except Exception:
            fail("get_xfer_telemetry")
        return res

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)


class NotifQueueTap(queue.Queue):
    """vLLM's push ``_pending_completion_notifs`` queue, unchanged, except that
    ``on_get`` sees each notification the engine thread takes, just before
    vLLM looks it up (push D: a completion for a request it no longer knows)."""

    def __init__(self, on_get) -> None:
        super().__init__()
        self._on_get = on_get

    def get_nowait(self):
        item = super().get_nowait()
        try:
            self._on_get(item)
        except Exception:
            fail("_pending_completion_notifs")
        return item


class XferTimes(threading.local):
    """Per-thread timestamps of the transfer posts inside one request's call."""

    first: int | None = None
    last: int | None = None
    rank: int | None = None
    ranks: tuple[int, ...] = ()
    posted: int = 0
    failed: bool = False

    def reset(self) -> None:
        self.first = self.last = self.rank = None
        self.ranks = ()
        self.posted = 0
        self.failed = False

    def target(self, rank: int | None) -> None:
        """One post went to remote ``rank`` (the first one is ``rank``)."""
        if rank is None:
            return
        if self.rank is None:
            self.rank = rank
        if rank not in self.ranks:
            self.ranks = (*self.ranks, rank)


class RankedRecorder:
    """The process's recorder as one worker sees it: every event it records
    carries the worker's tensor-parallel rank (``kvlens.rank``) and the
    engine's TP size (``kvlens.tp_size``), so a phase seen on several ranks
    can be told apart (:mod:`kvtrace.ranks`). Costs one call and one dict
    store per event; the hooks hand it fresh attribute dicts (or None)."""

    __slots__ = ("_rec", "_rank", "_size", "_only")

    def __init__(self, rec, rank: int, size: int) -> None:
        from kvrecord import semconv as sc

        self._rec = rec
        self._rank, self._size = rank, size
        self._only = {sc.ATTR_RANK: rank, sc.ATTR_TP_SIZE: size}  # never mutated: shared by attribute-less events

    def record(self, phase, request_id, start_ns, end_ns, outcome="ok", attrs=None) -> None:
        if attrs is None:
            attrs = self._only
        else:
            attrs.update(self._only)
        self._rec.record(phase, request_id, start_ns, end_ns, outcome, attrs)

    def point(self, phase, request_id, outcome="ok", attrs=None) -> None:
        if attrs is None:
            attrs = self._only
        else:
            attrs.update(self._only)
        self._rec.point(phase, request_id, outcome, attrs)

    def __getattr__(self, name):
        return getattr(self._rec, name)
