"""Exit codes, the same in every ``kvlens`` command (docs/production.md,
"Exit codes"). The rule: what went wrong decides the code, not which
command met it.

* :data:`OK` (0): done; a service or a stack stopped by Ctrl-C or SIGTERM
  included.
* :data:`FAILED` (1): the command ran and failed, and the same command line
  may work later: a PostgreSQL server that cannot be reached now, a port
  another process holds, a child (vLLM, the router, Streamlit) that died or
  never became ready, a trace asked for that is not (yet) in the store.
* :data:`USAGE` (2): what the command line gives or names cannot be used,
  and running it again unchanged fails the same way: a bad flag or value
  (argparse's own code), a missing trace store, a file or database that is
  no kvlens store, a store of a newer kvlens, credentials the server
  refuses, a malformed store URL, a directory where a file belongs, a model
  directory that is none, a tool a flag asks for that is not installed.
* :data:`INTERRUPTED` (130): a run with results (bench, demo) cut short by
  Ctrl-C or SIGTERM; what finished is kept.
"""

from __future__ import annotations

import sys

OK = 0
FAILED = 1
USAGE = 2
INTERRUPTED = 130

#: What to do about a missing store, said after its one line.
MISSING_HINT = "run `kvlens up` and send requests, or pass --store"


def store_exit(cmd: str, e: Exception) -> int:
    """Say the store error ``e`` as one line on stderr (``kvlens CMD: ...``,
    naming the store; a missing one with what to do) and return its code:
    :data:`FAILED` for a server that cannot be reached now
    (``StoreUnavailable``), :data:`USAGE` for every other store error."""
    from kvtrace import store

    hint = f" ({MISSING_HINT})" if isinstance(e, store.StoreMissing) else ""
    print(f"kvlens {cmd}: {e}{hint}", file=sys.stderr, flush=True)
    return store_code(e)


def store_code(e: Exception) -> int:
    """The exit code of a store error (:func:`store_exit`), without saying it."""
    from kvtrace import store

    return FAILED if isinstance(e, store.StoreUnavailable) else USAGE
