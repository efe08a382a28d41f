"""``--link`` specs of ``kvlens up --hosts``: which direction between two
roles gets which delay, jitter, rate and loss (docs/links.md). Pure.

A spec is ``A-B=SHAPE`` (both directions, each with the whole shape: a
one-way delay ``d`` on P<->D gives a round trip of ``2d``) or ``A>B=SHAPE``
(A to B only). Roles: ``p`` (every P), ``d`` (every D), ``router``,
``collector``, ``store`` (``--store-command``'s namespace), ``client`` (the host's end, where the stack's health checks,
tests and ``kvlens bench`` run). ``SHAPE`` is ``DELAY[,JITTER][,RATE][,LOSS]``
told apart by unit: times (``us``, ``ms``, ``s``; the first is the delay, a
second one the jitter), a rate in tc's units (``bit``, ``kbit``, ``mbit``,
``gbit``) and a loss in percent (``0.1%``). Examples: ``p-d=2ms,10gbit``,
``p-d=20ms,1gbit,0.1%``, ``router>d=5ms,1ms``. A loss drops each packet
with that probability where it arrives (never toward the client).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvlens.stack.errors import StackError

ROLES = ("p", "d", "router", "collector", "store", "client")
#: Longest delay (and jitter) accepted: more is a broken link, not a slow one.
MAX_DELAY_S = 10.0
#: tc's rate limits: tbf takes 64-bit rates, but below 8 kbit/s nothing of a stack gets through in time.
MIN_RATE_BPS, MAX_RATE_BPS = 8_000, 400_000_000_000

_TIME = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_LOSS = re.compile(r"^(\d+(?:\.\d+)?)%$")
_TIME_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_RATE_UNIT = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


@dataclass(frozen=True)
class Shape:
    """One direction's asked conditions: seconds, bits per second (None:
    unlimited) and a drop probability (0..1)."""

    delay_s: float = 0.0
    jitter_s: float = 0.0
    rate_bps: float | None = None
    loss: float = 0.0

    def to_json(self) -> dict:
        return {"delay_s": self.delay_s, "jitter_s": self.jitter_s, "rate_bps": self.rate_bps, "loss": self.loss}

    @property
    def delayed(self) -> bool:
        return self.delay_s > 0 or self.jitter_s > 0


@dataclass(frozen=True)
class LinkSpec:
    """``src`` to ``dst`` (roles of :data:`ROLES`) with ``shape``."""

    src: str
    dst: str
    shape: Shape


def parse_shape(text: str) -> Shape:
    """``DELAY[,JITTER][,RATE][,LOSS]`` (module docstring); StackError naming the bad part."""
    times: list[float] = []
    rate = loss = None
    parts = [x.strip().lower() for x in text.split(",")]
    if not text.strip() or any(not x for x in parts):
        raise StackError(f"link shape {text!r} is empty or has an empty part (want DELAY[,JITTER][,RATE][,LOSS])")
    for part in parts:
        if m := _TIME.match(part):
            if len(times) == 2:
                raise StackError(f"link shape {text!r} has more than two times (a delay and a jitter)")
            times.append(float(m.group(1)) * _TIME_UNIT[m.group(2)])
        elif m := _RATE.match(part):
            if rate is not None:
                raise StackError(f"link shape {text!r} has two rates")
            rate = float(m.group(1)) * _RATE_UNIT[m.group(2)]
            if not MIN_RATE_BPS <= rate <= MAX_RATE_BPS:
                raise StackError(f"link rate {part!r} is outside 8kbit..400gbit")
        elif m := _LOSS.match(part):
            if loss is not None:
                raise StackError(f"link shape {text!r} has two losses")
            loss = float(m.group(1)) / 100
            if not 0 <= loss < 1:
                raise StackError(f"link loss {part!r} must be at least 0% and below 100%")
        else:
            raise StackError(
                f"link shape part {part!r} is not a time (20ms, 500us, 1s), a rate (200mbit, 10gbit) or a loss (0.1%)"
            )
    delay, jitter = (times + [0.0, 0.0])[:2]
    if delay > MAX_DELAY_S or jitter > MAX_DELAY_S:
        raise StackError(f"link shape {text!r}: delay and jitter must be at most {MAX_DELAY_S:g}s")
    if jitter > delay:
        raise StackError(f"link shape {text!r}: jitter {jitter:g}s exceeds the delay {delay:g}s")
    return Shape(delay, jitter, rate, loss or 0.0)


def parse_link(text: str) -> list[LinkSpec]:
    """One ``--link`` value as one or two directions; StackError naming the problem."""
    name, eq, shape_text = text.partition("=")
    if not eq:
        raise StackError(f"--link {text!r}: want A-B=SHAPE or A>B=SHAPE (e.g. p-d=20ms,200mbit)")
    name = name.strip().lower()
    both = ">" not in name
    a, sep, b = name.partition("-" if both else ">")
    if not sep or a not in ROLES or b not in ROLES:
        raise StackError(f"--link {text!r}: the ends must be two of {', '.join(ROLES)} joined by - or >")
    if a == b:
        raise StackError(f"--link {text!r}: a link joins two different roles")
    shape = parse_shape(shape_text)
    if shape.loss and "client" in ((a, b) if both else (b,)):
        raise StackError(
            f"--link {text!r}: no loss toward the client: kvlens leaves the host's own namespace alone, and a "
            "drop on the sender's way out is an error its socket sees, not a lost packet (give it as A>B, "
            "away from the client)"
        )
    return [LinkSpec(a, b, shape)] + ([LinkSpec(b, a, shape)] if both else [])


def parse_links(texts) -> dict[tuple[str, str], Shape]:
    """Every ``--link`` value: (src, dst) -> shape; a direction given twice is a StackError."""
    out: dict[tuple[str, str], Shape] = {}
    for text in texts or ():
        for spec in parse_link(text):
            if (spec.src, spec.dst) in out:
                raise StackError(f"--link: the direction {spec.src}>{spec.dst} is given twice")
            out[(spec.src, spec.dst)] = spec.shape
    return out


def release_time(arrival: float, last: float, delay_s: float, jitter_s: float, u: float) -> float:
    """When the delayer accepts a packet that arrived at ``arrival``: the
    delay plus a jitter drawn from ``u`` in [0, 1) (uniform over
    ``delay ± jitter``), never before the previous packet's release
    ``last`` (a FIFO: jitter never reorders)."""
    return max(arrival + delay_s + (2 * u - 1) * jitter_s, last)
