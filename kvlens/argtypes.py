"""argparse ``type=`` helpers shared by the commands (bad values fail at
parse time: one line naming the flag, exit 2)."""

from __future__ import annotations

import argparse
import math


def positive(kind: type):
    """argparse ``type=``: a finite number > 0 of ``kind`` (int or float)."""

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a{'n integer' if kind is int else ' number'}: {text!r}") from None
        if not math.isfinite(v) or v <= 0:
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
        return v

    parse.__name__ = kind.__name__
    return parse


def int_in(lo: int, hi: int, what: str = "an integer"):
    """argparse ``type=``: an integer in ``lo..hi`` (a usage error naming the
    value otherwise); ``what`` names the kind in the message and in argparse's."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{text} out of range {lo}..{hi}")
        return v

    parse.__name__ = "port" if what == "a port number" else "int"
    return parse


def from_parser(fn, *errors: type[Exception]):
    """argparse ``type=`` around a parser that raises one of ``errors``
    with a message fit for the user (the message becomes the usage error)."""

    def parse(text: str):
        try:
            return fn(text)
        except errors as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = getattr(fn, "__name__", "value")
    return parse


def duration_text(max_s: float):
    """argparse ``type=``: a duration in (0, ``max_s``] (``30s``, ``10m``,
    ``2h``, ``1d``, plain seconds), returned as the user typed it."""
    from kvrecord.durations import parse_duration

    def check(text: str) -> str:
        parse_duration(text, max_s=max_s)
        return text

    return from_parser(check, ValueError)


def add_keep_arguments(p: argparse.ArgumentParser, default: str = "all") -> None:
    """``--keep``, ``--keep-ratio``, ``--keep-slow``: which requests keep their
    spans (:mod:`kvrecord.keeprule`); checked by :func:`keep_rule`."""
    p.add_argument(
        "--keep",
        default=default,
        metavar="all|sampled",
        help=f"all: store every request's spans (default {default}); sampled: a summary row for every "
        "request, spans only for failed, clock-unknown, slow and --keep-ratio of the rest",
    )
    p.add_argument(
        "--keep-ratio",
        default=None,
        metavar="R",
        help="with --keep sampled: share of the other requests kept whole, 0 to 1, picked by trace id (default 0.01)",
    )
    p.add_argument(
        "--keep-slow",
        default=None,
        metavar="pNN|DURATION",
        help="with --keep sampled: a request is slow when its handoff or TTFT is above this percentile of "
        "its (mode, dispatch, P/D pair) window, or above a fixed duration such as 500ms (default p99)",
    )


def keep_rule(args: argparse.Namespace):
    """The :class:`kvrecord.keeprule.KeepRule` of the flags; ValueError naming the flag."""
    from kvrecord.keeprule import KeepRule

    keep = getattr(args, "keep", None)
    rule = KeepRule.parse(keep, getattr(args, "keep_ratio", None), getattr(args, "keep_slow", None))
    if not rule.sampled:
        for flag in ("keep_ratio", "keep_slow"):
            if getattr(args, flag, None) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} applies only with --keep sampled")
    return rule


#: Environment variables the API key is read from when no flag gives it (the
#: first set wins); ``VLLM_API_KEY`` is what vLLM itself reads.
API_KEY_ENV = ("KVLENS_API_KEY", "VLLM_API_KEY")


def add_api_key_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """``--api-key-file`` and ``--api-key`` (kept, with a warning: ps shows it),
    for ``kvlens proxy``, ``up`` and ``bench``. ``what``: who requires it."""
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help=f"file holding the API key: {what} (default: ${API_KEY_ENV[0]}, else ${API_KEY_ENV[1]}, else none)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="the API key as a flag value: ps shows it to every user of the host (a warning says so); "
        f"prefer --api-key-file or ${API_KEY_ENV[0]}",
    )


def api_key_arg(args: argparse.Namespace, warn) -> str | None:
    """The API key the flags give: ``--api-key-file``'s content, else
    ``--api-key`` (``warn`` gets one line naming the risk), else None (the
    caller falls back to :data:`API_KEY_ENV`). ValueError naming the
    problem: both flags, an unreadable or empty file, a key with spaces."""
    path, flag = getattr(args, "api_key_file", None), getattr(args, "api_key", None)
    if path and flag:
        raise ValueError("give the API key once: --api-key-file or --api-key, not both")
    if path:
        try:
            with open(path, "rb") as f:
                key = f.read().decode("utf-8", "replace").strip()
        except OSError as e:
            raise ValueError(f"cannot read --api-key-file {path}: {e.strerror or e}") from None
        if not key or any(c.isspace() or not c.isprintable() for c in key):
            raise ValueError(f"--api-key-file {path}: the key must be one line of printable characters, no spaces")
        return key
    if flag:
        warn(
            "warning: --api-key puts the key on the command line, where ps shows it to every user of "
            f"this host; use --api-key-file PATH or ${API_KEY_ENV[0]} instead"
        )
    return flag or None
