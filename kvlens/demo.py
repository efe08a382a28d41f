"""``kvlens demo`` (what ``make demo`` runs): the whole story on one machine.

1. generate the tiny random-weight model under ``$KVLENS_HOME/model``;
2. bench a small grid in two rounds, push and pull in ABBA order
   (``kvlens bench --repeat 2``): pull's stack, then push's (overlapped and
   sequential routers), which also serves round 2, then pull's again. Every
   push/pull ratio comes with its 95 % interval over requests and rounds;
3. print the table, what it measured in plain words (computed from the
   rows), the cross-checks, and the slowest traces per mode as waterfalls;
4. the live part (``--no-dashboard``: exit instead): the last stack keeps
   serving a gentle background load (one request every
   ``--live-interval`` seconds, one at a time), a real Prometheus
   (Debian ``prometheus``, :class:`exporters.prometheus_server.PrometheusServer`,
   with kvlens' recording rules) scrapes its P, D and router, and the
   dashboard runs on the same store with ``--prometheus`` pointed at it,
   so its live cards (request rate, lost spans, TPOT) have figures. Ctrl-C
   or SIGTERM stops the dashboard, the load, Prometheus and the stack.

Time budget: about 7 minutes on a 2-core host, stack start-ups included
(the bench part about 4 of them). The rounds split the same 8 requests per
cell and variant as a single round used to send (4 + 4), at the cost of one
more stack start (pull's second); with fresh stacks every round (one more
start again) or more rounds it would not fit. Two rounds on three stack
starts cannot resolve small differences: the closing words say "no
resolvable difference" where the intervals contain 1, which is the true
answer at this size. For a firmer verdict: ``kvlens bench --repeat 3
--fresh-stacks``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time

from kvrecord import config
from kvrecord.location import StoreLocation
from kvlens import dashboard_cmd, traces
from kvlens.bench.cli import add_grid_arguments, options_from_args, quiet_http_logs, run_guarded
from kvlens.bench.grid import (
    DEFAULT_MAX_MODEL_LEN,
    DISPATCHES,
    MODES,
    BenchError,
    BenchOptions,
    model_max_len,
    validate_grid,
)
from kvlens.bench.report import print_report
from kvlens.bench.runner import bench_stacks, new_run
from kvlens.model import ensure_model
from kvlens.signals import sigterm_as_interrupt
from kvrecord.ports import port_in_use

DEMO_QPS = "1,4"
DEMO_INPUT_LEN = "256,2048"
DEMO_OUTPUT_LEN = 16
#: requests per cell and round; x DEMO_REPEAT rounds = 8 per cell and variant
DEMO_NUM_PROMPTS = 4
DEMO_REPEAT = 2
#: the live part's load: one request this often (seconds), one at a time, this long
LIVE_INTERVAL_S = 3.0
LIVE_OUTPUT_LEN = 8
LIVE_TIMEOUT_S = 60.0
DEFAULT_PROMETHEUS_PORT = 9090


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_grid_arguments(
        p,
        qps=DEMO_QPS,
        input_len=DEMO_INPUT_LEN,
        output_len=DEMO_OUTPUT_LEN,
        num_prompts=DEMO_NUM_PROMPTS,
        repeat=DEMO_REPEAT,
    )
    p.epilog = (
        f"Time budget: about 7 minutes on a 2-core host. {DEMO_REPEAT} rounds of {DEMO_NUM_PROMPTS} requests "
        "per cell, push and pull in ABBA order over 3 stack starts; each push/pull ratio comes with its 95% "
        "interval, and an interval that contains 1 reads 'no resolvable difference'. Then, live: the last "
        "stack keeps serving a gentle load, a real Prometheus scrapes it, and the dashboard shows it "
        "until Ctrl-C."
    )
    p.add_argument(
        "--no-dashboard",
        action="store_true",
        help="exit after the report instead of the live part (Prometheus, a gentle load, the dashboard)",
    )
    p.add_argument("--dashboard-port", type=int, default=8501, help="dashboard port (default 8501)")
    p.add_argument(
        "--prometheus-port",
        type=int,
        default=None,
        help=f"the live part's Prometheus port (default {DEFAULT_PROMETHEUS_PORT}, or a free one when it is busy; "
        "0: a free one)",
    )
    p.add_argument(
        "--live-interval",
        type=float,
        default=LIVE_INTERVAL_S,
        metavar="S",
        help=f"the live part's load: one request every S seconds, one at a time (default {LIVE_INTERVAL_S:g})",
    )


def _traces(store: StoreLocation, since_s: float) -> None:
    for mode in ("push", "pull"):
        print(f"\n== slowest {mode} requests of this demo (kvlens traces --slowest 3 --mode {mode}) ==", flush=True)
        ns = argparse.Namespace(
            store=store,
            slowest=3,
            mode=mode,
            outcome=None,
            since=f"{max(1, int(since_s))}s",
            trace=None,
            json=False,
            width=60,
        )
        traces.run(ns)


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


def _prometheus_port(asked: int | None) -> int:
    """The port asked for, else :data:`DEFAULT_PROMETHEUS_PORT` when free, else 0 (a free one)."""
    if asked is not None:
        return asked
    return 0 if port_in_use(DEFAULT_PROMETHEUS_PORT) else DEFAULT_PROMETHEUS_PORT


def _live(stack, store: StoreLocation, args: argparse.Namespace) -> int:
    """The live part on ``stack`` (the bench's last, still running): Prometheus,
    the load, the dashboard; blocks until Ctrl-C / SIGTERM (then 0), stops
    everything it started and the stack, also on an error. Main thread."""
    from exporters.prometheus_server import PrometheusError

    load = None
    try:
        with sigterm_as_interrupt():
            print("\nkvlens demo: live part: starting Prometheus on the last stack", flush=True)
            # NIXL's spinning progress threads back to SCHED_IDLE: on 2 cores they left the dashboard
            # no CPU (its first page took minutes); the bench's figures were taken before this
            if stack.progress is not None and stack.progress.idle_again():
                print("kvlens demo: NIXL progress threads set to SCHED_IDLE for the live part", flush=True)
            prom = None
            try:
                prom = stack.start_prometheus(_prometheus_port(args.prometheus_port))
            except (PrometheusError, ValueError) as e:  # the dashboard still shows the store
                print(
                    f"kvlens demo: warning: could not start Prometheus ({e}); the dashboard's figures come from "
                    "the trace store only (no lost spans, no TPOT)",
                    file=sys.stderr,
                    flush=True,
                )
            load = GentleLoad(stack.router_url, getattr(stack, "api_key", None), args.live_interval)
            load.start()
            if prom is not None:
                jobs = ", ".join(f"{job} ({len(t)})" for job, t in prom.targets.items())
                where = f"  Prometheus:          {prom.url}  (scraping {jobs}; kvlens recording rules loaded)\n"
            else:
                where = "  Prometheus:          not running (see the warning above)\n"
            print(
                f"\nkvlens demo: live. The {stack.mode} stack keeps serving one request every "
                f"{args.live_interval:g} s:\n"
                f"  router (OpenAI API): {stack.router_url}/v1\n"
                + where
                + f"  dashboard:           http://localhost:{args.dashboard_port}  (live figures from "
                f"{'Prometheus' if prom is not None else 'the trace store'}, traces from {store})\n"
                "Ctrl-C stops the dashboard, the load, Prometheus and the stack.",
                flush=True,
            )
            url = prom.url if prom is not None else None
            ns = argparse.Namespace(store=store, prometheus=url, port=args.dashboard_port, host="127.0.0.1")
            return int(dashboard_cmd.run(ns) or 0)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM before the dashboard took the signals over
        return 0
    finally:
        with contextlib.suppress(KeyboardInterrupt):
            if load is not None:
                load.stop()
                print(f"kvlens demo: live load stopped ({load.ok} requests served, {load.failed} failed)", flush=True)
        from kvlens.bench.runner import _stop

        _stop(stack)  # Prometheus with it; signals ignored while stopping
        print("kvlens demo: stopped", flush=True)


def _check(args: argparse.Namespace) -> BenchOptions:
    """The demo's options; BenchError before anything is generated or started."""
    opts = options_from_args(args)
    validate_grid(
        modes=list(MODES),
        dispatches=list(DISPATCHES),
        qps=opts.qps,
        input_lens=opts.input_lens,
        output_len=opts.output_len,
        num_prompts=opts.num_prompts,
        max_model_len=model_max_len(opts.model) or DEFAULT_MAX_MODEL_LEN,
        repeat=opts.repeat,
    )
    if not 0 < args.dashboard_port < 65536:
        raise BenchError(f"invalid --dashboard-port {args.dashboard_port}")
    if args.prometheus_port is not None and not 0 <= args.prometheus_port < 65536:
        raise BenchError(f"invalid --prometheus-port {args.prometheus_port} (0: a free one)")
    if not 0.1 <= args.live_interval <= 3600:
        raise BenchError(f"--live-interval must be between 0.1 and 3600 seconds, got {args.live_interval:g}")
    return opts


def _announce(opts: BenchOptions) -> None:
    n_cells = len(opts.qps) * len(opts.input_lens)
    print(
        f"kvlens demo: push (overlapped, sequential) vs pull on a real P/D pair; {n_cells} cells per variant "
        f"(QPS {','.join(f'{q:g}' for q in opts.qps)} x input {','.join(map(str, opts.input_lens))} tokens), "
        f"{opts.repeat} round{'s' if opts.repeat > 1 else ''} (push and pull in ABBA order) of "
        f"{opts.num_prompts} requests each, {opts.output_len} output tokens, prefix caching "
        f"{'on' if opts.prefix_caching else 'off'}; budget about 7 minutes on 2 cores",
        flush=True,
    )


def run(args: argparse.Namespace) -> int:
    quiet_http_logs(args)
    try:
        opts = _check(args)
    except BenchError as e:
        print(f"kvlens demo: error: {e}", file=sys.stderr, flush=True)
        return 2

    t0 = time.time()
    if opts.model is None:
        print(f"kvlens demo: tiny model at {config.model_dir()} (generated on first use)", flush=True)
        opts.model = ensure_model(config.model_dir())
    _announce(opts)
    run_ = new_run(opts)
    live = not args.no_dashboard
    code = None
    try:
        code = run_guarded(
            "demo", run_, lambda: bench_stacks(list(MODES), list(DISPATCHES), opts, run=run_, keep_last=live)
        )
        if code is None:
            with sigterm_as_interrupt():
                print_report(run_)
                print(f"(bench part took {time.time() - t0:.0f}s)", flush=True)
                _traces(run_.store, time.time() - t0 + 5)
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        _stop_kept(run_)
        raise
    if code is not None or not live:
        _stop_kept(run_)
        if code is None:
            print(f"\nkvlens demo: done. Browse the results with: kvlens dashboard --store {run_.store}", flush=True)
        return code or 0
    stack, run_.kept_stack = run_.kept_stack, None
    return _live(stack, run_.store, args)


def _stop_kept(run_) -> None:
    from kvlens.bench.runner import _stop

    stack, run_.kept_stack = run_.kept_stack, None
    _stop(stack)
