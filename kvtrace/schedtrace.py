"""The kernel's own record of when each thread ran and when it waited for a
CPU, and the critical path through it (docs/phases.md, "The kernel's
record").

Per-thread counters read at phase boundaries (:mod:`kvrecord.cpuclock`)
cannot place a wait in a thread kvlens does not run when it matters: vLLM's
API server, the router's event loop woken by another process. The kernel
can: its ``sched_switch`` and ``sched_wakeup`` tracepoints say when every
thread went on and off a CPU, whether it left runnable (preempted) or
blocked, and which thread woke it, in which context. ``kvlens up
--sched-trace`` (:mod:`kvlens.stack.schedrec`) has the kernel record them
in a tracefs instance of its own; this module reads the instance's text
(``sched.trace`` once the recording stopped, the live buffer while it
runs).

:meth:`Timeline.walk` follows a phase's critical path backwards from the
thread that stamped its end: a run is CPU work, a runnable stretch before it
is CPU wait; a thread that was preempted was working before, so the walk
stays with it; a thread that was woken was blocked before, so the walk moves
to the thread that woke it, where the wake-up came from a thread (in process
context, or in a softirq run by a thread of the stack: a local socket's
send). A wake-up by an interrupt (a timer, a packet from another host, the
idle task) ends the walk: what lies before it in the phase was waiting for
something outside the stack's threads, off-CPU (the wire, a peer, a timer).

A thread that polls (NIXL's progress thread, the engine loop waiting for
DONE inside a transfer) is never woken: the walk cannot see what it polled
for, and its CPU wait while the thing had not arrived is not the path's. The
transfer itself (``*.wire``) and push's notification to D (``write.notify``)
are therefore not walked (:data:`kvtrace.cpusplit.POLLED`). Where the
recording also kept the kernel's TCP tracepoints (:attr:`Timeline.net`),
what a poller polls for can be seen: a segment with data reaching a socket
(``tcp_probe``, in the receiving softirq) and the next read from that socket
(``tcp_rcv_space_adjust``, by the thread that read it). Between the two the
data waited for its reader; the stretches of it the reader spent runnable,
not running, are the transfer's CPU wait (:meth:`Timeline.starved_ns`);
so are those of the thread that answers a message its process read from a
socket, until its first send there (``sock_send_length``:
UCX's rendezvous turned round, on one host the KV copied between the
processes first: :attr:`Timeline.turns`). A
poller's wait while nothing had arrived is not counted, and that stretch
is not called the wire's either: the peer's own work, or a sender starved
while its socket had room with no message to answer, leave the socket
empty too (:func:`kvtrace.cpusplit.polled_figures` counts it unknown).

No I/O at import; :func:`load` reads the record.
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, NamedTuple

#: The recording's metadata file, beside the record (written by the recorder).
META = "sched.json"
#: The record, as the kernel's trace text, written when the recording stops.
TEXT = "sched.trace"
#: Written by the recorder's holder once the kernel records: its pid (its mount namespace holds tracefs).
READY = "sched.ready"
#: Written by the holder where the kernel's TCP tracepoints are on too (``tcp_probe``, ``tcp_rcv_space_adjust``).
NET = "sched.net"
#: Where tracefs is (mounted by the holder, in its own mount namespace, where it is not).
TRACEFS = "/sys/kernel/tracing"
#: trace flag bits (the kernel's ``trace_flag_type``): a wake-up in one of these contexts came from an interrupt.
FLAG_HARDIRQ, FLAG_SOFTIRQ, FLAG_NMI = 0x08, 0x10, 0x40
#: The trace text's hardirq/softirq column (the flags' third character) -> those bits.
_CONTEXT = {"h": FLAG_HARDIRQ, "H": FLAG_HARDIRQ | FLAG_SOFTIRQ, "s": FLAG_SOFTIRQ, "z": FLAG_NMI, "Z": FLAG_NMI}
#: A span's timestamp (``time.time_ns`` in user space) may fall this far after its thread's run ended in the
#: record (the record's clock is CLOCK_MONOTONIC, to the microsecond, moved to the wall clock by one offset)
STAMP_SLACK_NS = 200_000
#: One event of the trace text with ``record-tgid``: ``comm-tid (tgid) [cpu] flags secs.usecs: event: fields``.
_LINE = re.compile(r"^\s*(.*)-(\d+)\s+\(\s*([-\d]+)\)\s+\[(\d+)\]\s+(\S+)\s+(\d+)\.(\d+):\s+(\w+):\s+(.*)$")
_FIELD = re.compile(r"(\w+)=(\S+)")
_LOST = re.compile(r"CPU:(\d+) \[LOST (\d+) EVENTS\]")
#: ``sock_send_length``'s socket address and the bytes sent (0 where the send failed or sent nothing)
_SEND = re.compile(r"sk address = (\S+?),.*?length = (\d+)")


class SchedUnavailable(Exception):
    """No kernel record to read: the reason, in words."""


class Walk(NamedTuple):
    """One phase's critical path through the kernel's record (ns)."""

    on_ns: int
    wait_ns: int
    #: where the walk stopped: the phase's start, or an interrupt's wake-up (before it: off-CPU)
    stop_ns: int
    #: the threads it went through, last first
    tids: tuple[int, ...]


@dataclass
class Timeline:
    """Every thread's runs, runnable waits and wake-ups, on the wall clock (ns)."""

    #: tid -> sorted (start, end) on a CPU
    runs: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    #: tid -> sorted (start, end) runnable, not running
    waits: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    #: tid -> sorted (t, waker tid, flags) where it became runnable (waker == tid: preempted)
    readies: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    #: tid -> its process id
    tgid: dict[int, int] = field(default_factory=dict)
    #: the processes whose threads a softirq wake-up may be followed into (the stack's)
    own: frozenset[int] = frozenset()
    first_ns: int = 0
    last_ns: int = 0
    #: events the kernel could not record (its ``[LOST n EVENTS]`` lines): a walk across them may stop early
    lost: int = 0
    #: switch-outs of a thread whose switch-in the record does not hold (once in ~40 runs under a SCHED_FIFO
    #: hog here, a thread migrated to the other CPU): no wait is counted across such a gap; a walk stops there
    missed: int = 0
    #: tid -> sorted (arrived, read): data reached a socket (the first segment since that socket's last read)
    #: and waited there until this thread read it (the TCP tracepoints; empty without them)
    pending: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    #: whether the TCP tracepoints were recorded (:data:`NET`): without them :meth:`starved_ns` is unknown
    net: bool = False
    #: tid -> sorted (read, sent): a thread of this one's process read data from a socket, and this thread then
    #: sent on that same socket, the first send since (``sock_send_length``, where it was recorded): the stretch
    #: the process owed its peer a reply, that thread's to give (UCX's rendezvous turned round, the KV copied
    #: between processes first on one host). Empty without it. A send that opens an exchange (not a reply)
    #: after a read that wanted none is taken for one: within a crossing, a thread with a send to make that
    #: waits for a CPU delays it all the same
    turns: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._run_starts = {k: [a for a, _ in v] for k, v in self.runs.items()}
        self._wait_ends = {k: [b for _, b in v] for k, v in self.waits.items()}
        self._ready_ts = {k: [x[0] for x in v] for k, v in self.readies.items()}
        self._reads = {k: sorted(r for _, r in v) for k, v in self.pending.items()}

    def covers(self, start_ns: int, end_ns: int) -> bool:
        return self.first_ns <= start_ns and end_ns <= self.last_ns

    def starved_ns(self, tgids: Iterable[int], start_ns: int, end_ns: int) -> int:
        """How long, within ``[start_ns, end_ns]``, a crossing of the
        processes ``tgids`` waited for one of their threads that waited for a
        CPU (runnable, not running): data that had reached a socket waiting
        there for the thread that then read it (:attr:`pending`), and a
        process that had read from a socket and owed its peer a reply on it,
        in the thread that then sent it (:attr:`turns`); the stretches of those that lie in the thread's
        runnable waits, merged over the threads (two starved at once count
        once)."""
        procs = set(tgids)
        cut: list[tuple[int, int]] = []
        for tid in self.pending.keys() | self.turns.keys():
            if self.tgid.get(tid) not in procs:
                continue
            spans = [*self.pending.get(tid, ()), *self.turns.get(tid, ())]
            waits = self.waits.get(tid, [])
            for a, r in spans:
                lo, hi = max(a, start_ns), min(r, end_ns)
                if hi <= lo:
                    continue
                i = bisect.bisect_right(self._wait_ends.get(tid, []), lo)
                while i < len(waits) and waits[i][0] < hi:
                    w0, w1 = max(waits[i][0], lo), min(waits[i][1], hi)
                    if w1 > w0:
                        cut.append((w0, w1))
                    i += 1
        total, reach = 0, start_ns
        for a, b in sorted(cut):
            if b > reach:
                total += b - max(a, reach)
                reach = b
        return total

    def last_read(self, tgids: Iterable[int], start_ns: int, end_ns: int) -> int | None:
        """When a thread of the processes ``tgids`` last read data from a
        socket within ``[start_ns, end_ns]`` (:attr:`pending`'s reads), or
        None: where a polled crossing's data entered the process."""
        procs = set(tgids)
        best = None
        for tid, reads in self._reads.items():
            if self.tgid.get(tid) not in procs:
                continue
            i = bisect.bisect_right(reads, end_ns) - 1
            if i >= 0 and reads[i] >= start_ns and (best is None or reads[i] > best):
                best = reads[i]
        return best

    def _run_before(self, tid: int, t: int) -> tuple[int, int] | None:
        i = bisect.bisect_left(self._run_starts.get(tid, []), t) - 1
        return self.runs[tid][i] if i >= 0 else None

    def _wait_ending(self, tid: int, t: int) -> tuple[int, int] | None:
        ends = self._wait_ends.get(tid, [])
        i = bisect.bisect_left(ends, t)
        if i < len(ends) and ends[i] == t:
            return self.waits[tid][i]
        return None

    def _ready_at(self, tid: int, t: int) -> tuple[int, int, int] | None:
        ts = self._ready_ts.get(tid, [])
        i = bisect.bisect_left(ts, t)
        if i < len(ts) and ts[i] == t:
            return self.readies[tid][i]
        return None

    def _follows(self, waker: int, flags: int) -> bool:
        if waker <= 0 or flags & (FLAG_HARDIRQ | FLAG_NMI):
            return False
        if flags & FLAG_SOFTIRQ:  # a softirq runs on whatever thread it interrupted: only a stack thread's own send
            return self.tgid.get(waker) in self.own
        return True

    def walk(self, tid: int, start_ns: int, end_ns: int, max_hops: int = 100_000) -> Walk:
        """The critical path of ``[start_ns, end_ns]`` backwards from ``tid``,
        the thread that stamped its end (module docstring)."""
        t, cur, on, wait, tids = end_ns, tid, 0, 0, [tid]
        for _ in range(max_hops):
            if t <= start_ns:
                break
            r = self._run_before(cur, t)
            if r is None or r[1] < t - STAMP_SLACK_NS:
                break  # not on a CPU at t: the record does not show who ran the path then
            on += t - max(r[0], start_ns)
            t = r[0]
            if t <= start_ns:
                break
            w = self._wait_ending(cur, t)
            if w is None:
                break  # its switch-in with no runnable stretch before it: the record's first sight of it
            wait += t - max(w[0], start_ns)
            t = w[0]
            rd = self._ready_at(cur, t)
            if rd is None:
                break
            _t, waker, flags = rd
            if waker == cur:
                continue  # preempted: it was running just before
            if not self._follows(waker, flags):
                break  # woken from outside the stack's threads: before this, off-CPU
            cur = waker
            tids.append(cur)
        return Walk(on, wait, max(t, start_ns), tuple(tids))


class _Sockets:
    """The TCP tracepoints while the record is read: data that reached each
    socket (``tcp_probe``, the recorder keeps only segments with data) and
    waited there until a thread read it (``tcp_rcv_space_adjust``); and
    where sends were recorded too (``sock_send_length``, TCP over IPv4
    only), the first send on a socket after a read from it, by whichever
    thread of its process (NIXL's progress thread reads P's request, P's
    worker thread sends the answer)."""

    EVENTS = frozenset({"tcp_probe", "tcp_rcv_space_adjust", "sock_send_length"})

    def __init__(self) -> None:
        self.arrived: dict[str, int] = {}  # socket cookie -> the first data segment since its last read
        #: reader tid -> (arrived, read) (:attr:`Timeline.pending`)
        self.pending: dict[int, list[tuple[int, int]]] = {}
        self.cookie: dict[str, str] = {}  # socket address (hashed, as the kernel prints it) -> its cookie
        self.read: dict[str, int] = {}  # socket cookie -> its last read not yet answered (by any thread)
        #: tid -> (read, sent) (:attr:`Timeline.turns`)
        self.turns: dict[int, list[tuple[int, int]]] = {}

    def event(self, event: str, t: int, tid: int, fields: dict[str, str], rest: str) -> None:
        if event == "sock_send_length":  # "sk address = 0000..., family = AF_INET ..., length = N, error = 0"
            m = _SEND.search(rest)
            cookie = self.cookie.get(m.group(1)) if m is not None and m.group(2) != "0" else None
            r = self.read.pop(cookie, None) if cookie is not None else None
            if r is not None and t > r:
                self.turns.setdefault(tid, []).append((r, t))
            return
        cookie = fields.get("sock_cookie")
        if cookie is None:
            return
        if event == "tcp_probe":
            if (sk := fields.get("skaddr")) is not None:
                self.cookie[sk] = cookie
            if fields.get("data_len", "1") != "0":
                self.arrived.setdefault(cookie, t)
        else:  # this thread read from the socket
            self.read[cookie] = t
            a = self.arrived.pop(cookie, None)
            if a is not None and t > a:
                self.pending.setdefault(tid, []).append((a, t))


def _from(lines: Iterable[str], since: int) -> Iterable[str]:
    """``lines`` from the first whose timestamp (the record's clock) is at or after ``since`` (the text is in
    time order), the ones before it skipped without the full parse."""
    it = iter(lines)
    for line in it:
        t = _stamp_ns(line)
        if t is not None and t >= since:
            yield line
            break
    yield from it


def _stamp_ns(line: str) -> int | None:
    """A trace line's timestamp (the record's clock, ns) without the full parse, or None."""
    j = line.find("] ")
    k = line.find(": ", j)
    if j < 0 or k < 0:
        return None
    secs, _, frac = line[j + 2 : k].rpartition(" ")[2].partition(".")
    return _ns(secs, frac) if secs.isdigit() and frac.isdigit() else None


def _ns(secs: str, frac: str) -> int:
    """The trace text's ``secs.frac`` timestamp in ns."""
    return int(secs) * 1_000_000_000 + int(frac.ljust(9, "0")[:9])


def parse(
    lines: Iterable[str],
    offset_ns: int,
    own: frozenset[int] = frozenset(),
    net: bool = False,
    since_ns: int | None = None,
) -> Timeline:
    """A :class:`Timeline` from the trace text's ``lines`` (``record-tgid``);
    ``offset_ns``: wall clock minus the record's clock (CLOCK_MONOTONIC).
    The record covers the stretch every CPU's events cover (a ring buffer
    that wrapped keeps each CPU's newest); lost events are counted, and so
    are switch-outs whose switch-in is missing (:attr:`Timeline.missed`).
    ``net``: the TCP tracepoints were recorded too (:attr:`Timeline.net`).
    ``since_ns`` (wall clock): lines before it are skipped unparsed (a long
    record read for its newest stretch; a wait that began before it is seen
    from its end only, so leave a margin before the stretch wanted)."""
    if since_ns is not None:
        lines = _from(lines, since_ns - offset_ns)
    runs: dict[int, list] = {}
    waits: dict[int, list] = {}
    readies: dict[int, list] = {}
    tgid: dict[int, int] = {}
    ready: dict[int, int] = {}
    on: dict[int, int] = {}
    first: dict[int, int] = {}
    last = 0
    lost = missed = 0
    seen: set[int] = set()
    sockets = _Sockets()
    for line in lines:
        m = _LINE.match(line)
        if m is None:
            if (x := _LOST.search(line)) is not None:
                lost += int(x.group(2))
            continue
        _comm, cur, tg, cpu, flags, secs, frac, event, rest = m.groups()
        t = _ns(secs, frac) + offset_ns
        first.setdefault(int(cpu), t)
        last = max(last, t)
        if tg.lstrip("-").isdigit() and int(tg) > 0:
            tgid.setdefault(int(cur), int(tg))
        f = dict(_FIELD.findall(rest))
        if event == "sched_switch":
            prev, nxt, state = int(f.get("prev_pid", -1)), int(f.get("next_pid", -1)), f.get("prev_state", "")
            if prev in on:
                runs.setdefault(prev, []).append((on.pop(prev), t))
            elif prev in seen:  # its switch-in is missing from the record (seen here on a migration under load)
                ready.pop(prev, None)  # whatever it waited for ended unseen: no wait across the gap
                missed += 1
            seen.add(prev)
            seen.add(nxt)
            if state.startswith("R") and prev > 0:  # left runnable: preempted (R+) or yielded (R)
                ready[prev] = t
                readies.setdefault(prev, []).append((t, prev, 0))
            if nxt in ready:
                waits.setdefault(nxt, []).append((ready.pop(nxt), t))
            on[nxt] = t
        elif event in _Sockets.EVENTS:
            sockets.event(event, t, int(cur), f, rest)
        elif event in ("sched_wakeup", "sched_wakeup_new"):
            woken = int(f.get("pid", -1))
            seen.add(woken)
            if woken not in ready and woken not in on:
                ctx = _CONTEXT.get(flags[2:3], 0) if len(flags) >= 3 else 0
                ready[woken] = t
                readies.setdefault(woken, []).append((t, int(cur), ctx))
    pending, turns = sockets.pending, sockets.turns
    for d in (runs, waits, readies, pending, turns):
        for v in d.values():
            v.sort()
    return Timeline(
        runs, waits, readies, tgid, frozenset(own), max(first.values(), default=0), last, lost, missed, pending, net,
        turns,
    )  # fmt: skip


def _live(meta: dict) -> Path | None:
    """The live buffer of a recording still running (its holder's mount namespace), if any."""
    holder, instance = meta.get("holder_pid"), meta.get("instance")
    if not holder or not instance:
        return None
    p = Path(f"/proc/{int(holder)}/root{TRACEFS}/instances/{instance}/trace")
    return p if p.exists() else None


def load(folder: Path | str, since_ns: int | None = None) -> Timeline:
    """The kernel record kept in ``folder`` (:data:`META` and :data:`TEXT`,
    or the live buffer of a recording still running), from ``since_ns`` on
    (wall clock; default all of it, :func:`parse`);
    :class:`SchedUnavailable` with the reason where there is none or it
    cannot be read."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError) as e:
        raise SchedUnavailable(f"no kernel scheduler record in {folder} ({e})") from None
    src = folder / TEXT if (folder / TEXT).exists() else _live(meta)
    if src is None:
        raise SchedUnavailable(f"the kernel scheduler record in {folder} has no data (stopped before it was written?)")
    try:
        with open(src, errors="replace") as fh:
            own = frozenset(int(x) for x in meta.get("pids") or ())
            return parse(fh, int(meta["offset_ns"]), own, bool(meta.get("net")), since_ns)
    except (OSError, KeyError, ValueError) as e:
        raise SchedUnavailable(f"cannot read the kernel scheduler record {src}: {e}") from None
