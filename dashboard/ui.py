"""What every dashboard page shares: the app's configuration (its script
arguments), the store guard that turns a missing / unreadable store into a
message, and number formatting. Runs on Streamlit's script thread.
"""

from __future__ import annotations

import argparse
import math
import numbers
import sys
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Iterable

import pandas as pd
import streamlit as st

from dashboard import data
from dashboard import loaders
from kvrecord.config import default_store
from kvtrace.store import StoreLocation


#: Session-state flag: the entry (``app.py``) ran in this session, so its navigation is on.
NAV_KEY = "_kvlens_nav"


def run_page(main: Callable[[], None], name: str) -> None:
    """Run a page script's ``main`` (call it under ``if __name__ == "__main__":``).

    Streamlit runs a page file through the entry's ``st.navigation``, except
    on a fresh server whose first request lands on ``/<name>``: then its
    legacy ``pages/`` runner runs the file alone (no navigation, no sidebar)
    until the entry runs once. In that case hand over to the entry, which
    opens the same page (``?page=<name>`` plus the request's own params)."""
    if not st.session_state.get(NAV_KEY):
        st.switch_page("app.py", query_params={**st.query_params.to_dict(), "page": name})
    main()


@dataclass(frozen=True)
class Config:
    """Where the pages read from: the trace store (``str()`` of it hides a
    URL's password) and Prometheus' base URL (None: not set)."""

    store: StoreLocation
    prometheus: str | None


def parse_config(argv: list[str] | None = None) -> Config:
    """Script arguments (after ``--`` on the streamlit command line; default ``sys.argv[1:]``).
    No ``--store``: ``$KVLENS_HOME/traces.db`` (:func:`kvrecord.config.default_store`)."""
    p = argparse.ArgumentParser(prog="kvlens-dashboard", add_help=False, allow_abbrev=False)
    p.add_argument("--store", default=None)
    p.add_argument("--prometheus", default=None)
    args, _ = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    store = StoreLocation.parse(args.store) if args.store else default_store()
    return Config(store=store, prometheus=(args.prometheus or None))


def guarded(cfg: Config, fn: Callable[[], Any]) -> tuple[bool, Any]:
    """Run a store load: ``(True, result)``, or ``(False, None)`` after showing a
    message for a missing / unreadable store (never a traceback)."""
    try:
        return True, fn()
    except data.StoreMissing:
        st.warning(
            f"No trace store at `{cfg.store}` yet. It appears once an instrumented P/D pair "
            "(`kvlens up`, `kvlens demo`) has served a request; pick another file or database with "
            "`kvlens dashboard --store PATH|URL`."
        )
    except data.StoreError as e:
        st.error(f"The trace store could not be read: {e}")
    return False, None


def store_banner(cfg: Config) -> dict[str, Any] | None:
    """The store's summary (``data.store_info``), saying so when it is empty;
    None (message shown) when it is missing or unreadable."""
    ok, info = guarded(cfg, lambda: loaders.load_info(cfg.store, loaders.now_bucket()))
    if not ok:
        return None
    if not info["traces"] and not info["bench_runs"]:
        st.info(f"The trace store `{cfg.store}` is empty: no request has been traced yet.")
    return info


#: What a table cell or card shows for a figure that is missing (a caption or tooltip says why).
MISSING = "-"


def _missing(v: Any) -> bool:
    return v is None or (pd.api.types.is_scalar(v) and bool(pd.isna(v)))


def time_unit(values: Iterable[float | None]) -> tuple[str, float]:
    """One unit for a row of cards: ``("ms", 1e3)`` unless a figure reaches 10 s, then ``("s", 1)``."""
    vals = [abs(v) for v in values if not _missing(v)]
    return ("s", 1.0) if vals and max(vals) >= 10 else ("ms", 1e3)


def fmt_short(v: float | None, scale: float = 1.0) -> str:
    """A card value in at most 5 characters (unit in the card's label): ``6.04``, ``13.1``,
    ``354``, ``1,234``; ``-`` when missing. ``scale`` converts it first (1e3: s to ms)."""
    if _missing(v):
        return MISSING
    x = v * scale
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 1 or x == 0:
        return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"
    return f"{x:.3f}" if abs(x) >= 0.01 else f"{x:.1e}"  # 0.550, 0.012: TPOT in a row of seconds


def fmt_rate(v: float | None) -> str:
    """A rate (per second) in at most 6 characters: ``1.5``, ``0.0083``, ``1,234``; ``-`` when missing."""
    if _missing(v):
        return MISSING
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.3g}" if abs(v) >= 1 or v == 0 else f"{v:.2g}" if abs(v) >= 1e-3 else f"{v:.0e}"


def fmt_handoff(h: float | None, err: float | None, note: str | None = None) -> str:
    """A handoff in ms with its clock bound, to the digits the bound supports
    (``9,247.0 ± 0.4 ms``); ``unknown`` when the store could not bound the P/D
    clocks (the note says why elsewhere)."""
    if _missing(h):
        return "unknown" if note else MISSING
    return f"{fmt_ms(h)} ms" if _missing(err) else f"{fmt_ms(h, err)} ± {fmt_err_ms(err)} ms"


def bound_decimals(err_ms: float | None) -> int | None:
    """Decimal places of ms that a bound of ± ``err_ms`` supports: down to its
    first significant digit, one more when that digit is 1 (±0.4: 1, ±0.15: 2,
    ±3: 0, ±40: -1, i.e. tens); None when unknown or 0."""
    if _missing(err_ms) or err_ms <= 0:
        return None
    e = math.floor(math.log10(err_ms))
    return -e + (1 if round(err_ms / 10.0**e, 9) < 2 else 0)


def _fixed(x: float, d: int) -> str:
    return f"{round(x, d):,.0f}" if d <= 0 else f"{x:,.{d}f}"


def fmt_ms(v_s: float | None, err_s: float | None = None) -> str:
    """Seconds as a ms figure (no unit) to what the bound ``err_s`` supports
    (:func:`bound_decimals`: ±0.4 ms shows 0.1 ms); without a bound, 3
    significant digits and whole ms at least (``12.3``, ``9,247``); ``-`` when missing."""
    if _missing(v_s):
        return MISSING
    v = v_s * 1e3
    d = bound_decimals(None if _missing(err_s) else err_s * 1e3)
    if d is None:
        d = 0 if v == 0 or abs(v) >= 100 else 2 - math.floor(math.log10(abs(v)))
    return _fixed(v, d)


def fmt_err_ms(err_s: float | None) -> str:
    """A clock bound (seconds) in ms, to its first significant digit (two when
    that digit is 1); ``-`` when missing."""
    if _missing(err_s):
        return MISSING
    d = bound_decimals(err_s * 1e3)
    return "0" if d is None else _fixed(err_s * 1e3, d)


def clock_caption(rec: dict) -> str:
    """One sentence on how a trace's P and D clocks were reconciled."""
    lo, off, note = rec.get("clock_interval_s"), rec.get("clock_offset_s"), rec.get("handoff_note")
    if rec.get("handoff_s") is None and note:
        return f"handoff {note}."
    if not lo:
        return "no P↔D clock bound for this trace."
    iv = f"[{lo[0] * 1e3:+.2f}, {lo[1] * 1e3:+.2f}] ms"
    if off:
        return f"D's clock is {off * 1e3:+.2f} ms off P's (interval {iv}); D's spans are shown on P's clock."
    return f"D's clock minus P's lies in {iv}, which contains 0: times as recorded."


def fmt_n(v: float | None, digits: int = 0) -> str:
    """A count with thousands separators (an integer unless ``digits``); ``-`` when missing."""
    if _missing(v):
        return MISSING
    return f"{v:,.{digits}f}"


def fmt_ts(ns: int | None) -> str:
    """Wall-clock ns as local ``YYYY-mm-dd HH:MM:SS``; ``n/a`` when missing."""
    return datetime.fromtimestamp(ns / 1e9).strftime("%Y-%m-%d %H:%M:%S") if ns else "n/a"


def table_view(df: pd.DataFrame, formats: dict[str, str] | None = None) -> pd.DataFrame:
    """A display copy of ``df`` for ``st.dataframe``: every cell text, ``-`` for a
    missing one (Streamlit draws a missing cell as "None"), counts as integers.
    ``formats``: column -> format spec (``".3f"``, ``",.0f"``) or template (``"{:.2f}×"``);
    other numbers ``.6g``.
    The columns are text, so say in their ``help`` what ``-`` means."""
    formats = formats or {}
    out = pd.DataFrame(index=df.index)
    for c in df.columns:
        spec = formats.get(c)
        out[c] = [MISSING if _missing(v) else _cell(v, spec) for v in df[c]]
    return out


def _cell(v: Any, spec: str | None) -> str:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return str(v)
    if spec:
        return spec.format(v) if "{" in spec else format(v, spec)
    return f"{int(v):,}" if isinstance(v, numbers.Integral) else format(float(v), ".6g")
