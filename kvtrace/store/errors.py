"""What can go wrong opening or reading the store, as exceptions a caller can
print as one line (``kvlens traces``) or show as a message (the dashboard).

Every one is a :class:`StoreError`; their ``str()`` names the file (or the
PostgreSQL host:port and database, never a password) and says what to do.
The backends' own exceptions (``sqlite3.Error``, ``psycopg.Error``) never
leave :mod:`kvtrace.store` for reads made through
:func:`kvtrace.store.reading`; a PostgreSQL store's connection errors come
out as these kinds for writers too.
"""

from __future__ import annotations

# the two a store's *name* can raise live with the naming, in the bottom layer
from kvrecord.location import StoreError, StoreUrlError  # noqa: F401  (kinds of StoreError, re-exported)


class StoreMissing(StoreError, FileNotFoundError):
    """A reader found no store file. Also a ``FileNotFoundError``, so callers
    that only know that type (the handoff resolver, the bench) keep working."""


class StoreCorrupt(StoreError):
    """The file exists but is not a readable kvlens store (0 bytes, garbage,
    another program's database, or damaged)."""


class StoreUnavailable(StoreError):
    """The PostgreSQL server cannot be reached now (down, refusing, restarting,
    out of connections) or went away mid-write. Transient: a writer retries
    (:func:`is_transient`); a command prints it and exits non-zero."""


class StoreAccessDenied(StoreError):
    """The PostgreSQL server refused these credentials or this user's rights."""


class StoreVersionError(StoreError):
    """The store was written by a newer kvlens (its schema version is higher
    than this code knows). Reading or writing it could misread or damage it."""

    def __init__(self, path: object, found: int, known: int):
        self.path, self.found, self.known = path, found, known
        super().__init__(
            f"trace store {path} has schema version {found}, but this kvlens knows only up to "
            f"version {known}: upgrade kvlens, or point --store at another store"
        )


def is_transient(e: BaseException) -> bool:
    """Whether a failed write may succeed if retried soon: SQLite's
    "locked"/"busy", a PostgreSQL server that is unreachable or went away,
    a deadlock / serialization failure, a pool with no free connection."""
    import sqlite3

    if isinstance(e, StoreUnavailable):
        return True
    if isinstance(e, sqlite3.OperationalError):
        msg = str(e).lower()
        return "locked" in msg or "busy" in msg
    mod = type(e).__module__ or ""
    if mod.startswith(("psycopg", "psycopg_pool")):
        import psycopg

        if isinstance(e, (psycopg.OperationalError, psycopg.errors.TransactionRollback)):
            return True
        try:
            from psycopg_pool import PoolTimeout

            return isinstance(e, PoolTimeout)
        except ImportError:
            return False
    return False
