"""Repeated, interleaved trials (``kvlens bench --repeat K``): the ABBA order
of the rounds, the rows that pool each cell's rounds, and the bootstrap
intervals of every push row's push/pull ratios. Pure.

Why ABBA: whatever drifts during a run (a store that grows, a page cache
that warms, a neighbour that starts) then lands on push and pull alike:
round 1 runs pull then push (as a single round always has, so that push rows
can be compared when written), round 2 push then pull, and so on.

Why intervals over rounds: on a small shared host, two starts of the same
stack have differed by several times in TTFT p50, far more than requests
within one start differ. An interval over requests alone would be far too
narrow, so the bootstrap (:func:`kvtrace.stats.bootstrap_ratio`)
resamples rounds and then requests within them. A single round's interval
covers only request-to-request variation, and the report says so."""

from __future__ import annotations

from typing import Sequence, TypeVar

from kvtrace.benchrows import CI_LEVEL, STORED_RATIOS, add_ratios, interval_keys, verdict, verdict_key
from kvrecord.semconv import Mode
from kvlens.bench.grid import BenchOptions
from kvlens.bench.results import Cell, pool_cells, samples, summarize_cell
from kvtrace.stats import bootstrap_ratio, percentile

T = TypeVar("T")


def abba(items: Sequence[T], k: int) -> list[tuple[int, list[T]]]:
    """``(round, items in that round's order)`` for rounds 1..k: odd rounds in
    the given order, even rounds reversed (A B, B A, A B, ...)."""
    return [(r, list(items) if r % 2 else list(reversed(items))) for r in range(1, k + 1)]


def stack_plan(n_groups: int, k: int, fresh: bool) -> list[tuple[int, int, bool]]:
    """``(round, group index, start a stack?)`` in run order for stacks started
    one at a time: the groups (pull, push) in ABBA order. A group that ends a
    round and starts the next keeps its stack unless ``fresh`` (then every
    round of every group gets a stack of its own). k=1: each group once,
    each on its own stack."""
    plan, last = [], None
    for r, groups in abba(range(n_groups), k):
        for g in groups:
            plan.append((r, g, fresh or g != last))
            last = g
    return plan


def _variant_cell(mode: str, dispatch: str | None, input_len, qps) -> tuple:
    return mode, dispatch, int(input_len), float(qps)


def _key(c: Cell) -> tuple:
    return _variant_cell(c.target.mode, c.target.dispatch, c.input_len, c.qps)


def _by_variant_cell(cells: Sequence[Cell]) -> dict[tuple, list[Cell]]:
    """Cells grouped by (mode, dispatch, input length, QPS), in order of first
    appearance, each group in round order."""
    out: dict[tuple, list[Cell]] = {}
    for c in cells:
        out.setdefault(_key(c), []).append(c)
    return {k: sorted(v, key=lambda c: c.round) for k, v in out.items()}


def _rounds_of(cells: Sequence[Cell], metric: str) -> list[list[float]]:
    by: dict[int, list[float]] = {}
    for c in cells:
        by.setdefault(c.round, []).extend(samples(c, metric))
    return [by[r] for r in sorted(by)]


def add_intervals(rows: list[dict], cells: Sequence[Cell]) -> list[dict]:
    """Set ``rounds`` and, per stored ratio, its interval bounds and verdict on
    each row, from the cells behind the rows (every round of the row's
    variant and grid cell; for push rows also the cell's pull rounds). Pull
    rows and push rows without a pull row of their cell get None. Returns
    ``rows`` (mutated)."""
    groups = _by_variant_cell(cells)
    for row in rows:
        mine = groups.get(_variant_cell(row["mode"], row.get("dispatch"), row["input_len"], row["qps"]), [])
        row["rounds"] = len({c.round for c in mine}) or None
        pull = groups.get(_variant_cell(Mode.PULL.value, None, row["input_len"], row["qps"]))
        for metric in STORED_RATIOS.values():
            lo_k, hi_k = interval_keys(metric)
            row[lo_k] = row[hi_k] = row[verdict_key(metric)] = None
            if row["mode"] != Mode.PUSH.value or not pull or not mine:
                continue
            ci = bootstrap_ratio(_rounds_of(mine, metric), _rounds_of(pull, metric), level=CI_LEVEL)
            row[lo_k], row[hi_k] = ci or (None, None)
            row[verdict_key(metric)] = verdict(row[lo_k], row[hi_k])
    return rows


def pooled_rows(cells: Sequence[Cell], opts: BenchOptions, run_id: str) -> list[dict]:
    """One row per variant and grid cell over all its rounds (figures over the
    pooled requests), with each round's TTFT p50 and handoff p50 (so the
    spread between rounds shows), ratios and intervals."""
    rows = []
    for group in _by_variant_cell(cells).values():
        row = summarize_cell(pool_cells(group), opts, run_id, group[0].row.get("prefix_caching", "external"))
        row["round_ttft_p50_s"] = [percentile(samples(c, "ttft_p50_s"), 50) for c in group]
        row["round_handoff_p50_s"] = [percentile(samples(c, "handoff_p50_s"), 50) for c in group]
        row.update(pooled_machine(group))
        rows.append(row)
    return add_intervals(add_ratios(rows), cells)


def pooled_machine(group: Sequence[Cell]) -> dict:
    """A pooled row's machine fields: the busiest round's outside load and
    CPU, each process's mean over the rounds (and each round's), each
    round's placement, flagged if any round was busy."""
    ms = [c.machine for c in group if c.machine]
    if not ms:
        return {}
    outside = [m["cpu_outside"] for m in ms if m.get("cpu_outside") is not None]
    stacks = [m["cpu_stack"] for m in ms if m.get("cpu_stack")]
    mean_stack = {k: round(sum(s.get(k, 0.0) for s in stacks) / len(stacks), 3) for k in stacks[0]} if stacks else None
    return {
        "cpu_busy": max(m["cpu_busy"] for m in ms),
        "cpu_outside": max(outside) if outside else None,
        "cpu_stack": mean_stack,
        "cpu_bench": max(m.get("cpu_bench") or 0.0 for m in ms),
        "machine_busy": any(m.get("machine_busy") for m in ms),
        "round_cpu_stack": [m.get("cpu_stack") for m in ms],
        "round_placement": [m.get("placement") for m in ms],
        "placement": next(
            (m["placement"] for m in ms if (m.get("placement") or "as asked") != "as asked"), ms[0].get("placement")
        ),
    }
