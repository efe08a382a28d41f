"""The sidecar's wire format: what a :class:`exporters.shipping.ShippingRecorder`
writes to its sidecar's stdin and :mod:`exporters.sidecar` reads back.

Frames of a 4-byte little-endian length and a pickle (protocol 5) of
``(kind, arg, fields, rows)``:

* ``"e"`` (:data:`EVENTS`): ``arg`` the engine's loss totals by reason (the
  sidecar reports them in ``kvlens_telemetry_dropped_total``); ``rows`` the
  buffered events as the recorder holds them, plain tuples of an
  :class:`kvrecord.events.Event`'s fields in the order ``fields`` names
  (:data:`kvrecord.events.FIELDS`; a pickled ``NamedTuple`` costs the
  engine ~3-4x as much, a Python call per event). The reader rebuilds the
  same :class:`Event` type from them (``Event._make``, which checks their
  length) and refuses a frame whose field names are not its own (a sidecar
  of other code).
* ``"f"`` (:data:`FLUSH`): a flush, ``arg`` its number, acknowledged on the
  sidecar's stdout with ``flushed <n>``. The sidecar says ``ready`` there
  once its pipeline is up.

Trust: the pipe is written only by the sidecar's parent, so frames are unpickled.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any, Iterator, Mapping, NamedTuple, Sequence

from kvrecord.events import FIELDS, Event, EventFields

FRAME = struct.Struct("<I")
#: Events per frame at most (a frame of them pickles to well under the pipe's size).
MAX_FRAME_EVENTS = 2048
EVENTS, FLUSH = "e", "f"

#: The environment variable that carries the sidecar's spec (role, mode,
#: engine id, options) from the engine to its sidecar: not its command line,
#: which anyone on the host can read and which may hold a store password.
SPEC_ENV = "KVLENS_SIDECAR_SPEC"


class Frame(NamedTuple):
    """One decoded frame: ``kind`` :data:`EVENTS` or :data:`FLUSH`; ``arg``
    the loss totals by reason or the flush's number; ``events`` (EVENTS only)."""

    kind: str
    arg: Any
    events: list[Event]


def encode_events(drops: Mapping[str, int], rows: Sequence[EventFields]) -> bytes:
    """One EVENTS frame, length prefix included (``rows``: :meth:`Recorder.take`'s)."""
    return _frame((EVENTS, drops, FIELDS, rows))


def encode_flush(seq: int) -> bytes:
    """One FLUSH frame, length prefix included."""
    return _frame((FLUSH, seq, FIELDS, []))


def _frame(body: tuple) -> bytes:
    payload = pickle.dumps(body, 5)
    return FRAME.pack(len(payload)) + payload


def payloads(buf: bytearray) -> Iterator[bytes]:
    """The payloads of the complete frames at the front of ``buf``, consumed
    from it one by one (:func:`decode` each: a bad one is skipped alone)."""
    while len(buf) >= FRAME.size:
        (n,) = FRAME.unpack_from(buf)
        if len(buf) < FRAME.size + n:
            return
        payload = bytes(buf[FRAME.size : FRAME.size + n])
        del buf[: FRAME.size + n]
        yield payload


def decode(payload: bytes) -> Frame:
    """One frame's payload, its events rebuilt as :class:`Event` s. Raises
    (ValueError, TypeError, pickle errors) for a frame of other code or a
    damaged one."""
    kind, arg, fields, rows = pickle.loads(payload)
    if tuple(fields) != FIELDS:
        raise ValueError(f"event fields {tuple(fields)} are not {FIELDS}")
    return Frame(kind, arg, list(map(Event._make, rows)))
