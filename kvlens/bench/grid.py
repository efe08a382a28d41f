"""The benchmark grid: its options, their validation and the run order.

Pure (no I/O except reading a model's ``config.json``); every problem is a
:class:`BenchError` raised before any load is sent.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from kvrecord.semconv import Dispatch, Mode
from kvlens.stack.commands import MAX_MODEL_LEN

MODES = tuple(m.value for m in Mode)  # ("push", "pull")
DISPATCHES = tuple(d.value for d in Dispatch)  # ("overlapped", "sequential")
#: The ``--max-model-len`` of the stacks kvlens starts.
DEFAULT_MAX_MODEL_LEN = MAX_MODEL_LEN


class BenchError(ValueError):
    """Bad input found before any load is sent (exit code 2)."""


@dataclass
class BenchOptions:
    """One run's grid and knobs. Times in seconds; ``store``/``json_path``
    default to ``<home>/traces.db`` and no JSON file."""

    qps: Sequence[float] = (1.0, 2.0, 4.0)
    input_lens: Sequence[int] = (256, 1024, 2048)
    output_len: int = 32
    num_prompts: int = 32
    seed: int = 0
    warmup: int = 2
    trace_wait_s: float = 30.0
    store: Path | str | None = None
    json_path: Path | str | None = None
    prefix_caching: bool = False
    progress: bool = True
    request_timeout_s: float = 120.0
    model: Path | str | None = None  # tokenizer (and model for started stacks)
    api_key: str | None = field(default=None, repr=False)  # the routers' (and started stacks') API key
    decode_url: str | None = None  # D's base URL for the TPOT cross-check (started stacks: their own D)
    repeat: int = 1  # rounds of the whole grid, push and pull in ABBA order (kvlens.bench.rounds)
    fresh_stacks: bool = False  # started stacks: a fresh stack for every round of every mode
    #: ``--link`` specs: started stacks run ``hosts`` with these links (:mod:`kvlens.bench.links`)
    links: Sequence[str] = ()
    wide: bool = False  # the report's table with every figure (``--wide``), not the 120-column one


def parse_list(text: str, kind: type, what: str) -> list:
    """``"1,2,4"`` -> ``[1.0, 2.0, 4.0]``; a clear BenchError otherwise."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise BenchError(f"{what}: empty list")
    out = []
    for t in items:
        try:
            v = kind(t)
        except ValueError:
            raise BenchError(f"{what}: {t!r} is not a{'n integer' if kind is int else ' number'}") from None
        if isinstance(v, float) and not math.isfinite(v):
            raise BenchError(f"{what}: {t!r} is not a finite number")
        out.append(v)
    return out


def parse_names(text: str, allowed: Sequence[str], what: str) -> list[str]:
    """``"push,PULL,push"`` -> ``["push", "pull"]`` (lower case, deduplicated, checked)."""
    names = [t.strip().lower() for t in str(text).split(",") if t.strip()]
    if not names:
        raise BenchError(f"{what}: empty list")
    for n in names:
        if n not in allowed:
            raise BenchError(f"unknown {what} {n!r}: choose from {', '.join(allowed)}")
    return list(dict.fromkeys(names))


def _check_names(modes: Sequence[str], dispatches: Sequence[str]) -> None:
    for m in modes:
        if m not in MODES:
            raise BenchError(f"unknown mode {m!r}: choose from {', '.join(MODES)}")
    if not modes:
        raise BenchError("no mode given")
    for d in dispatches:
        if d not in DISPATCHES:
            raise BenchError(f"unknown dispatch {d!r}: choose from {', '.join(DISPATCHES)}")


def _positive_int(v, what: str) -> None:
    if int(v) != v or v < 1:
        raise BenchError(f"{what} must be a positive integer, got {v}")


def validate_grid(
    *,
    modes: Sequence[str],
    dispatches: Sequence[str],
    qps: Sequence[float],
    input_lens: Sequence[int],
    output_len: int,
    num_prompts: int,
    max_model_len: int | None = None,
    repeat: int = 1,
) -> None:
    """Raise BenchError naming the first problem with the grid."""
    _check_names(modes, dispatches)
    _positive_int(repeat, "--repeat")
    if not qps:
        raise BenchError("no QPS given")
    for q in qps:
        if not (isinstance(q, (int, float)) and math.isfinite(q) and q > 0):
            raise BenchError(f"QPS must be > 0, got {q}")
    if not input_lens:
        raise BenchError("no input length given")
    for n in input_lens:
        _positive_int(n, "input length")
    _positive_int(output_len, "output length")
    _positive_int(num_prompts, "num-prompts")
    for n in input_lens if max_model_len else ():
        if n + output_len > max_model_len:
            raise BenchError(
                f"input length {n} + output length {output_len} = {n + output_len} tokens "
                f"exceeds the model's max-model-len {max_model_len}"
            )


def model_max_len(model_dir: Path | str | None) -> int | None:
    """min(config.json max_position_embeddings, the max-model-len stacks use);
    None without a readable ``config.json``."""
    if model_dir is None:
        return None
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    mpe = cfg.get("max_position_embeddings")
    return min(int(mpe), DEFAULT_MAX_MODEL_LEN) if mpe else DEFAULT_MAX_MODEL_LEN


def plan_groups(
    modes: Sequence[str], dispatches: Sequence[str], mixed: bool = False
) -> list[tuple[str, list[str | None]]]:
    """Stacks to start, in order: pull first (so push rows get ratios when
    written), then push with its dispatches (one P/D pair, one router each).
    ``mixed``: push and pull with one dispatch go to one mixed fleet
    (``("push,pull", [dispatch])``: both pairs behind one router, each
    request naming its half), so both modes run on the same stack and links."""
    if mixed and set(modes) == set(MODES) and len(dispatches) == 1:
        return [(",".join(MODES), list(dispatches))]
    groups: list[tuple[str, list[str | None]]] = []
    if "pull" in modes:
        groups.append(("pull", [None]))
    if "push" in modes:
        groups.append(("push", list(dispatches)))
    return groups
