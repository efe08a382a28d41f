"""The errors a stack start-up raises, each with its exit code
(:mod:`kvlens.exits`: the same in ``kvlens up``, ``bench`` and ``demo``)."""

from __future__ import annotations

from kvlens import exits


class StackError(RuntimeError):
    """A stack could not start (bad input, busy port, a child died, timeout).
    As it is, the start ran and failed (exit 1: a busy port, a child that
    died or never became ready may not be there next time)."""

    exit_code = exits.FAILED


class StackInputError(StackError):
    """What the command line gives or names cannot be used, before any child
    starts: a model directory that is none, a tool a flag asks for that is
    not installed (exit 2, as a bad flag: running it again unchanged fails
    the same way)."""

    exit_code = exits.USAGE
