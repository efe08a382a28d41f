"""Server-sent events from vLLM's OpenAI server: the one "first text token"
rule, shared by the router (client-seen TTFT) and the bench (its own TTFT).

An event counts as the first token when one of its choices carries generated
text: ``text`` (completions) or ``delta.content`` / ``delta.reasoning_content``
(chat). Role-only chat deltas and empty chunks do not count.
"""

from __future__ import annotations

import json
from typing import Any


def parse_data_line(line: str | bytes) -> dict[str, Any] | None:
    """The JSON object of one ``data: {...}`` SSE line; None for anything else
    (comments, ``[DONE]``, blank keep-alives, broken JSON, non-objects)."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", "replace")
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    try:
        ev = json.loads(data)
    except ValueError:
        return None
    return ev if isinstance(ev, dict) else None


def has_text(event: dict[str, Any]) -> bool:
    """True when one of the event's choices carries generated text."""
    for ch in event.get("choices") or ():
        if not isinstance(ch, dict):
            continue
        if ch.get("text"):
            return True
        delta = ch.get("delta")
        if isinstance(delta, dict) and (delta.get("content") or delta.get("reasoning_content")):
            return True
    return False


class TextTimes:
    """Every SSE event with generated text in a byte stream fed in arbitrary
    chunks, for the client-seen TPOT: when the first and the last arrived
    and how many tokens came (the final ``usage.completion_tokens`` when the
    stream carries it, else one per text event: vLLM sends a token per
    event unless a step yields several)."""

    def __init__(self) -> None:
        self.buf = b""
        self.first_s: float | None = None
        self.last_s: float | None = None
        self.events = 0
        self.usage_tokens: int | None = None

    def feed(self, chunk: bytes, now_s: float) -> bool:
        """Take ``chunk`` (arrived at ``now_s``); True on the chunk that
        completes the first text event (once)."""
        first = False
        self.buf += chunk
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            ev = parse_data_line(line)
            if ev is None:
                continue
            usage = ev.get("usage")
            n = usage.get("completion_tokens") if isinstance(usage, dict) else None
            if isinstance(n, int) and not isinstance(n, bool):
                self.usage_tokens = n
            if has_text(ev):
                self.events += 1
                self.last_s = now_s
                if self.first_s is None:
                    self.first_s = now_s
                    first = True
        return first

    def tpot_s(self) -> float | None:
        """(last token - first token) / (tokens - 1); None with fewer than 2
        tokens or when they all arrived at once (not measured)."""
        n = self.usage_tokens if self.usage_tokens is not None else self.events
        if self.first_s is None or self.last_s is None or n < 2 or self.last_s <= self.first_s:
            return None
        return (self.last_s - self.first_s) / (n - 1)
