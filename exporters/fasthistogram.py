"""A prometheus_client ``Histogram`` whose ``observe`` is cheap enough for
one call per span of the collector (tens of thousands a second).

prometheus_client's own ``Histogram.observe`` walks the bucket bounds in a
Python loop and takes one lock per value it touches (the sum, the bucket,
the bucket's exemplar), and validates every exemplar's labels: about 2.5 us
per observation with an exemplar, half of ``PhaseMetricsProcessor.on_end``.
No option of the library makes that cheaper, so :class:`FastHistogram`
keeps everything of the library's class (registration, ``labels()``,
names, help, bucket bounds, the ``_created`` sample, the exposition) and
replaces only its children's storage: a ``bisect`` into the calling
thread's own list of counts (no lock), the exemplar kept as a plain tuple
until a scrape reads it. The stock ``_child_samples`` reads that storage
through :class:`_BucketView` and :class:`_SumView` (the ``get`` /
``get_exemplar`` it calls on its values), so the samples are built by the
library itself, in its order.

In prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``
set before it was imported, as vLLM does) values live in per-process mmap
files that another process reads; there :func:`histogram_class` gives the
stock ``Histogram``, which writes them.
"""

from __future__ import annotations

import threading
import time
from _thread import get_ident
from bisect import bisect_left
from functools import partial
from typing import Any, Callable

from prometheus_client import Histogram, values
from prometheus_client.samples import Exemplar

try:  # the check prometheus_client applies to an exemplar's labels (its location moved in 0.21)
    from prometheus_client.validation import _validate_exemplar
except ImportError:  # pragma: no cover - older prometheus_client
    from prometheus_client.metrics import _validate_exemplar  # type: ignore[attr-defined,no-redef]

TRACE_ID = "trace_id"


class _SumView:
    """The child's sum, as the stock ``_child_samples`` reads it (``.get()``)."""

    __slots__ = ("_h",)

    def __init__(self, h: "FastHistogram") -> None:
        self._h = h

    def get(self) -> float:
        total = 0.0
        for shard in tuple(self._h._shard_list):
            total += shard[0]
        return total


class _BucketView:
    """One bucket's count (not cumulative) and last exemplar, as the stock
    ``_child_samples`` reads a bucket value (``.get()``, ``.get_exemplar()``)."""

    __slots__ = ("_h", "_i")

    def __init__(self, h: "FastHistogram", i: int) -> None:
        self._h, self._i = h, i

    def get(self) -> int:
        i = self._i + 1
        return sum(shard[i] for shard in tuple(self._h._shard_list))

    def get_exemplar(self) -> Exemplar | None:
        ex = self._h._exemplars[self._i]
        if ex is None:
            return None
        labels, amount, ts = ex
        if isinstance(labels, int):
            labels = {TRACE_ID: format(labels, "032x")}
        elif isinstance(labels, str):
            labels = {TRACE_ID: labels}
        return Exemplar(labels, amount, ts)


class FastHistogram(Histogram):
    """``prometheus_client.Histogram`` with a cheaper child ``observe`` (same
    arguments, errors and exposition) and :meth:`observe_trace`.

    No lock on the way (an uncontended ``threading.Lock`` acquire and release
    alone cost a quarter of the stock ``observe``): each thread adds into its
    own shard, ``[sum, count of bucket 0, ...]`` (:meth:`shard`), which only
    it writes; a read adds the shards up, in the order they were made. One
    thread's sum is therefore the same float as the stock class's; a child
    observed from several threads sums each thread's part first (the stock
    class adds in lock order: the two can differ in the last bits). A
    bucket's exemplar is one list slot, replaced whole (the last observation
    with an exemplar wins, as in the stock class)."""

    def _metric_init(self) -> None:
        n = len(self._upper_bounds)
        self._shard_lock = threading.Lock()
        self._shards: dict[int, list] = {}  # thread ident -> [sum, count of bucket 0, ...]
        self._shard_list: list[list] = []  # the shards, in the order they were made
        #: per bucket: (labels dict, or a trace id int | str, value, time.time()) of its last exemplar
        self._exemplars: list[tuple[Any, float, float] | None] = [None] * n
        self._sum = _SumView(self)
        self._buckets = [_BucketView(self, i) for i in range(n)]
        self._created = time.time()

    def shard(self) -> list:
        """The calling thread's shard (made on its first observation)."""
        ident = get_ident()
        shard = self._shards.get(ident)
        if shard is None:
            with self._shard_lock:
                shard = [0.0] + [0] * len(self._upper_bounds)
                self._shard_list.append(shard)
                self._shards[ident] = shard  # a thread ident is reused only after its thread ended
        return shard

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        """As ``Histogram.observe``: the value counts in the first bucket whose
        bound is >= it (NaN: in the sum alone); with an exemplar, that bucket's
        exemplar becomes it (an invalid one raises ValueError after counting)."""
        self._raise_if_not_observable()
        i = bisect_left(self._upper_bounds, amount)
        shard = self._shards.get(get_ident()) or self.shard()
        shard[0] += amount
        if amount != amount:  # NaN: no bound is >= it, so prometheus_client counts it in no bucket
            return
        shard[i + 1] += 1
        if exemplar:
            _validate_exemplar(exemplar)
            self._exemplars[i] = (exemplar, amount, time.time())

    def observe_trace(self, amount: float, trace_id: "int | str | None") -> None:
        """``observe(amount, {"trace_id": trace_id} if trace_id is not None else None)``
        of a child, the exemplar built only when a scrape reads it: an int trace id
        is formatted then (32 hex digits, as OTel writes it; a trace id always
        passes prometheus_client's check)."""
        i = bisect_left(self._upper_bounds, amount)
        shard = self._shards.get(get_ident()) or self.shard()
        shard[0] += amount
        if amount == amount:  # NaN: see observe
            shard[i + 1] += 1
            if trace_id is not None:
                self._exemplars[i] = (trace_id, amount, time.time())


def histogram_class() -> type[Histogram]:
    """:class:`FastHistogram`, or the stock class where values are multiprocess (mmap files)."""
    return Histogram if getattr(values.ValueClass, "_multiprocess", False) else FastHistogram


def trace_observer(child: Histogram) -> Callable[[float, "int | str | None"], None]:
    """``f(amount, trace_id or None)``: :meth:`FastHistogram.observe_trace` on any histogram child."""
    if isinstance(child, FastHistogram):
        return child.observe_trace

    def observe(amount: float, trace_id: int | str | None) -> None:
        observe_trace(child, amount, trace_id)

    return observe


def observe_trace(child: Histogram, amount: float, trace_id: int | str | None) -> None:
    """:meth:`FastHistogram.observe_trace` on any histogram child."""
    if isinstance(child, FastHistogram):
        child.observe_trace(amount, trace_id)
    else:
        if isinstance(trace_id, int):
            trace_id = format(trace_id, "032x")
        child.observe(amount, {TRACE_ID: trace_id} if trace_id is not None else None)


def adder(metric: Any, amount: float) -> Callable[[], None]:
    """``metric.inc(amount)`` of a Counter or Gauge child (or unlabelled
    metric) as a call without ``inc``'s checks, which these callers pass by
    construction (observable, not a "mostrecent" gauge, a counter's amount
    >= 0): prometheus_client spends three Python calls on them before its
    value's own ``inc``, which this calls directly (a Gauge's ``dec(n)`` is
    its value's ``inc(-n)``). The checked ``inc`` where the value has none."""
    inc = getattr(getattr(metric, "_value", None), "inc", None)
    if inc is None or getattr(metric, "_is_most_recent", False):
        return partial(metric.inc, amount)
    return partial(inc, amount)
