"""The one error a stack start-up raises."""

from __future__ import annotations


class StackError(RuntimeError):
    """A stack could not start (bad input, busy port, a child died, timeout)."""
