"""Injected CPU contention (issue 41's known answer): one process per CPU,
pinned to it, busy ``--busy-ms`` of every ``--period-ms``, for ``--seconds``.

``--fifo`` runs it SCHED_FIFO (priority 1): it takes its share of the CPU
from every normal thread, whatever their session (autogroups) or nice
level. Without it the hog is a plain busy process: with the kernel's
autogroups a process in another session gets only its session's share.

Safe by construction: a parent-death signal (the test dies, the hog dies),
a hard deadline of its own, and the kernel's RT throttle (95 % by default)
on top; the test stops it by PID.

    python tests/cpuhog.py --cpu 0 --busy-ms 30 --period-ms 40 --seconds 20 --fifo
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvrecord.guard import parent_death_signal  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", type=int, required=True, help="the CPU to hold")
    p.add_argument("--busy-ms", type=float, default=30.0, help="busy ms per period (default 30)")
    p.add_argument("--period-ms", type=float, default=40.0, help="period, ms (default 40)")
    p.add_argument("--seconds", type=float, required=True, help="how long, then exit")
    p.add_argument("--fifo", action="store_true", help="SCHED_FIFO priority 1 (needs root or CAP_SYS_NICE)")
    a = p.parse_args(argv)
    if not 0 < a.busy_ms < a.period_ms:
        p.error("--busy-ms must be > 0 and < --period-ms")
    parent_death_signal(signal.SIGKILL)
    os.sched_setaffinity(0, {a.cpu})
    if a.fifo:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    print("ready", flush=True)
    end = time.monotonic() + a.seconds
    busy, period = a.busy_ms / 1e3, a.period_ms / 1e3
    while (now := time.monotonic()) < end:
        stop = now + busy
        while time.monotonic() < stop:
            pass
        time.sleep(max(period - busy, 0.0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
