"""``kvlens demo`` (what ``make demo`` runs): the whole story on one machine.

1. generate the tiny random-weight model under ``$KVLENS_HOME/model``;
2. bench a small grid in two rounds, push and pull in ABBA order
   (``kvlens bench --repeat 2``): pull's stack, then push's (overlapped and
   sequential routers), which also serves round 2, then pull's again. Every
   push/pull ratio comes with its 95 % interval over requests and rounds;
3. print the table, what it measured in plain words (computed from the
   rows), the cross-checks, and the slowest traces per mode as waterfalls;
4. the live part (``--no-dashboard``: exit instead; :mod:`kvlens.demolive`):
   the grid's last stack stops and a mixed fleet starts (``kvlens up --mode
   push,pull``: a push pair and a pull pair behind one router at split
   push=0.5). It serves a gentle load (one request every ``--live-interval``
   seconds, one at a time), a real Prometheus (Debian ``prometheus``, with
   kvlens' recording rules) scrapes its router and four engines, and the
   dashboard runs on the same store with ``--prometheus`` pointed at it,
   opening with the live verdict. The closing words, printed once both modes
   have served enough requests and again at the end: the live verdict and
   the what-if both ways, next to the grid's verdict. Ctrl-C or SIGTERM
   stops the dashboard, the load, Prometheus and the fleet.

Time budget: about 8 minutes on a 2-core host, stack start-ups included
(the bench part about 4 of them, the fleet's start about 1). The rounds
split the same 8 requests per cell and variant as a single round used to
send (4 + 4), at the cost of one more stack start (pull's second); with
fresh stacks every round (one more start again) or more rounds it would not
fit. Two rounds on three stack starts cannot resolve small differences: the
closing words say "no resolvable difference" where the intervals contain 1,
which is the true answer at this size. For a firmer verdict: ``kvlens bench
--repeat 3 --fresh-stacks``; for the canary's: leave the live part running.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import time

from kvrecord import config
from kvrecord.location import StoreLocation
from kvlens import exits, traces
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
from kvlens.bench.report import WIDTH, describe, print_report, wrap
from kvlens.bench.runner import stop_stack, bench_stacks, new_run
from kvlens.demolive import DEFAULT_PROMETHEUS_PORT, LIVE_INTERVAL_S, GentleLoad, live, start_fleet
from kvlens.model import ensure_model
from kvlens.signals import sigterm_as_interrupt
from kvlens.stack.errors import StackError
from kvtrace.benchrows import add_ratios

__all__ = ["GentleLoad", "add_arguments", "run"]

DEMO_QPS = "1,4"
DEMO_INPUT_LEN = "256,2048"
DEMO_OUTPUT_LEN = 16
#: requests per cell and round; x DEMO_REPEAT rounds = 8 per cell and variant
DEMO_NUM_PROMPTS = 4
DEMO_REPEAT = 2


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
        f"Time budget: about 8 minutes on a 2-core host. {DEMO_REPEAT} rounds of {DEMO_NUM_PROMPTS} requests "
        "per cell, push and pull in ABBA order over 3 stack starts; each push/pull ratio comes with its 95% "
        "interval, and an interval that contains 1 reads 'no resolvable difference'. Then, live: a mixed fleet "
        "(a push pair and a pull pair behind one router, each request's mode drawn at push=0.5) serves a gentle "
        "load, a real Prometheus scrapes it, the dashboard opens with the live verdict, and the closing words "
        "give the live verdict and the what-if next to the grid's, until Ctrl-C."
    )
    p.add_argument(
        "--no-dashboard",
        action="store_true",
        help="exit after the report instead of the live part (a mixed push,pull fleet, Prometheus, a gentle load, "
        "the dashboard)",
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
        help=f"the live part's load: one request every S seconds, one at a time, through the mixed fleet's "
        f"router (default {LIVE_INTERVAL_S:g})",
    )


#: A waterfall lane's bar (``kvlens traces``): never wrapped.
_BAR = re.compile(r"\[[ #=|.]{8,}\]")


def _traces(store: StoreLocation, since_s: float) -> None:
    """The slowest traces per mode (``kvlens traces``), their text lines wrapped
    to the report's width (a waterfall's lanes are narrower: ``width=60``)."""
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
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            traces.run(ns)
        for line in buf.getvalue().splitlines():
            print(line if len(line) <= WIDTH or _BAR.search(line) else wrap(line, indent=""), flush=True)


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
    text = (
        f"kvlens demo: push (overlapped, sequential) vs pull on a real P/D pair; {n_cells} cells per variant "
        f"(QPS {','.join(f'{q:g}' for q in opts.qps)} x input {','.join(map(str, opts.input_lens))} tokens), "
        f"{opts.repeat} round{'s' if opts.repeat > 1 else ''} (push and pull in ABBA order) of "
        f"{opts.num_prompts} requests each, {opts.output_len} output tokens, prefix caching "
        f"{'on' if opts.prefix_caching else 'off'}; budget about 8 minutes on 2 cores, the live part's fleet "
        "start included"
    )
    print(wrap(text, indent=""), flush=True)


def _grid_verdict(run_) -> list[str]:
    """The grid's verdict in words: the report's "Overall" lines (one per push dispatch and figure)."""
    lines = describe(add_ratios(run_.rows))
    return [x for x in lines if x.startswith("Overall")] or lines[-1:]


def run(args: argparse.Namespace) -> int:
    quiet_http_logs(args)
    try:
        opts = _check(args)
    except BenchError as e:
        print(f"kvlens demo: error: {e}", file=sys.stderr, flush=True)
        return exits.USAGE

    t0 = time.time()
    if opts.model is None:
        print(f"kvlens demo: tiny model at {config.model_dir()} (generated on first use)", flush=True)
        opts.model = ensure_model(config.model_dir())
    _announce(opts)
    run_ = new_run(opts)
    try:
        code = run_guarded("demo", run_, lambda: bench_stacks(list(MODES), list(DISPATCHES), opts, run=run_))
        if code is None:
            with sigterm_as_interrupt():
                print_report(run_)
                print(f"(bench part took {time.time() - t0:.0f}s)", flush=True)
                _traces(run_.store, time.time() - t0 + 5)
    except KeyboardInterrupt:
        code = exits.INTERRUPTED
    if code is not None:
        return code
    if args.no_dashboard:
        print(f"\nkvlens demo: done. Browse the results with: kvlens dashboard --store {run_.store}", flush=True)
        return 0
    print(
        "\nkvlens demo: live part: starting a mixed fleet (a push pair and a pull pair behind one router)", flush=True
    )
    stack = None
    try:
        with sigterm_as_interrupt():  # no gap between the fleet's start and the live part's own handling
            stack = start_fleet(opts, run_.store.path.parent)  # stops what it started when it fails
            return live(stack, run_.store, args, _grid_verdict(run_))  # stops the fleet
    except KeyboardInterrupt:
        return exits.INTERRUPTED
    except StackError as e:
        print(f"kvlens demo: error: the live part's fleet did not start: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    finally:
        stop_stack(stack)  # idempotent: a no-op after live()'s own stop
