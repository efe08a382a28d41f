"""Running the grid: on routers that are already up (:func:`bench_routers`)
or on stacks started one mode at a time (:func:`bench_stacks`, pull first so
that each push row carries its push/pull ratios when it is written).

With ``repeat`` K > 1 the whole grid runs K times, push and pull in ABBA
order across the rounds (:mod:`.rounds`); on started stacks a mode's stack
runs two rounds in a row (the end of one and the start of the next) unless
``fresh_stacks`` gives every round its own start.

Each finished cell's row goes straight to the store and the JSON-lines file
(:class:`Sink`), so an interrupted run keeps what finished. With K > 1 a
row pools a cell's rounds, so rows are written when the last round ends
(:meth:`BenchRun.finish`; an interrupted run writes what its finished
rounds pooled). Blocking; runs in the main thread (Ctrl-C / SIGTERM unwind
through here, stopping stacks)."""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from kvtrace import store
from kvtrace.benchrows import add_ratios
from kvrecord import config
from kvlens.bench.grid import DEFAULT_MAX_MODEL_LEN, BenchError, BenchOptions, model_max_len, plan_groups, validate_grid
from kvlens.bench.links import shape_links, stack_link, unshaped
from kvlens.bench.load import run_cell_async, warm_up
from kvlens.bench.machine import MachineWatch
from kvlens.bench.probe import RouterInfo, decode_tpot, probe_router, served_name
from kvlens.bench.prompts import PromptMaker, rng
from kvlens.bench.results import Cell, Target, summarize_cell, wait_for_traces
from kvlens.bench.rounds import abba, add_intervals, pooled_rows, stack_plan
from kvlens.model import ensure_model
from kvlens.stack.supervise import signals_ignored
from kvlens.stack.launch import Stack


@dataclass
class BenchRun:
    """One run: its id, where rows go, the finished cells (in order)."""

    run_id: str
    store: store.StoreLocation  # a file, or a PostgreSQL database
    json_path: Path | None
    cells: list[Cell] = field(default_factory=list)
    interrupted: bool = False
    #: rounds asked for (``--repeat``), and whether each round started fresh stacks
    repeat: int = 1
    fresh_stacks: bool = False
    started_stacks: bool = False  # set by bench_stacks
    #: the last stack, still running, when ``bench_stacks(keep_last=True)`` finished: the caller stops it
    kept_stack: Any = field(default=None, repr=False)
    opts: BenchOptions | None = field(default=None, repr=False)
    _sink: Any = None
    _pooled: list[dict] | None = None

    def sink(self) -> "Sink":
        if self._sink is None:
            self._sink = Sink(self)
        return self._sink

    @property
    def rows(self) -> list[dict]:
        """One row per variant and grid cell: each cell's own row, or with
        ``repeat`` > 1 the rows pooling its rounds (as written by :meth:`finish`)."""
        if self.repeat == 1:
            return [c.row for c in self.cells]
        if self._pooled is not None:
            return self._pooled
        return pooled_rows(self.cells, self.opts or BenchOptions(), self.run_id)

    def finish(self) -> None:
        """With ``repeat`` > 1: write the pooled rows of the finished cells, once.
        (A single round's rows were written as each cell finished.)"""
        if self.repeat == 1 or self._pooled is not None or not self.cells:
            return
        self._pooled = self.rows
        for row in self._pooled:
            self.sink().write(row)


class Sink:
    """Writes each finished row to the store and the JSON-lines file (which
    it truncates on creation)."""

    def __init__(self, run: BenchRun):
        self.run = run
        if run.json_path:
            run.json_path.parent.mkdir(parents=True, exist_ok=True)
            run.json_path.write_text("")

    def write(self, row: dict) -> None:
        conn = store.connect(self.run.store)
        try:
            store.save_bench_rows(conn, self.run.run_id, [row])
        finally:
            conn.close()
        if self.run.json_path:
            with open(self.run.json_path, "a") as f:
                f.write(json.dumps(row) + "\n")


def new_run_id() -> str:
    """``YYYYmmdd-HHMMSS-<6 hex>`` (local time)."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def new_run(opts: BenchOptions) -> BenchRun:
    """A fresh run writing to ``opts.store`` (default ``<home>/traces.db``) and ``opts.json_path``."""
    where = store.StoreLocation.parse(opts.store) if opts.store else config.default_store()
    jp = Path(opts.json_path).expanduser().resolve() if opts.json_path else None
    return BenchRun(new_run_id(), where, jp, repeat=opts.repeat, fresh_stacks=opts.fresh_stacks, opts=opts)


def _warm_up(
    targets: Sequence[Target], opts: BenchOptions, maker: PromptMaker, model_name: str | None, target_index0: int
) -> None:
    for ti, t in enumerate(targets):
        if opts.warmup > 0:
            r = rng(opts.seed, 9999, target_index0 + ti)
            prompts = [maker.make(min(opts.input_lens), r) for _ in range(opts.warmup)]
            asyncio.run(warm_up(t, model_name, prompts, opts.request_timeout_s))


def _decode_growth(cell: Cell, before: tuple[float, float] | None, note: str | None) -> None:
    """Set the cell's D TPOT figures from the histogram ``before`` the cell
    (or why there is none) and D's histogram now."""
    if before is not None:
        after, note = decode_tpot(cell.target.decode_url)
        if after is not None:
            grown = (after[0] - before[0], after[1] - before[1])
            if grown[1] < 0:
                note = "D's TPOT histogram went back during the cell (D restarted?)"
            else:
                cell.decode_tpot = grown
    cell.decode_tpot_note = note


def _run_cell(
    run: BenchRun,
    t: Target,
    qps: float,
    input_len: int,
    prompts: list[str],
    r,
    opts: BenchOptions,
    model_name: str | None,
    prefix_caching: str,
    round_: int = 1,
) -> None:
    """Load one target on one cell, join its traces, write its row (one round:
    at once; several: :meth:`BenchRun.finish` writes the pooled rows)."""
    from tqdm import tqdm  # here for start-up cost: `kvlens --help` imports this module

    tag = f" r{round_}" if run.repeat > 1 else ""
    bar = tqdm(
        total=len(prompts),
        desc=f"{t.label:<17} in={input_len:<5} qps={qps:<4g}{tag}",
        unit="req",
        file=sys.stderr,
        disable=not opts.progress,
        leave=True,
        dynamic_ncols=True,
    )
    before, note = decode_tpot(t.decode_url)
    watch = MachineWatch(t.stack).start()
    try:
        results, dur = asyncio.run(
            run_cell_async(
                t, model_name, prompts, float(qps), opts.output_len, r, timeout_s=opts.request_timeout_s, pbar=bar
            )
        )
    finally:
        bar.close()
    machine = watch.stop()
    traces = wait_for_traces(run.store, results, opts.trace_wait_s)
    cell = Cell(t, float(qps), int(input_len), results, traces, dur, round=round_, machine=machine)
    _decode_growth(cell, before, note)
    cell.row = summarize_cell(cell, opts, run.run_id, prefix_caching)
    run.cells.append(cell)
    if run.repeat == 1:
        add_ratios(run.rows)
        add_intervals([cell.row], run.cells)  # pull runs first: a push row's pull cell is already here
        run.sink().write(cell.row)


def _bench_targets(
    run: BenchRun,
    targets: Sequence[tuple[int, Target]],
    opts: BenchOptions,
    maker: PromptMaker,
    model_name: str | None,
    prefix_caching: str,
    target_index0: int = 0,
    round_: int = 1,
    warm: bool = True,
) -> None:
    """Warm each target up (``warm``), then run every cell on every target
    (targets interleaved per cell in the order given, so drift hits them
    alike). ``targets``: (index, target); the index and the round seed the
    prompts and arrivals (round 1: as a run without repeats)."""
    if warm:
        _warm_up([t for _, t in sorted(targets, key=lambda it: it[0])], opts, maker, model_name, target_index0)
    ci = 0
    for input_len in opts.input_lens:
        for qps in opts.qps:
            ci += 1
            for ti, t in targets:
                key = (target_index0 + ti, ci) + ((round_,) if round_ > 1 else ())
                r = rng(opts.seed, *key)
                prompts = [maker.make(int(input_len), r) for _ in range(opts.num_prompts)]
                _run_cell(run, t, qps, input_len, prompts, r, opts, model_name, prefix_caching, round_)


def _prepare(
    opts: BenchOptions, modes: Sequence[str], dispatches: Sequence[str], model_dir: Path | None, max_len: int | None
) -> PromptMaker:
    validate_grid(
        modes=modes,
        dispatches=dispatches,
        qps=list(opts.qps),
        input_lens=list(opts.input_lens),
        output_len=opts.output_len,
        num_prompts=opts.num_prompts,
        max_model_len=max_len,
        repeat=opts.repeat,
    )
    if model_dir is None or not Path(model_dir).is_dir():
        raise BenchError(f"model directory not found: {model_dir} (pass --model DIR)")
    return PromptMaker(model_dir)


def _resolve(router: str | Target, opts: BenchOptions) -> tuple[Target, RouterInfo]:
    """A Target for a router (a plain URL is named by its ``/health``), with
    the options' API key and D URL where it has none of its own."""
    if isinstance(router, Target):
        t = replace(router, api_key=router.api_key or opts.api_key, decode_url=router.decode_url or opts.decode_url)
        return t, probe_router(t.url, t.api_key)
    info = probe_router(router, opts.api_key)
    if info.mode is None:
        raise BenchError(f"router at {info.url} does not report its mode on /health: name it (Target or --modes)")
    return Target(info.mode, info.dispatch, info.url, opts.decode_url, opts.api_key), info


def bench_routers(routers: Sequence[str | Target], opts: BenchOptions, run: BenchRun | None = None) -> BenchRun:
    """Bench already running routers (e.g. the test session's shared stacks).
    A plain URL is probed for its mode/dispatch on ``/health``. Pull targets
    run first. Raises BenchError before any load on bad input."""
    targets, infos = zip(*(_resolve(r, opts) for r in routers)) if routers else ((), ())
    model_dir = Path(opts.model) if opts.model else None
    if model_dir is None:
        roots = [Path(i.root) for i in infos if i.root and (Path(i.root) / "tokenizer.json").is_file()]
        model_dir = roots[0] if roots else config.model_dir()
    lens = [i.max_model_len for i in infos if i.max_model_len] or [model_max_len(model_dir)]
    max_len = min(x for x in lens if x) if any(lens) else None
    maker = _prepare(opts, [t.mode for t in targets], [t.dispatch for t in targets if t.dispatch], model_dir, max_len)
    model_name = next((i.model for i in infos if i.model), None)
    run = run or new_run(opts)
    run.sink()
    ordered = list(enumerate(sorted(targets, key=lambda t: 0 if t.mode == "pull" else 1)))
    for r, items in abba(ordered, opts.repeat):
        _bench_targets(run, items, opts, maker, model_name, "external", round_=r, warm=r == 1)
    run.finish()
    return run


def bench_stacks(
    modes: Sequence[str],
    dispatches: Sequence[str],
    opts: BenchOptions,
    run: BenchRun | None = None,
    stack_factory: Callable[..., Any] | None = None,
    keep_last: bool = False,
) -> BenchRun:
    """Start one stack per mode (pull first), bench it, stop it (also on
    Ctrl-C / SIGTERM, which propagate as KeyboardInterrupt with the finished
    cells kept in ``run``). ``stack_factory``: ``kvlens.stack.launch.Stack`` or a stand-in.
    ``keep_last``: leave the last stack running in ``run.kept_stack`` when every
    cell finished (the demo serves it live); the caller stops it."""
    model_dir = Path(opts.model).expanduser().resolve() if opts.model else ensure_model(config.model_dir())
    max_len = model_max_len(model_dir) or DEFAULT_MAX_MODEL_LEN  # never above what the stacks serve
    maker = _prepare(opts, modes, dispatches, model_dir, max_len)
    run = run or new_run(opts)
    if run.store.is_postgres or run.store.path.name != config.STORE_FILE:
        raise BenchError(
            "stacks started by kvlens bench write to <home>/traces.db; --store must name such a "
            f"file, got {run.store} (bench routers you started yourself with --url "
            "may write a PostgreSQL store)"
        )
    run.sink()
    run.started_stacks = True
    groups = plan_groups(modes, dispatches, mixed=bool(opts.links))
    stack = targets = model_name = None
    done = False
    try:
        for r, gi, start in stack_plan(len(groups), opts.repeat, opts.fresh_stacks):
            if start:
                stop_stack(stack)
                stack = None  # a failed start must not be stopped twice
                stack, targets, model_name = _start(
                    stack_factory or Stack, groups[gi], model_dir, run.store.path.parent, opts
                )
            items = list(enumerate(targets)) if r % 2 else list(reversed(list(enumerate(targets))))
            _bench_targets(
                run,
                items,
                opts,
                maker,
                model_name,
                "on" if opts.prefix_caching else "off",
                target_index0=10 * gi,
                round_=r,
                warm=start,
            )
        done = True
    finally:
        if done and keep_last:
            run.kept_stack = stack
        else:
            stop_stack(stack)
    run.finish()
    return run


def _start(
    factory: Callable[..., Any], group: tuple[str, list[str | None]], model_dir: Path, home: Path, opts: BenchOptions
) -> tuple[Any, list[Target], str | None]:
    """Start one stack for a (mode, dispatches) group: (stack, its targets, the served model name).
    ``opts.links``: a ``hosts`` stack, its links shaped after start-up; a mixed group (``push,pull``): one target per
    half (:func:`stack_targets`). A stack that fails to start stops itself (``Stack.start``)."""
    mode, ds = group
    vllm_args = [] if opts.prefix_caching else ["--no-enable-prefix-caching"]
    net = {"hosts": True, "links": unshaped(opts.links)} if opts.links else {}
    stack = factory(
        mode=mode,
        dispatch=ds[0] or "overlapped",
        model=model_dir,
        port=None,
        kvlens_home=home,
        vllm_args=vllm_args,
        api_key=opts.api_key,
        **net,
    )
    try:
        stack.start()
        if opts.links:
            shape_links(stack, opts.links)  # after the start-up's warm-up (the NIXL handshakes)
        return stack, stack_targets(stack, mode, ds, opts), served_name(stack.router_url, _router_key(stack, opts))
    except BaseException:
        stop_stack(stack)
        raise


def _router_key(stack: Any, opts: BenchOptions) -> str | None:  # $KVLENS_TOKEN if the stack has it, else the key
    return getattr(stack, "router_key", None) or getattr(stack, "api_key", None) or opts.api_key


def stack_targets(stack: Any, mode: str, ds: Sequence[str | None], opts: BenchOptions) -> list[Target]:
    """A running stack's targets: one per dispatch (extra ones get a router of their own), or for a mixed
    fleet (``push,pull``) one per half, pull first, each request naming its half; each with the link
    record (asked and last measured) of ``opts.links``."""
    key = _router_key(stack, opts)
    link = stack_link(stack, opts.links) if opts.links else None
    if "," in mode:  # a mixed fleet: both halves behind the one router
        return [
            Target(
                m,
                ds[0] if m == "push" else None,
                stack.router_url,
                _decode_of(stack, m),
                key,
                stack=stack,
                force_mode=True,
                link=link,
            )  # fmt: skip
            for m in ("pull", "push")
        ]
    d_url = getattr(stack, "decode_url", None) or None
    targets = [Target(mode, ds[0], stack.router_url, d_url, key, stack=stack, link=link)]
    return targets + [Target(mode, d, stack.add_router(d), d_url, key, stack=stack, link=link) for d in ds[1:]]


def _decode_of(stack: Any, mode: str) -> str | None:
    """The URL of a mixed fleet's first D of ``mode`` (its TPOT cross-check), None if unknown."""
    for i, d in enumerate(getattr(stack, "decodes", None) or ()):
        if stack.mode_of("decode", i) == mode:
            return d.url
    return None


def stop_stack(stack: Any) -> None:
    if stack is not None:
        with signals_ignored():  # a second Ctrl-C while stopping must not leave orphans
            stack.stop()
