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


MAX_PORT = 65535


def port_arg(allow_zero: bool = False):
    """An argparse ``type=``: a TCP port 1..65535 (0 too with ``allow_zero``:
    "pick a free one"); anything else is a usage error naming the value."""
    return int_in(0 if allow_zero else 1, MAX_PORT, "a port number")


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
