"""The link delayer of ``kvlens up --hosts``: one process per delayed
direction, run in the sending network namespace, reading the nfqueue that
an ``iptables ... -j NFQUEUE --queue-num N --queue-bypass`` rule feeds (the
kernel here has no ``netem``: docs/links.md).

``python -m kvlens.stack.delayer --queue N --control FILE`` binds queue
``N`` in ``COPY_META`` mode (the kernel sends only the packet's metadata;
the verdict releases the packet it kept) and accepts each packet at its
arrival + delay ± jitter, in arrival order (a FIFO whose release times
never go backwards: :func:`~kvlens.stack.linkspec.release_time`). The
delay and jitter are read from ``FILE`` (JSON ``{"delay_s", "jitter_s"}``)
at start and again whenever it changes, so a running stack's link can be
re-shaped without a restart. When this process dies the rule's
``--queue-bypass`` lets packets pass undelayed; the stack notices the death
and says so.

Threads: the main thread receives (fnfqueue's reader thread fills it); one
releaser thread sleeps until the head packet is due and accepts it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import socket
import sys
import threading
import time

from kvlens.stack.linkspec import release_time

#: Most packets the kernel holds for this queue (200 Mbit/s x 1 s of 1.5 kB
#: packets is ~17k; with GSO on, far fewer); beyond it fail-open accepts.
QUEUE_MAXLEN = 65536
#: The nfqueue netlink socket's receive buffer, bytes (SO_RCVBUFFORCE: root may exceed rmem_max).
NETLINK_RCVBUF = 32 * 1024 * 1024
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
#: How often the releaser looks at the control file when idle, seconds.
CONTROL_POLL_S = 0.2


class Delayer:
    """The FIFO between receive and verdict. ``accept(pkt)`` is called on
    the releaser thread at each packet's release time."""

    def __init__(self, control: str, accept=lambda pkt: pkt.accept(), seed: int | None = None) -> None:
        self.control = control
        self.accept = accept
        self.rng = random.Random(seed)
        self.delay_s = self.jitter_s = 0.0
        self._mtime = None
        self._last = 0.0
        self._fifo: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self.received = self.released = 0
        self._reload()

    def _reload(self) -> None:
        try:
            mtime = os.stat(self.control).st_mtime_ns
            if mtime == self._mtime:
                return
            got = json.loads(open(self.control).read())
            self.delay_s, self.jitter_s = float(got.get("delay_s", 0)), float(got.get("jitter_s", 0))
            self._mtime = mtime
            print(f"delayer: delay {self.delay_s * 1e3:g} ms, jitter {self.jitter_s * 1e3:g} ms", flush=True)
        except (OSError, ValueError, TypeError, AttributeError) as e:
            print(f"delayer: cannot read {self.control}: {e}; keeping the last settings", flush=True)
            self._mtime = None

    def push(self, pkt, now: float | None = None) -> None:
        """Queue ``pkt`` arrived ``now`` (monotonic seconds). Any thread."""
        now = time.monotonic() if now is None else now
        with self._cond:
            self._last = release_time(now, self._last, self.delay_s, self.jitter_s, self.rng.random())
            self._fifo.append((self._last, pkt))
            self.received += 1
            self._cond.notify()

    def run_releaser(self, stop: threading.Event) -> None:
        next_poll = 0.0
        while not stop.is_set():
            with self._cond:
                now = time.monotonic()
                if now >= next_poll:
                    self._reload()
                    next_poll = now + CONTROL_POLL_S
                if not self._fifo:
                    self._cond.wait(CONTROL_POLL_S)
                    continue
                due, pkt = self._fifo[0]
                if due > now:
                    self._cond.wait(min(due - now, CONTROL_POLL_S))
                    continue
                self._fifo.popleft()
            self.accept(pkt)  # outside the lock: a verdict is a netlink send
            self.released += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvlens.stack.delayer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--queue", type=int, required=True, help="the nfqueue number the NFQUEUE rule feeds")
    ap.add_argument("--control", required=True, help="JSON file with delay_s and jitter_s, re-read on change")
    args = ap.parse_args(argv)
    import fnfqueue  # the optional extra kvlens[links]

    conn = fnfqueue.Connection(packet_size=4096)  # metadata only (COPY_META): small buffers
    # a deep netlink receive buffer: at 200 Mbit/s a burst overflowed the default one (packets lost)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, fileno=os.dup(conn._conn.fd)) as s:
        s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, NETLINK_RCVBUF)
    q = conn.bind(args.queue)
    q.set_mode(fnfqueue.MAX_PAYLOAD, fnfqueue.COPY_META)
    q.set_maxlen(QUEUE_MAXLEN)
    q.gso = True  # whole GSO packets: the kernel need not segment them for us (no payload is copied)
    q.fail_open = True
    d = Delayer(args.control)
    stop = threading.Event()
    rel = threading.Thread(target=d.run_releaser, args=(stop,), name="releaser", daemon=True)
    rel.start()
    signal.signal(signal.SIGTERM, lambda *_: conn.close())
    print(f"delayer: queue {args.queue} bound (pid {os.getpid()})", flush=True)
    while True:
        try:
            for pkt in conn:
                d.push(pkt)
            break
        except fnfqueue.BufferOverflowException:
            print("delayer: netlink buffer overflow; packets were lost", file=sys.stderr, flush=True)
            conn.reset()
    stop.set()
    print(f"delayer: stopped after {d.received} packets", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
