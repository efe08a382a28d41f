"""The span-building sidecar of a vLLM engine process: spans, store writes
and metrics built here, off the engine's GIL (:mod:`exporters.shipping`
says why).

    KVLENS_SIDECAR_SPEC='<spec JSON>' python -m exporters.sidecar <parent pid>

Started by :class:`exporters.shipping.ShippingRecorder` in each vLLM
EngineCore/worker process that records (roles prefill and decode; the
module docstring there says why). It reads the events its parent ships on
stdin (:mod:`exporters.frames` rebuilds them as
:class:`kvrecord.events.Event` s) and hands them to an
ordinary in-process :class:`Recorder` (:meth:`Recorder.enqueue`) built by
:func:`exporters.pipeline.get_recorder` with ``span_builder="inline"``: the
same spans, store rows, OTLP output and metrics as the in-process path,
built here, off the engine's GIL.

Metrics still reach vLLM's ``/metrics``: the sidecar inherits its parent's
environment, ``PROMETHEUS_MULTIPROC_DIR`` included, so its
prometheus_client metrics are written to the directory vLLM's API server
collects from, under the sidecar's pid. At exit it marks itself dead there
(``multiprocess.mark_process_dead``: its ``livesum`` gauges leave the sum;
counters and histograms stay, as for any exited process). The parent's own
losses (buffer full, frames lost) arrive with every frame as totals and are
reported here in ``kvlens_telemetry_dropped_total``.

Lifetime (never orphaned, always bounded): it ends at stdin EOF (the parent
closed its recorder, exited or died), when its parent pid changes (the
kernel's ``PR_SET_PDEATHSIG`` also sends SIGTERM when the parent's thread
that started it dies), and at most :data:`TERM_GRACE_S` after a SIGTERM
(``kvlens up`` stops the whole process group; the grace lets the engine
ship its last events). Then it closes its recorder (bounded,
:data:`CLOSE_S`) and exits. Memory is bounded by the recorder's buffer
(``kvlens_buffer_events``) and one frame.

Trust: stdin is a pipe only the parent holds, so frames are unpickled.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time

from exporters import frames, pipeline
from kvrecord.config import Options
from kvrecord.guard import parent_death_signal
from kvrecord.logutil import log_once
from kvrecord.procstats import mark_process_dead, name_native_thread, write_stats

#: After SIGTERM, read the parent's last events for at most this long.
TERM_GRACE_S = 10.0
#: Bound of the recorder's close at exit (inside the parent's close bound).
CLOSE_S = 4.0
#: Longest wait for room in the recorder's buffer before recording a frame anyway.
ROOM_WAIT_S = 5.0
#: The pipeline must come up within this long (the parent waits a little longer).
SETUP_S = 50.0


class _Term:
    deadline: float | None = None

    def __call__(self, signum, frame) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + TERM_GRACE_S


def _guard_parent(parent: int) -> None:
    """SIGTERM when the parent goes; exit now if it already went."""
    parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:
        sys.exit(0)


class Sidecar:
    """Reads frames from ``fd_in``, records their events, answers flushes on ``out``."""

    def __init__(self, spec: dict, parent: int, fd_in: int, out) -> None:
        self.role = spec["role"]
        self.parent = parent
        self.fd_in = fd_in
        self.out = out
        # the options crossed the process boundary as a dict: checked once more, here
        options = Options.from_config(spec.get("config") or {})
        self.rec = pipeline.get_recorder(
            spec["role"], spec["mode"], spec.get("engine_id"), options, span_builder="inline"
        )
        self.rec.stats_extra = {"sidecar": True}  # its counters are not the engine's (benchmarks/bench_cpu.py)
        self.frames = 0
        self.events = 0

    def handle(self, frame: frames.Frame) -> None:
        self.frames += 1
        if frame.kind == frames.EVENTS:
            pipeline.report_remote_drops(self.role, frame.arg)
            self._room_for(len(frame.events))
            self.rec.enqueue(frame.events)
            self.events += len(frame.events)
        elif frame.kind == frames.FLUSH:
            self.rec.flush()
            self.out.write(f"flushed {frame.arg}\n".encode())
            self.out.flush()

    def _room_for(self, n: int) -> None:
        """Backpressure instead of loss: wait (at most :data:`ROOM_WAIT_S`)
        until the recorder's buffer has room for ``n`` events; meanwhile the
        pipe fills and the engine keeps (or, full, drops and counts) them."""
        rec, end = self.rec, time.monotonic() + ROOM_WAIT_S
        while rec.buffered and rec.buffered + n > rec.capacity and time.monotonic() < end:
            rec.wake()
            time.sleep(0.005)

    def serve(self, term: _Term) -> None:
        buf = bytearray()
        while True:
            if term.deadline is not None and time.monotonic() > term.deadline:
                return
            parent_gone = os.getppid() != self.parent
            ready = select.select([self.fd_in], [], [], 0 if parent_gone else 0.5)[0]
            if not ready:
                if parent_gone:
                    return  # and nothing left to read
                continue
            chunk = os.read(self.fd_in, 1 << 20)
            if not chunk:
                return  # EOF
            buf += chunk
            for payload in frames.payloads(buf):
                try:
                    self.handle(frames.decode(payload))
                except Exception as e:
                    log_once(
                        "sidecar-frame:" + type(e).__name__, "kvlens sidecar skipped a bad frame (%s)", e, exc_info=True
                    )

    def close(self) -> None:
        self.rec.close(CLOSE_S)
        write_stats(self.rec, {"frames": self.frames, "received": self.events}, force=True)


def main(argv: list[str]) -> int:
    spec_text = os.environ.pop(frames.SPEC_ENV, None)
    if len(argv) != 1 or not spec_text or not argv[0].isdigit():
        print(f"usage: {frames.SPEC_ENV}='<spec JSON>' python -m exporters.sidecar <parent pid>", file=sys.stderr)
        return 2
    spec, parent = json.loads(spec_text), int(argv[0])
    _guard_parent(parent)
    term = _Term()
    signal.signal(signal.SIGTERM, term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal goes to the group: the parent decides
    name_native_thread("kvlens-sidecar")
    # the protocol owns stdout; anything a library prints goes to stderr
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    side = Sidecar(spec, parent, 0, out)
    try:
        side.rec.start()
        if not side.rec.wait_ready(SETUP_S) or side.rec.pipeline_failed:
            print(
                f"kvlens sidecar: the telemetry pipeline failed or did not come up within {SETUP_S:.0f}s",
                file=sys.stderr,
            )
            return 1
        out.write(b"ready\n")
        out.flush()
        side.serve(term)
    finally:
        side.close()
        mark_process_dead(os.getpid())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
