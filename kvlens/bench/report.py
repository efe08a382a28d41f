"""What a run prints: the table, plain-words findings computed from the rows,
and the cross-checks of the client's figures against the router's traces.
Everything but :func:`print_report` is pure."""

from __future__ import annotations

import statistics
import sys
import textwrap
from typing import Iterable, Sequence

from kvtrace import benchrows
from kvtrace.benchrows import add_ratios, cell_key, pull_by_cell
from kvlens.bench.crosscheck import CrossCheck, cross_check
from kvtrace.stats import MIN_REQUESTS


def variant(row: dict) -> str:
    return f"push ({row['dispatch']})" if row["mode"] == "push" and row.get("dispatch") else row["mode"]


def sort_rows(rows: Iterable[dict]) -> list[dict]:
    """Display order: by input length, QPS, then push variants before pull."""
    order = {"overlapped": 0, "sequential": 1, None: 2}
    return sorted(
        rows, key=lambda r: (r["input_len"], r["qps"], 0 if r["mode"] == "push" else 1, order.get(r.get("dispatch"), 3))
    )


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _ci(row: dict, metric: str) -> str:
    """A push row's ratio with its interval: ``0.80 [0.71-0.93]``; ``[?]``:
    not enough data for one; no brackets: a row from before intervals."""
    r = row.get(benchrows.ratio_key(metric))
    if r is None:
        return "-"
    if "rounds" not in row:
        return _x(r)
    lo, hi = (row.get(k) for k in benchrows.interval_keys(metric))
    return f"{r:.2f} [?]" if lo is None or hi is None else f"{r:.2f} [{lo:.2f}-{hi:.2f}]"


def _by_round(row: dict, key: str) -> str:
    return "/".join("-" if v is None else f"{v * 1000:.0f}" for v in row.get(key) or [])


def _n(row: dict) -> str:
    """Completed of sent requests: ``8/8``; `` !``: the machine was busy during the cell."""
    return f"{row['completed']}/{row['completed'] + row['failed']}{' !' if row.get('machine_busy') else ''}"


def _pct(v: float | None) -> str:
    """A share as ``37 %``; ``-`` where no request of the row carried CPU figures (issue 41)."""
    return "-" if v is None else f"{v * 100:.0f} %"


def _tpot(row: dict) -> str:
    # "untimed": no request's tokens arrived apart (cross-checks say why), not a missing figure
    return "untimed" if row.get("tpot_mean_s") is None and row.get("tpot_untimed") else _ms(row.get("tpot_mean_s"))


#: The default table: the columns that decide, narrow enough for a 120-column terminal with room
#: for one more short column pair. (header, cell) pairs; a header may have two lines ("a\nb").
TABLE_COLUMNS = (
    ("mode", lambda r: r["mode"]),
    ("dispatch", lambda r: r.get("dispatch") or "-"),
    ("input", lambda r: str(r["input_len"])),
    ("QPS", lambda r: f"{r['qps']:g}"),
    ("TTFT\np50 ms", lambda r: _ms(r.get("ttft_p50_s"))),
    ("handoff\np50 ms", lambda r: _ms(r.get("handoff_p50_s"))),
    ("TTFT p50 push/pull\n[95% CI]", lambda r: _ci(r, "ttft_p50_s")),
    ("handoff p50 push/pull\n[95% CI]", lambda r: _ci(r, "handoff_p50_s")),
    ("CPU wait\n% handoff", lambda r: _pct(r.get("handoff_cpu_wait_share_p50"))),
    ("n\nok/sent", _n),
)

#: ``--wide``: every figure of a row, one header line each.
WIDE_COLUMNS = (
    ("mode", lambda r: r["mode"]),
    ("dispatch", lambda r: r.get("dispatch") or "-"),
    ("input", lambda r: str(r["input_len"])),
    ("QPS", lambda r: f"{r['qps']:g}"),
    ("TTFT mean ms", lambda r: _ms(r.get("ttft_mean_s"))),
    ("TTFT p50 ms", lambda r: _ms(r.get("ttft_p50_s"))),
    ("TTFT p99 ms", lambda r: _ms(r.get("ttft_p99_s"))),
    ("TPOT mean ms", _tpot),
    ("handoff p50 ms", lambda r: _ms(r.get("handoff_p50_s"))),
    ("handoff p99 ms", lambda r: _ms(r.get("handoff_p99_s"))),
    ("req/s", lambda r: "-" if r.get("req_per_s") is None else f"{r['req_per_s']:.2f}"),
    ("completed", lambda r: str(r["completed"])),
    ("failed", lambda r: str(r["failed"])),
    ("TTFT p50 push/pull [95% CI]", lambda r: _ci(r, "ttft_p50_s")),
    ("handoff p50 push/pull [95% CI]", lambda r: _ci(r, "handoff_p50_s")),
    ("CPU wait % of handoff p50", lambda r: _pct(r.get("handoff_cpu_wait_share_p50"))),
    ("handoff p50 w/o CPU wait ms", lambda r: _ms(r.get("handoff_nowait_p50_s"))),
    ("CPU outside", lambda r: _outside(r)),
)


def _outside(row: dict) -> str:
    """CPUs used outside the stack and the bench during the cell (``!``: busy,
    the verdict may not hold; ``?``: the stack's processes are unknown)."""
    if row.get("cpu_outside") is not None:
        return f"{row['cpu_outside']:.2f}{' !' if row.get('machine_busy') else ''}"
    return "?" if "cpu_busy" in row else "-"


#: Added (``--wide``) where rows pool several rounds: how many, and each round's p50 (the spread between rounds).
ROUND_COLUMNS = (
    ("rounds", lambda r: str(r.get("rounds") or "-")),
    ("TTFT p50 by round ms", lambda r: _by_round(r, "round_ttft_p50_s")),
    ("handoff p50 by round ms", lambda r: _by_round(r, "round_handoff_p50_s")),
)

#: The width the default output keeps to (a terminal of 120 columns).
WIDTH = 120


def format_table(rows: Sequence[dict], wide: bool = False) -> str:
    """A plain-text table: :data:`TABLE_COLUMNS`, or with ``wide`` every
    figure (:data:`WIDE_COLUMNS`, and :data:`ROUND_COLUMNS` where rows pool
    rounds). Ratios < 1: push is faster; ``[lo-hi]``: the 95 % interval,
    ``[?]`` not enough data for one."""
    if not rows:
        return "(no rows)"
    columns = TABLE_COLUMNS
    if wide:
        columns = WIDE_COLUMNS + (ROUND_COLUMNS if any((r.get("rounds") or 1) > 1 for r in rows) else ())
    heads = [h.split("\n") for h, _ in columns]
    depth = max(len(h) for h in heads)
    heads = [[""] * (depth - len(h)) + h for h in heads]  # a one-line header sits on the last line
    body = [[f(r) for _, f in columns] for r in sort_rows(rows)]
    widths = [max(len(x) for x in heads[i] + [c[i] for c in body]) for i in range(len(columns))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(cells, widths))).rstrip()

    lines = [line([h[k] for h in heads]) for k in range(depth)]
    lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines + [line(c) for c in body])


def wrap(line: str, width: int = WIDTH, indent: str = "  ") -> str:
    """``indent`` + ``line`` wrapped to ``width`` at spaces (never inside a
    figure such as ``0.68-1.45``); continuation lines indented 4 more. A
    line's own leading spaces are kept."""
    lead = indent + " " * (len(line) - len(line.lstrip(" ")))
    return textwrap.fill(
        line.strip(),
        width=width,
        initial_indent=lead,
        subsequent_indent=lead + "    ",
        break_long_words=False,
        break_on_hyphens=False,
    )


#: The metrics that carry intervals, with their names in words.
COMPARED = (("TTFT p50", "ttft_p50_s"), ("handoff p50", "handoff_p50_s"))


def _verdict(row: dict, metric: str) -> str | None:
    """The row's verdict on a metric (:func:`kvtrace.benchrows.verdict`);
    None for a row from before intervals."""
    if "rounds" not in row:
        return None
    return benchrows.verdict(*(row.get(k) for k in benchrows.interval_keys(metric)))


def _compare(name: str, row: dict, pull: dict, metric: str) -> str:
    r, push_v, pull_v = row.get(benchrows.ratio_key(metric)), row.get(metric), pull.get(metric)
    if r is None:
        return f"{name}: no comparison (missing figure)"
    fig = f"{_ms(push_v)} ms vs {_ms(pull_v)} ms"
    v = _verdict(row, metric)
    if v is None:
        return f"{name} {fig}: push/pull {r:.2f}, no interval recorded, so no verdict"
    if v == benchrows.NOT_ENOUGH_DATA:
        return (
            f"{name} {fig}: not enough data for an interval (it needs {MIN_REQUESTS} requests with the figure a side)"
        )
    lo, hi = (row[k] for k in benchrows.interval_keys(metric))
    ci = f"push/pull {r:.2f}, 95% CI {lo:.2f}-{hi:.2f}"
    if v == benchrows.NO_DIFFERENCE:
        return f"{name} {fig}: no resolvable difference ({ci})"
    if v == benchrows.PUSH_LOWER:
        return f"{name} {fig}: push {(1 - r) * 100:.0f}% lower ({ci})"
    return f"{name} {fig}: pull {(1 - 1 / r) * 100:.0f}% lower ({ci})"


def _tally(compared: list[dict]) -> list[str]:
    """One line per (push dispatch, metric): the cells of each verdict, and
    the median ratio as a description, not a verdict."""
    out = []
    for d in dict.fromkeys(r.get("dispatch") for r in compared):
        mine = [r for r in compared if r.get("dispatch") == d]
        for name, metric in COMPARED:
            withr = [r for r in mine if r.get(benchrows.ratio_key(metric)) is not None]
            if not withr:
                continue
            rs = [r[benchrows.ratio_key(metric)] for r in withr]
            counts = {
                v: 0
                for v in (
                    benchrows.PUSH_LOWER,
                    benchrows.PULL_LOWER,
                    benchrows.NO_DIFFERENCE,
                    benchrows.NOT_ENOUGH_DATA,
                    None,
                )
            }
            for r in withr:
                counts[_verdict(r, metric)] += 1
            parts = [f"{v} in {n}" for v, n in counts.items() if v and n]
            if counts[None]:
                parts.append(f"no interval recorded in {counts[None]}")
            out.append(
                f"Overall, push ({d}) vs pull on {name} over {len(withr)} cells: {', '.join(parts)} "
                f"(95% intervals over requests and rounds); median push/pull ratio {statistics.median(rs):.2f} "
                f"(range {min(rs):.2f}-{max(rs):.2f})."
            )
    return out


def machine_caveats(rows: Sequence[dict]) -> list[str]:
    """Cells measured while other work took CPU, or with placement not as
    asked: their verdicts may not hold (:mod:`kvlens.bench.machine`)."""
    out = []
    busy = [r for r in rows if r.get("machine_busy")]
    if busy:
        worst = max(r.get("cpu_outside") or 0.0 for r in busy)
        cells = ", ".join(sorted({f"{r['mode']} in={r['input_len']} qps={r['qps']:g}" for r in busy}))
        out.append(
            f"The machine was busy during {len(busy)} of {len(rows)} rows ({cells}): up to {worst:.2f} CPU "
            "went to work outside the stack and the bench; their figures and verdicts may not hold."
        )
    off = sorted({r["placement"] for r in rows if (r.get("placement") or "as asked").startswith("not as asked")})
    if off:
        out.append(
            "Placement not as asked during some cells (" + "; ".join(off) + "): their figures may not "
            "compare with the others."
        )
    if rows and all(r.get("cpu_stack", 0) is None and "cpu_busy" in r for r in rows):
        out.append(
            "The stack's processes are not known (--proxy): each row's machine load includes the stack (cpu_not_bench)."
        )
    return out


def caveats(rows: Sequence[dict], fresh_stacks: bool = False, started_stacks: bool = True) -> list[str]:
    """What the intervals of these rows do not cover, and what the machine did."""
    return _round_caveats(rows, fresh_stacks, started_stacks) + machine_caveats(rows)


def _round_caveats(rows: Sequence[dict], fresh_stacks: bool, started_stacks: bool) -> list[str]:
    rounds = {r.get("rounds") for r in rows if r.get("rounds")}
    if not rounds:
        return []
    if rounds == {1}:
        return [
            "One round: each interval covers the variation between requests of one stack start only; on a "
            "small shared host separate starts of the same stack have differed by far more. For a verdict "
            "that holds across starts: --repeat 3 --fresh-stacks."
        ]
    if not started_stacks:
        return [
            f"{max(rounds)} rounds on routers that stayed up: the intervals cover variation over time, "
            "not between stack starts."
        ]
    if not fresh_stacks:
        return [
            f"{max(rounds)} rounds; a mode's stack served two rounds in a row (ABBA), so the intervals cover "
            "fewer stack starts than rounds (--fresh-stacks: one start per round)."
        ]
    return []


def describe(rows: Sequence[dict]) -> list[str]:
    """Plain-words findings computed from the rows: per cell, for TTFT p50 and
    handoff p50, the push/pull ratio with its 95 % interval and who was lower
    (only where the interval excludes 1), then a tally per push dispatch.
    Needs the ratios (:func:`kvtrace.benchrows.add_ratios`) set."""
    out: list[str] = []
    push_rows = [r for r in sort_rows(rows) if r["mode"] == "push"]
    pull = pull_by_cell(rows)
    compared = [r for r in push_rows if cell_key(r) in pull]
    if not compared:
        return ["No push/pull pair ran on the same cell, so there is nothing to compare."]
    for r in compared:
        p = pull[cell_key(r)]
        out.append(
            f"input {r['input_len']} tokens, {r['qps']:g} QPS, {variant(r)} vs pull: "
            + "; ".join(_compare(name, r, p, metric) for name, metric in COMPARED)
        )
    return out + _tally(compared)


def link_lines(rows: Iterable[dict]) -> list[str]:
    """Which link the rows ran on: one line per distinct ``link`` (kvlens.bench.links),
    or none when every row ran on links kvlens did not shape."""
    seen = dict.fromkeys((r.get("link") or {}).get("summary") for r in rows)
    return [f"links (measured by the stack's probe): {s}" for s in seen if s]


def report_text(run, cc: CrossCheck | None = None) -> str:
    """The table, its legend, what it measured and the cross-checks of a run
    (a :class:`~kvlens.bench.runner.BenchRun`); every line but the table's
    wrapped to :data:`WIDTH`, the table itself narrow unless ``run.opts.wide``."""
    rows = add_ratios(run.rows)
    wide = bool(run.opts and run.opts.wide)
    out = ["", format_table(rows, wide=wide)]
    legend = (
        "(times in ms; push/pull < 1: push is faster on that cell; [lo-hi]: its 95% confidence interval, "
        "[?]: not enough data for one; a side is lower only where the interval excludes 1"
        + (
            ""
            if wide
            else "; n: completed/sent requests, !: the machine was busy; every figure: --wide, or the rows with --json PATH"
        )
        + ")"
    )
    out += [wrap(legend, indent="")] + [wrap(x, indent="") for x in link_lines(rows)]
    if run.repeat > 1 and run.interrupted:
        done = max((c.round for c in run.cells), default=0)
        out.append(f"(interrupted in round {done} of {run.repeat}: rows pool the rounds that ran)")
    out += ["", "What this measured:"]
    out += [wrap(x) for x in describe(rows) + caveats(rows, run.fresh_stacks, run.started_stacks)]
    out += ["", "Cross-checks:"] + [wrap(x) for x in (cc or cross_check(run.cells)).lines()]
    where = f"run {run.run_id}: {len(rows)} rows saved to {run.store}"
    if run.json_path:
        where += f" and {run.json_path}"
    return "\n".join(out + ["", wrap(where, indent="")])


def print_report(run, out=None) -> CrossCheck:
    """Print :func:`report_text` of a run to ``out`` (default stdout)."""
    cc = cross_check(run.cells)
    print(report_text(run, cc), file=out or sys.stdout, flush=True)
    return cc
