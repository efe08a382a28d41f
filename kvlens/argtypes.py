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
