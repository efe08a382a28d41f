"""The one event type on kvlens' event path: :class:`Event`.

A hook's call to :meth:`kvrecord.recorder.Recorder.record` (or the router's
:meth:`~kvrecord.recorder.Recorder.record_root`) builds one :class:`Event`;
the same typed event waits in the recorder's buffer, crosses to the sidecar
(:mod:`exporters.frames` ships its fields and rebuilds it there) and reaches
the span builder, which reads it by field name. Nothing on the way reorders
fields by position or marks a kind with a magic value.

A ``NamedTuple`` because it is a tuple: appending one to the recorder's
deque is nearly what appending a plain tuple cost (the hot path builds it
with ``tuple.__new__``, see :data:`new_event`), and its fields pickle as a
plain tuple.
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


#: ``new_event(Event, (kind, phase, request_id, start_ns, end_ns, outcome,
#: attrs, parent_span_id))``: all eight fields, in order. What
#: ``Event(...)`` does without the Python-level ``__new__`` call that
#: would cost the hot path ~2-3x an append (benchmarks/bench_recorder.py).
new_event = tuple.__new__

#: The field names, in order: the wire format's header (exporters.frames).
FIELDS: tuple[str, ...] = Event._fields
