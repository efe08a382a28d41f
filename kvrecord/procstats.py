"""Process-level helpers of kvlens' background threads and its span-building
sidecar: native thread names (so per-thread CPU time can be attributed to
kvlens from ``/proc``), the recorders' counters as JSON files for the CPU
benchmark, and clearing an exited sidecar's multiprocess gauges (stopping
it: :class:`kvrecord.children.ChildProcess`)."""

from __future__ import annotations

import ctypes
import json
import os
import time
from typing import Any, Mapping

from kvrecord.logutil import log_once

#: Directory where recorders write their counters as JSON (``<role>-<pid>.json``,
#: at most once a second and at close) when set: how ``benchmarks/bench_cpu.py``
#: counts the events recorded inside vLLM's processes. Unset: nothing written.
STATS_DIR_ENV = "KVLENS_RECORDER_STATS"


def name_native_thread(name: str) -> None:
    """Give the calling thread ``name`` (first 15 bytes) as its OS name too
    (``/proc/<pid>/task/<tid>/comm``): Python 3.11 names only its own
    object, and the CPU benchmark attributes threads to kvlens by this name.
    Linux only; a failure is ignored."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:
        pass


def write_stats(rec: Any, extra: Mapping[str, Any] | None = None, force: bool = False) -> None:
    """Write ``rec``'s counters (and its ``stats_extra`` dict, if any) to
    :data:`STATS_DIR_ENV` (when set), at most once a second unless ``force``.
    Errors are logged once."""
    d = os.environ.get(STATS_DIR_ENV)
    if not d:
        return
    now = time.monotonic()
    if not force and now < getattr(rec, "_stats_next", 0.0):
        return
    rec._stats_next = now + 1.0
    out = {
        "pid": os.getpid(),
        "role": rec.role,
        "mode": rec.mode,
        "engine_id": rec.engine_id,
        "recorded": rec.recorded,
        "exported": rec.exported,
        "dropped": rec.dropped,
        "shutdown_dropped": rec.shutdown_dropped,
        "failed_dropped": rec.failed_dropped,
        **getattr(rec, "stats_extra", {}),
        **(extra or {}),
    }
    losses = getattr(rec, "losses", None)
    if losses is not None:
        out["processor_lost"] = sum(losses.counts().values())
    try:
        path = os.path.join(d, f"{rec.role}-{os.getpid()}-{id(rec):x}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(out, f)
        os.replace(path + ".tmp", path)
    except Exception:
        log_once("recorder-stats", "could not write recorder stats to %s", d, exc_info=True)


def mark_process_dead(pid: int) -> None:
    """Remove the live gauges of ``pid`` (a sidecar that exited) from the
    Prometheus multiprocess directory, when there is one: prometheus_client
    keeps ``livesum`` files per pid until told."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    try:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
    except Exception:
        log_once("mark-dead", "could not clean the sidecar's multiprocess metrics", exc_info=True)
