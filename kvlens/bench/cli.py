"""``kvlens bench`` command line: flags, their checks (exit code 2 before any
load), and the run with Ctrl-C / SIGTERM keeping finished rows (exit 130).
:func:`add_grid_arguments` and :func:`run_guarded` are shared with ``kvlens demo``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any, Callable

from frontdoor.flags import add_api_key_arguments, api_key_arg, env_api_key
from kvlens.bench import grid
from kvlens.bench.grid import BenchError, BenchOptions
from kvlens.bench.links import check_link_args
from kvlens.bench.probe import probe_router
from kvlens.bench.report import print_report
from kvlens.bench.results import Target
from kvlens.bench.runner import BenchRun, bench_routers, bench_stacks, new_run
from kvlens import exits
from kvlens.signals import sigterm_as_interrupt
from kvlens.stack.errors import StackError


def add_grid_arguments(
    p: argparse.ArgumentParser, *, qps: str, input_len: str, output_len: int, num_prompts: int, repeat: int = 1
) -> None:
    """The grid flags, with the caller's defaults (``bench`` and ``demo`` differ)."""
    p.add_argument("--qps", default=qps, help=f"comma list of request rates (Poisson), default {qps}")
    p.add_argument(
        "--input-len", default=input_len, help=f"comma list of prompt lengths in tokens, default {input_len}"
    )
    p.add_argument(
        "--output-len", type=int, default=output_len, help=f"tokens per answer (ignore_eos), default {output_len}"
    )
    p.add_argument(
        "--num-prompts", type=int, default=num_prompts, help=f"requests per cell and round, default {num_prompts}"
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=repeat,
        metavar="K",
        help=f"run the grid K times, push and pull alternating ABBA across the rounds; each push/pull "
        f"ratio gets a 95%% interval over rounds and requests (default {repeat})",
    )
    p.add_argument(
        "--fresh-stacks",
        action="store_true",
        help="with --repeat on started stacks: start fresh stacks for every round (default: a mode's "
        "stack serves the two rounds in a row that ABBA gives it)",
    )
    p.add_argument("--seed", type=int, default=0, help="prompt and arrival seed (default 0)")
    p.add_argument(
        "--prefix-caching",
        choices=["off", "on"],
        default="off",
        help="vLLM prefix caching on started stacks (default off: every request transfers all its KV)",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="model dir (default: generated tiny model in $KVLENS_HOME/model; with --proxy: the served one)",
    )
    p.add_argument(
        "--store",
        default=None,
        help="trace store: a file, or postgresql://user@host:port/db (default $KVLENS_HOME/traces.db)",
    )
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="also write rows as JSON lines here")
    p.add_argument(
        "--wide",
        action="store_true",
        help="print every figure of each row (TTFT mean/p99, TPOT, handoff p99, req/s, CPU outside, each "
        "round's p50); default: the columns that decide, within 120 characters",
    )
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per router before the grid (default 2)")
    p.add_argument("--trace-wait", type=float, default=30.0, help="seconds to wait for a cell's traces (default 30)")
    p.add_argument(
        "--request-timeout", type=float, default=120.0, help="seconds before a request counts as failed (default 120)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_api_key_arguments(p, "what the routers (and started stacks) require, sent as a bearer token")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--modes", default=None, help="comma list of push, pull (default push,pull; with --proxy: the router's mode)"
    )
    p.add_argument(
        "--dispatch",
        default="overlapped",
        help="push dispatch(es), comma list of overlapped, sequential (default overlapped)",
    )
    p.add_argument(
        "--proxy", default=None, metavar="URL", help="bench this running router instead of starting stacks (one mode)"
    )
    p.add_argument(
        "--decode-url",
        default=None,
        metavar="URL",
        help="with --proxy: D's base URL, to cross-check the client's TPOT against D's own "
        "vllm:request_time_per_output_token_seconds on its /metrics (started stacks: always)",
    )
    p.add_argument(
        "--link",
        action="append",
        default=[],
        metavar="SPEC",
        help="run the started stacks with every role in its own network namespace (kvlens up --hosts) and "
        "this link, e.g. p-d=20ms,200mbit or router-d=5ms (repeatable; the syntax of kvlens up --link, "
        "docs/links.md). push and pull with one dispatch then share one mixed fleet, each request naming "
        "its mode, so both run on the same links; every row records the links asked and measured. Needs "
        "root, ip, tc, iptables-legacy and fnfqueue; not with --proxy",
    )
    add_grid_arguments(p, qps="1,2,4", input_len="256,1024,2048", output_len=32, num_prompts=32)


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """BenchOptions from the grid flags; BenchError on a bad value."""
    if args.repeat < 1:
        raise BenchError(f"--repeat must be >= 1, got {args.repeat}")
    if args.warmup < 0:
        raise BenchError(f"--warmup must be >= 0, got {args.warmup}")
    if not args.trace_wait >= 0:
        raise BenchError(f"--trace-wait must be >= 0, got {args.trace_wait}")
    if not args.request_timeout > 0:
        raise BenchError(f"--request-timeout must be > 0, got {args.request_timeout}")
    decode_url = getattr(args, "decode_url", None)  # bench only, not demo
    if decode_url and not decode_url.startswith(("http://", "https://")):
        raise BenchError(f"--decode-url must be an http(s) URL, got {decode_url!r}")
    return BenchOptions(
        qps=grid.parse_list(args.qps, float, "--qps"),
        input_lens=grid.parse_list(args.input_len, int, "--input-len"),
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        seed=args.seed,
        warmup=args.warmup,
        trace_wait_s=args.trace_wait,
        store=args.store,
        json_path=args.json_path,
        prefix_caching=args.prefix_caching == "on",
        progress=not args.no_progress,
        request_timeout_s=args.request_timeout,
        model=args.model,
        api_key=getattr(args, "api_key", None) or env_api_key(),
        decode_url=decode_url.rstrip("/") if decode_url else None,
        repeat=args.repeat,
        fresh_stacks=args.fresh_stacks,
        wide=getattr(args, "wide", False),
    )


def quiet_http_logs(args: argparse.Namespace) -> None:
    """httpx logs every request at INFO: one line per benchmark request."""
    if not getattr(args, "verbose", False):
        logging.getLogger("httpx").setLevel(logging.WARNING)


def _proxy_target(url: str, modes: list[str] | None, dispatches: list[str], opts: BenchOptions) -> Target:
    """The one router ``--proxy`` names, its mode checked against ``--modes``."""
    info = probe_router(url, opts.api_key)
    if info.mode is not None:
        if modes and modes != [info.mode]:
            raise BenchError(f"router at {info.url} serves {info.mode}, but --modes says {','.join(modes)}")
        return Target(info.mode, info.dispatch, info.url, opts.decode_url, opts.api_key)
    if not modes or len(modes) != 1:
        raise BenchError("with --proxy, --modes must name exactly one mode (the router does not report it)")
    return Target(modes[0], dispatches[0] if modes[0] == "push" else None, info.url, opts.decode_url, opts.api_key)


def _parse(args: argparse.Namespace) -> tuple[BenchOptions, list[str] | None, list[str], Target | None]:
    """(options, modes or None for all, dispatches, the --proxy target or None); BenchError on bad input."""
    opts = options_from_args(args)
    dispatches = grid.parse_names(args.dispatch, grid.DISPATCHES, "dispatch")
    modes = grid.parse_names(args.modes, grid.MODES, "mode") if args.modes else None
    # the stacks kvlens starts serve --max-model-len 4096; a --proxy router
    # reports its own max_model_len (checked in bench_routers)
    max_len = None if args.proxy else (grid.model_max_len(opts.model) or grid.DEFAULT_MAX_MODEL_LEN)
    grid.validate_grid(
        modes=modes or ["push"],
        dispatches=dispatches,
        qps=opts.qps,
        input_lens=opts.input_lens,
        output_len=opts.output_len,
        num_prompts=opts.num_prompts,
        max_model_len=max_len,
    )
    if opts.decode_url and not args.proxy:
        raise BenchError("--decode-url goes with --proxy (started stacks cross-check their own D)")
    if opts.fresh_stacks and args.proxy:
        raise BenchError("--fresh-stacks goes with stacks kvlens bench starts, not with --proxy")
    opts.links = check_link_args(getattr(args, "link", None) or (), args.proxy)
    target = _proxy_target(args.proxy, modes, dispatches, opts) if args.proxy else None
    return opts, modes, dispatches, target


def run_guarded(prog: str, run_: BenchRun, body: Callable[[], Any]) -> int | None:
    """Call ``body`` (which fills ``run_``) with SIGTERM unwinding like Ctrl-C.
    Returns None when it finished, else the exit code after saying why
    (:mod:`kvlens.exits`): 2 bad input (a model directory that is none
    included), 1 a stack did not start, 130 interrupted. Finished cells are
    reported (their rows are already saved). Main thread only."""
    try:
        with sigterm_as_interrupt():
            body()
    except BenchError as e:
        print(f"kvlens {prog}: error: {e}", file=sys.stderr, flush=True)
        return exits.USAGE
    except StackError as e:
        print(f"kvlens {prog}: could not start a stack: {e}", file=sys.stderr, flush=True)
        code = e.exit_code
    except KeyboardInterrupt:
        run_.interrupted = True
        print(f"\nkvlens {prog}: interrupted; keeping {len(run_.cells)} finished cells", file=sys.stderr, flush=True)
        code = exits.INTERRUPTED
    else:
        return None
    _finish(prog, run_)
    if run_.cells:
        print_report(run_)
    return code


def _finish(prog: str, run_: BenchRun) -> None:
    """Save the pooled rows of the rounds that finished (``--repeat``); a
    failure to save is said, not raised, so the report still prints."""
    try:
        with sigterm_as_interrupt():
            run_.finish()
    except (Exception, KeyboardInterrupt) as e:
        print(f"kvlens {prog}: could not save the pooled rows: {e!r}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    quiet_http_logs(args)
    try:
        args.api_key = api_key_arg(args, lambda line: print(f"kvlens bench: {line}", file=sys.stderr, flush=True))
        opts, modes, dispatches, target = _parse(args)
    except (BenchError, ValueError) as e:
        print(f"kvlens bench: error: {e}", file=sys.stderr, flush=True)
        return 2
    run_ = new_run(opts)
    if target is not None:
        code = run_guarded("bench", run_, lambda: bench_routers([target], opts, run=run_))
    else:
        code = run_guarded("bench", run_, lambda: bench_stacks(modes or list(grid.MODES), dispatches, opts, run=run_))
    if code is not None:
        return code
    cc = print_report(run_)
    return 0 if cc.completed else 1
