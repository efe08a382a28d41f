"""The one event type on kvlens' event path: :class:`Event`.

A hook's call to :meth:`kvrecord.recorder.Recorder.record` (or the router's
:meth:`~kvrecord.recorder.Recorder.record_root`) records one event; it
reaches the span builder (:mod:`kvrecord.spanbuilder`), in the same process
or in the sidecar (:mod:`exporters.frames` ships it there), as an
:class:`Event` read by field name. Nothing on the way reorders fields by
position or marks a kind with a magic value.

On the engine's side an event travels as its :data:`EventFields`: the plain
tuple of an :class:`Event`'s fields, in :data:`FIELDS` order, built in one
place (``Recorder.record``). Building the ``NamedTuple`` itself there would
cost the hot path about twice the append (a tuple subclass instance is
allocated in C past the tuple free list, or through a Python ``__new__``:
benchmarks/bench_recorder.py, ~+0.13-0.23 us per ``record``), and pickling
NamedTuples for the sidecar costs ~3-4x their fields (a Python call per
event), so the event becomes an :class:`Event` where its fields are read:
``as_event``, on the span builder's thread or the sidecar's.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple


class Kind(str, enum.Enum):
    """What an :class:`Event` becomes."""

    SPAN = "span"  # one phase of a request: a child of the request's root span
    ROOT = "root"  # the request's root ``request`` span (the router's)


class Event(NamedTuple):
    """One recorded event, from the hook to the span builder.

    ``request_id``: for a ``span`` the vLLM request id (or the router's 32-hex
    trace id); for a ``root`` the 32-hex W3C trace id the router chose.
    Times are wall-clock ns. ``parent_span_id``: ``root`` only, the client's
    ``traceparent`` span (None: the root span is a root)."""

    kind: Kind
    phase: Any  # a semconv.Phase (or its name); ``request`` for a root
    request_id: str
    start_ns: int
    end_ns: int
    outcome: str = "ok"
    attrs: dict | None = None
    parent_span_id: int | None = None


#: An event as the recorder buffers and ships it: the plain tuple of an
#: :class:`Event`'s fields, all eight, in :data:`FIELDS` order.
EventFields = tuple

#: The field names, in order: the wire format's header (exporters.frames).
FIELDS: tuple[str, ...] = Event._fields

_new = tuple.__new__


def as_event(fields: EventFields) -> Event:
    """The :class:`Event` of ``fields`` (an :class:`Event` too): ``Event._make``
    without its Python call and length check (the recorder builds all eight)."""
    return _new(Event, fields)
