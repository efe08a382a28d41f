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
