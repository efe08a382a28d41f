"""Open handoffs of one process: a bounded table the hooks keep as handoffs
open, move between phases and end, and that this process's background thread
reads once a second (docs/handoff-health.md).

Hot path (the hooks: the engine loop, the push writer thread): a timestamp
the hook already took, one uncontended lock and a dict operation; counters are
plain ints. Nothing here touches Prometheus or builds a span:
:mod:`exporters.handoffhealth` publishes a :meth:`HandoffTable.snapshot` from the
recorder's background thread.

Each phase has its own insertion-ordered dict, so the oldest entry of a phase
is its first (O(1)); an entry is ordered by the time it entered its phase.
The table holds at most ``cap`` open handoffs: past that, a new one is not
tracked and counted in :attr:`HandoffTable.dropped`.

One table per (mode, role) per process (:func:`table_for`); with TP = 1 vLLM
runs the scheduler and the worker in one process, so scheduler and worker
hooks meet in one table.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Iterable

from kvrecord import semconv as sc

#: Default bound of one table (open handoffs tracked at once).
DEFAULT_CAP = 8192
#: :meth:`HandoffTable.due` looks at most this many entries per phase (bounded time under the lock).
SCAN_LIMIT = 1024

OUTCOMES = tuple(o.value for o in sc.Outcome)

# entry slots (a list: mutated in place under the lock)
_PHASE, _PHASE_T, _START, _BLOCKS, _FLAGS, _EMITTED, _JOIN = range(7)


class HandoffTable:
    """The open handoffs of one side (``mode``, ``role``) in this process.

    Any thread may call any method; every method holds the table's lock for
    O(1) work except :meth:`snapshot` / :meth:`due` (O(phases) plus the
    entries they return, on the background thread)."""

    def __init__(self, mode: str, role: str, cap: int = DEFAULT_CAP) -> None:
        if cap <= 0:
            raise ValueError(f"open-handoff table cap must be > 0, got {cap}")
        self.mode, self.role, self.cap = mode, role, cap
        self.phases: tuple[sc.OpenPhase, ...] = sc.OPEN_PHASES.get((mode, role), ())
        self._by_phase: dict[str, dict[str, list]] = {p.value: {} for p in self.phases}
        self._blocks: dict[str, int] = {p.value: 0 for p in self.phases}
        self._where: dict[str, str] = {}  # open request id -> its phase
        self._flagged: set[str] = set()  # open request ids with flags
        self._n = 0
        self._lock = threading.Lock()
        # plain counters, read (never reset) by the publisher
        self.attempts = 0
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.stale = 0
        self.registration_timeouts = 0
        self.dropped = 0
        #: phases this process reports (the hooks that feed them run here)
        self.owned: set[str] = set()
        #: called by the publisher before each snapshot (background thread):
        #: drop entries vLLM itself dropped, fill in what the hot path skipped
        self.reconcilers: list = []

    # ------------------------------------------------------------ hot path
    def own(self, phases: Iterable[sc.OpenPhase]) -> None:
        """This process reports ``phases`` (called at hook set-up)."""
        self.owned.update(p.value for p in phases if p.value in self._by_phase)

    def open(
        self,
        rid: str,
        phase: sc.OpenPhase | str,
        t_ns: int,
        blocks: int = 0,
        start_ns: int | None = None,
        attempt: bool = True,
        join: str | None = None,
    ) -> None:
        """``rid`` waits in ``phase`` from ``t_ns`` on. A handoff already open
        moves there (keeping its start and flags); a new one counts an
        attempt (``attempt``) unless the table is full (counted dropped).
        ``phase``: hooks pass its value (a str: an enum member costs a
        Python ``__hash__`` per look-up)."""
        ph = phase if type(phase) is str else phase.value
        with self._lock:
            d = self._by_phase.get(ph)
            if d is None:
                return
            old = self._where.get(rid)
            if old is None:
                if self._n >= self.cap:
                    self.dropped += 1
                    return
                e = [ph, t_ns, t_ns if start_ns is None else start_ns, blocks, None, 0, join]
                self._n += 1
                if attempt:
                    self.attempts += 1
            else:
                e = self._by_phase[old].pop(rid)
                if e[_BLOCKS]:
                    self._blocks[old] -= e[_BLOCKS]
                e[_PHASE], e[_PHASE_T] = ph, t_ns
                if blocks:
                    e[_BLOCKS] = blocks
                if start_ns is not None and start_ns < e[_START]:
                    e[_START] = start_ns
            d[rid] = e
            self._where[rid] = ph
            if e[_BLOCKS]:
                self._blocks[ph] += e[_BLOCKS]

    def move(self, rid: str, phase: sc.OpenPhase | str, t_ns: int) -> bool:
        """Move an open ``rid`` to ``phase``; False (nothing done) if it is not open."""
        ph = phase if type(phase) is str else phase.value
        with self._lock:
            old = self._where.get(rid)
            if old is None or ph not in self._by_phase:
                return False
            e = self._by_phase[old].pop(rid)
            if e[_BLOCKS]:
                self._blocks[old] -= e[_BLOCKS]
                self._blocks[ph] += e[_BLOCKS]
            e[_PHASE], e[_PHASE_T] = ph, t_ns
            self._by_phase[ph][rid] = e
            self._where[rid] = ph
            return True

    def close(self, rid: str, outcome: str | None, count_anyway: bool = False) -> list | None:
        """End ``rid``'s handoff; count ``outcome`` (None: ended without one,
        e.g. merged into another entry) if it was open here, or in any case
        with ``count_anyway``: the hook that sees the end may run in another
        process than the one that opened it (vLLM's worker and scheduler;
        counters add up across an instance's processes, gauges do not).
        Returns the entry, or None if it was not open here."""
        with self._lock:
            ph = self._where.pop(rid, None)
            e = None
            if ph is not None:
                e = self._by_phase[ph].pop(rid)
                if e[_BLOCKS]:
                    self._blocks[ph] -= e[_BLOCKS]
                if e[_FLAGS] is not None:
                    self._flagged.discard(rid)
                self._n -= 1
            if outcome is not None and (e is not None or count_anyway):
                self.outcomes[outcome if outcome in self.outcomes else sc.Outcome.FAILED.value] += 1
            return e

    def flag(self, rid: str, key: str, value: Any) -> bool:
        """Attach ``key=value`` to an open handoff (shown on its partial
        trace; the ending hook reads it back). False if not open."""
        with self._lock:
            e = self._get(rid)
            if e is None:
                return False
            if e[_FLAGS] is None:
                e[_FLAGS] = {}
            e[_FLAGS][key] = value
            self._flagged.add(rid)
            return True

    def flags(self, rid: str) -> dict | None:
        """The flags of an open handoff (a copy), or None."""
        with self._lock:
            e = self._get(rid)
            return dict(e[_FLAGS]) if e is not None and e[_FLAGS] else None

    def is_open(self, rid: str) -> bool:
        """Whether ``rid`` is open (one dict look-up, no lock: a hook's cheap test)."""
        return rid in self._where

    def is_flagged(self, rid: str) -> bool:
        """Whether an open ``rid`` carries flags (no lock: a hook's cheap test)."""
        return rid in self._flagged

    def count_stale(self) -> None:
        """One request's KV moved after P released it (also an outcome ``stale``)."""
        with self._lock:
            self.stale += 1
            self.outcomes[sc.Outcome.STALE.value] += 1

    def count_registration_timeout(self) -> None:
        with self._lock:
            self.registration_timeouts += 1

    def set_blocks(self, rid: str, blocks: int) -> None:
        """Fill in the block count of an open handoff learnt later."""
        with self._lock:
            e = self._get(rid)
            if e is not None and blocks != e[_BLOCKS]:
                self._blocks[e[_PHASE]] += blocks - e[_BLOCKS]
                e[_BLOCKS] = blocks

    # ------------------------------------------------------- background thread
    def snapshot(self) -> dict[str, tuple[int, int | None, int]]:
        """Per owned phase: (open handoffs, phase-entry ns of the oldest or
        None, blocks held)."""
        out = {}
        with self._lock:
            for ph in self.owned:
                d = self._by_phase[ph]
                oldest = None
                if d:
                    oldest = d[next(iter(d))][_PHASE_T]
                out[ph] = (len(d), oldest, self._blocks[ph])
        return out

    def due(self, now_ns: int, after_ns: int, every_ns: int, limit: int) -> list[tuple[str, list]]:
        """Open handoffs of owned phases open at least ``after_ns`` whose
        partial trace was last written ``every_ns`` ago or more (oldest
        first, at most ``limit``); marks them written now. Returns
        (request id, a copy of the entry)."""
        out: list[tuple[str, list]] = []
        cutoff = now_ns - after_ns
        with self._lock:
            for ph in self.owned:
                # the lock is held for at most SCAN_LIMIT entries per phase:
                # with more stuck than that, the oldest get the partial traces
                for n, (rid, e) in enumerate(self._by_phase[ph].items()):
                    if e[_PHASE_T] > cutoff or len(out) >= limit or n >= SCAN_LIMIT:
                        break
                    if e[_START] <= cutoff and now_ns - e[_EMITTED] >= every_ns:
                        e[_EMITTED] = now_ns
                        f = e[_FLAGS]
                        out.append((rid, [*e[:_FLAGS], dict(f) if f else None, *e[_FLAGS + 1 :]]))
        return out

    def open_ids(self, phase: sc.OpenPhase, before_ns: int | None = None) -> list[str]:
        """Request ids open in ``phase`` (background reconciliation), those
        that entered it at or before ``before_ns`` when given."""
        with self._lock:
            d = self._by_phase.get(phase.value, {})
            if before_ns is None:
                return list(d)
            out = []
            for rid, e in d.items():
                if e[_PHASE_T] > before_ns:
                    break
                out.append(rid)
            return out

    def __len__(self) -> int:
        return self._n

    # ---------------------------------------------------------------- inside
    def _get(self, rid: str) -> list | None:
        ph = self._where.get(rid)
        return None if ph is None else self._by_phase[ph].get(rid)


def entry_fields(e: list) -> dict[str, Any]:
    """An entry's fields by name (tests, the publisher)."""
    return {
        "phase": e[_PHASE],
        "phase_ns": e[_PHASE_T],
        "start_ns": e[_START],
        "blocks": e[_BLOCKS],
        "flags": e[_FLAGS],
        "join": e[_JOIN],
    }


_tables: dict[tuple[int, str, str], HandoffTable] = {}
_tables_lock = threading.Lock()


def table_for(mode: str, role: str) -> HandoffTable:
    """This process's table of the (``mode``, ``role``) side (fork-safe: a
    child gets its own)."""
    key = (os.getpid(), mode, role)
    t = _tables.get(key)
    if t is None:
        with _tables_lock:
            t = _tables.get(key)
            if t is None:
                t = _tables[key] = HandoffTable(mode, role)
    return t


def tables() -> list[HandoffTable]:
    """This process's tables."""
    pid = os.getpid()
    return [t for (p, _, _), t in list(_tables.items()) if p == pid]
