"""``kvlens demo``'s live part: a mixed fleet (``kvlens up --mode push,pull``:
one push pair and one pull pair behind one kvlens router at split push=0.5)
serving a gentle load, a real Prometheus scraping its router and all four
engines, the dashboard on the same store, and the closing words: the live
verdict and the what-if, next to the grid's verdict.

Why a fleet of its own after the grid, not the grid on the mixed fleet: the
grid is ``kvlens bench``'s (one mode per stack, ABBA rounds), whose figures
are taken with only the benched pair on the machine; on a mixed fleet the
idle pair's engines and NIXL threads would share the 2 cores with every
cell, and the push sequential variant would need a second router. The live
part answers the other question, on the same traffic at the same time: the
canary. Its cost is one start of four servers.

The closing words are printed once the live part has enough requests for a
ratio (:data:`kvtrace.stats.MIN_PER_STRATUM` of each mode in a prompt-length
bucket), and again when it stops; a figure that is not known reads
"unknown" or "not enough data", never 0.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from typing import Sequence

from kvlens import dashboard_cmd
from kvlens.bench.report import WIDTH, wrap
from kvlens.signals import sigterm_as_interrupt
from kvrecord.location import StoreLocation
from kvrecord.ports import port_in_use
from kvtrace import stats, store

#: the live part's load: one request this often (seconds), one at a time, this long at most
LIVE_INTERVAL_S = 3.0
LIVE_OUTPUT_LEN = 8
LIVE_TIMEOUT_S = 60.0
#: the mixed fleet's push weight (the router's default, named here because the words print it)
LIVE_SPLIT = 0.5
DEFAULT_PROMETHEUS_PORT = 9090
#: how often the live part looks for enough data for its first verdict, and for a server that exited
WATCH_EVERY_S = 10.0


class GentleLoad(threading.Thread):
    """The live part's background load: one small completion through
    ``router_url`` every ``interval_s`` seconds, one at a time (a slow answer
    delays the next, never piles up), until :meth:`stop`. Counts what came
    back; never raises (a daemon thread: it cannot outlive the demo)."""

    def __init__(self, router_url: str, api_key: str | None, interval_s: float) -> None:
        super().__init__(name="kvlens-demo-load", daemon=True)
        self.url = router_url.rstrip("/") + "/v1/completions"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.interval_s = interval_s
        self.ok = self.failed = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        import httpx

        from kvrecord.ids import new_trace_id

        with httpx.Client(timeout=LIVE_TIMEOUT_S) as client:
            n = 0
            while not self._stop_event.is_set():
                n += 1
                body = {
                    "prompt": f"live request {n}: " + "the handoff of a prompt's KV cache " * (4 + n % 12),
                    "max_tokens": LIVE_OUTPUT_LEN,
                    "temperature": 0.0,
                    "stream": n % 4 != 0,  # the router measures TPOT on streams
                }
                try:
                    r = client.post(self.url, json=body, headers={"X-Request-Id": new_trace_id(), **self.headers})
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.ok, self.failed = self.ok + ok, self.failed + (not ok)
                self._stop_event.wait(self.interval_s)

    def stop(self, timeout_s: float = LIVE_TIMEOUT_S) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout_s)


def prometheus_port(asked: int | None) -> int:
    """The port asked for, else :data:`DEFAULT_PROMETHEUS_PORT` when free, else 0 (a free one)."""
    if asked is not None:
        return asked
    return 0 if port_in_use(DEFAULT_PROMETHEUS_PORT) else DEFAULT_PROMETHEUS_PORT


def start_fleet(opts, home):
    """Start the live part's mixed fleet (one push pair, overlapped, and one
    pull pair behind one router at :data:`LIVE_SPLIT`) on the grid's model
    and store; a failed start stops what it started and raises (StackError)."""
    from kvlens.stack.launch import Stack

    stack = Stack(
        mode="push,pull",
        dispatch="overlapped",
        model=opts.model,
        port=None,
        kvlens_home=home,
        vllm_args=[] if opts.prefix_caching else ["--no-enable-prefix-caching"],
        api_key=opts.api_key,
        split=LIVE_SPLIT,
    )
    return stack.start()


# ------------------------------------------------------------------ the closing words
def _s(v: float | None) -> str:
    return "unknown" if v is None else f"{v * 1000:.1f} ms" if v < 10 else f"{v:.2f} s"


def _ago(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m} min {s} s" if m else f"{s} s"


def _whatif_line(w) -> str:
    """One what-if in words: the other mode's predicted p50s, and the measured ones beside them."""
    head = f"from the {w.used} {w.from_mode} requests, had they run {w.to_mode}"
    if w.status != "ok":
        return f"{head}: {stats.NOT_ENOUGH} ({w.note})"
    parts, measured = [], []
    for key, name, fig in (("handoff", "handoff", w.handoff), ("ttft", "TTFT", w.ttft)):
        pred = "unknown" if fig.p50 is None else f"{_s(fig.p50)} [{_s(fig.lo)} to {_s(fig.hi)}]"
        parts.append(f"{name} p50 {pred}")
        m = w.measured_to.get(f"{key}_p50_s")
        if m is not None:
            inside = w.measured_to.get(f"{key}_in_interval")
            where = "" if inside is None else " (inside the interval)" if inside else " (outside the interval)"
            measured.append(f"{name} p50 {_s(m)}{where}")
    tail = f"; {w.to_mode} measured here: {', '.join(measured)}" if measured else f"; no {w.to_mode} measured here"
    return f"{head}: {', '.join(parts)}{tail}"


def _in_short(v) -> str:
    """The live verdict in one sentence: which figures push is faster or slower on, which it cannot tell."""
    from kvtrace import verdict as kv_verdict

    said, by = [], {stats.NO_DIFFERENCE: [], stats.NOT_ENOUGH: []}
    for key, _, _, words in kv_verdict.METRICS:
        r = v.ratios[key]
        if r.status == stats.RESOLVED:
            said.append(f"push {'faster' if r.hi < 1 else 'slower'} on {words} ({r.ratio:.2f}x pull's)")
        else:
            by.setdefault(r.status, []).append(words)
    said += [f"{status} on {', '.join(names)}" for status, names in by.items() if names]
    if not any(v.ratios[k].status == stats.RESOLVED for k, *_ in kv_verdict.METRICS):
        said.append("more requests narrow the intervals: leave it running")
    return "; ".join(said)


def closing_words(loc: StoreLocation, since_ns: int, elapsed_s: float, grid: Sequence[str]) -> tuple[str, bool]:
    """The live verdict, the what-if both ways, and the grid's verdict, in
    words; and whether the live verdict had enough data for a ratio. Reads
    the store (the caller's thread); a store error is said, not raised."""
    from kvtrace import verdict as kv_verdict
    from kvtrace import whatif as kv_whatif

    try:
        with store.reading(loc) as conn:
            v = kv_verdict.from_store(conn, since_ns=since_ns)
            ws = [kv_whatif.from_store(conn, since_ns, m) for m in ("pull", "push")] if v.used else []
    except store.StoreError as e:
        return f"kvlens demo: no live verdict: the trace store cannot be read ({e})", False
    out = [
        f"\n== the live verdict: push vs pull on the mixed fleet's own traffic, the {_ago(elapsed_s)} since it "
        "started =="
    ]
    if v.selection == "split":
        out.append(
            "(the router drew each request's mode at random, so both modes served the same traffic at the same "
            "time; kvlens verdict and kvlens whatif give the same in full)"
        )
    enough = False
    if v.status != "ok":
        out.append(f"  {v.message}")
    else:
        n = {m: sum(c.values()) for m, c in v.counts.items()}
        buckets = ", ".join(
            f"{b} {v.counts['push'][b]}/{v.counts['pull'][b]}"
            for b in kv_verdict.bucket_names()
            if v.counts["push"][b] or v.counts["pull"][b]
        )
        out.append(
            f"  requests compared: {n['push']} push, {n['pull']} pull ({v.selection_words()}; push/pull per prompt "
            f"length: {buckets}; a ratio needs {stats.MIN_PER_STRATUM} of each in a bucket)"
        )
        out.append(
            "  push/pull ratio, 95% interval (below 1: push faster; an interval holding 1: no resolvable difference):"
        )
        for key, _, _, words in kv_verdict.METRICS:
            out.append(f"    {words:<12} {kv_verdict.ratio_words(v.ratios[key])}")
        out.append(f"  in short: {_in_short(v)}")
        cw = kv_verdict.cpu_words(v)
        out.append(f"  CPU: {cw}" if cw else "  CPU: no request carries CPU figures (kvlens.cpu.*): unknown")
        enough = v.ratios["ttft_p50"].status != stats.NOT_ENOUGH
    if ws:
        out.append(
            "  what-if, each mode predicted from the other's traces (a model: where it disagrees with the measured "
            "verdict above, the verdict holds; docs/verdict.md):"
        )
        out += [f"    {_whatif_line(w)}" for w in ws]
    if grid:
        out.append("  the grid's verdict, for comparison (synthetic load, one mode per stack, before the live part):")
        out += [f"    {line}" for line in grid]
    return "\n".join(out), enough


class Watch(threading.Thread):
    """Every :data:`WATCH_EVERY_S`: prints the closing words once the live
    part has data for a ratio, and says once which server exited (the other
    half goes on serving). Never raises (daemon)."""

    def __init__(self, stack, loc: StoreLocation, grid: Sequence[str]) -> None:
        super().__init__(name="kvlens-demo-watch", daemon=True)
        self.stack, self.loc, self.grid = stack, loc, list(grid)
        self.t0, self.since_ns = time.monotonic(), time.time_ns()
        self._stop_event = threading.Event()

    def words(self) -> str:
        return fit(closing_words(self.loc, self.since_ns, time.monotonic() - self.t0, self.grid)[0])

    def run(self) -> None:
        printed = dead = False
        while not self._stop_event.wait(WATCH_EVERY_S):
            try:
                c = None if dead else self.stack.dead_child()
                if c is not None:
                    dead = True
                    print(
                        f"kvlens demo: warning: {c.name} exited ({c.proc.returncode}); requests of its mode fail "
                        f"with an error naming it, the other mode's go on (its log: {c.log})",
                        file=sys.stderr,
                        flush=True,
                    )
                if not printed:
                    text, printed = closing_words(self.loc, self.since_ns, time.monotonic() - self.t0, self.grid)
                    if printed:
                        print(fit(text) + "\n(printed again when the demo stops)", flush=True)
            except Exception as e:  # noqa: BLE001 - the live part goes on without its words
                print(f"kvlens demo: warning: live verdict failed: {e!r}", file=sys.stderr, flush=True)
                printed = True

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(30)


def fit(text: str) -> str:
    """``text`` with every line over the report's width wrapped at spaces, its indent kept."""
    return "\n".join(x if len(x) <= WIDTH else wrap(x, indent="") for x in text.splitlines())


def _say_live(stack, prom, loc: StoreLocation, args: argparse.Namespace) -> None:
    """The live part's banner: what runs where, and what comes next."""
    if prom is not None:
        jobs = ", ".join(f"{job} ({len(t)})" for job, t in prom.targets.items())
        where = f"  Prometheus:          {prom.url}  (scraping {jobs}; kvlens recording rules loaded)\n"
    else:
        where = "  Prometheus:          not running (see the warning above)\n"
    head = (
        "kvlens demo: live. A mixed fleet, one push pair and one pull pair behind one router that "
        f"sends each request to push with weight {LIVE_SPLIT:g}, keeps serving one request every "
        f"{args.live_interval:g} s:"
    )
    tail = (
        "The live verdict and the what-if print once both modes have served enough requests, and again "
        "at the end. Ctrl-C stops the dashboard, the load, Prometheus and the fleet."
    )
    print(
        "\n"
        + wrap(head, indent="")
        + "\n"
        + f"  router (OpenAI API): {stack.router_url}/v1  (split: {stack.router_url}/admin/split)\n"
        + where
        + f"  dashboard:           http://localhost:{args.dashboard_port}  (the live verdict first; live "
        f"figures from {'Prometheus' if prom is not None else 'the trace store'}, traces from {loc})\n"
        f"  stack:               {stack.log_dir}/stack.json\n" + wrap(tail, indent=""),
        flush=True,
    )


def live(stack, loc: StoreLocation, args: argparse.Namespace, grid: Sequence[str]) -> int:
    """The live part on ``stack`` (the mixed fleet, running): Prometheus, the
    load, the watch, the dashboard; blocks until Ctrl-C / SIGTERM (then 0),
    stops everything it started and the stack, also on an error, then prints
    the closing words. Main thread."""
    from exporters.prometheus_server import PrometheusError

    load = watch = None
    try:
        with sigterm_as_interrupt():
            # NIXL's spinning progress threads back to SCHED_IDLE: on 2 cores they left the dashboard
            # no CPU (its first page took minutes); the grid's figures were taken before this
            if stack.progress is not None and stack.progress.idle_again():
                print("kvlens demo: NIXL progress threads set to SCHED_IDLE for the live part", flush=True)
            prom = None
            try:
                prom = stack.start_prometheus(prometheus_port(args.prometheus_port))
            except (PrometheusError, ValueError) as e:  # the dashboard still shows the store
                print(
                    f"kvlens demo: warning: could not start Prometheus ({e}); the dashboard's figures come from "
                    "the trace store only (no lost spans, no TPOT)",
                    file=sys.stderr,
                    flush=True,
                )
            load = GentleLoad(stack.router_url, stack.router_key, args.live_interval)
            watch = Watch(stack, loc, grid)
            load.start()
            watch.start()
            _say_live(stack, prom, loc, args)
            url = prom.url if prom is not None else None
            ns = argparse.Namespace(store=loc, prometheus=url, port=args.dashboard_port, host="127.0.0.1")
            return int(dashboard_cmd.run(ns) or 0)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM before the dashboard took the signals over
        return 0
    finally:
        with contextlib.suppress(KeyboardInterrupt):
            if load is not None:
                load.stop()
                print(f"kvlens demo: live load stopped ({load.ok} requests served, {load.failed} failed)", flush=True)
            if watch is not None:
                watch.stop()
        from kvlens.bench.runner import stop_stack

        stop_stack(stack)  # Prometheus with it; signals ignored while stopping
        with contextlib.suppress(KeyboardInterrupt):
            if watch is not None:
                try:
                    print(watch.words(), flush=True)
                except Exception as e:  # noqa: BLE001 - the demo still stops cleanly
                    print(f"kvlens demo: warning: live verdict failed: {e!r}", file=sys.stderr, flush=True)
        print("kvlens demo: stopped", flush=True)
