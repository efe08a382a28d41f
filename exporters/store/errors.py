"""What can go wrong opening or reading the store, as exceptions a caller can
print as one line (``kvlens traces``) or show as a message (the dashboard).

Every one is a :class:`StoreError`; their ``str()`` names the file and says
what to do. The backend's own exceptions (``sqlite3.Error``) never leave
:mod:`exporters.store` for reads made through :func:`exporters.store.reading`.
"""

from __future__ import annotations


class StoreError(Exception):
    """The store cannot be used: not a kvlens store, corrupt, locked, too new."""


class StoreMissing(StoreError, FileNotFoundError):
    """A reader found no store file. Also a ``FileNotFoundError``, so callers
    that only know that type (the handoff resolver, the bench) keep working."""


class StoreCorrupt(StoreError):
    """The file exists but is not a readable kvlens store (0 bytes, garbage,
    another program's database, or damaged)."""


class StoreVersionError(StoreError):
    """The store was written by a newer kvlens (its schema version is higher
    than this code knows). Reading or writing it could misread or damage it."""

    def __init__(self, path: object, found: int, known: int):
        self.path, self.found, self.known = path, found, known
        super().__init__(
            f"trace store {path} has schema version {found}, but this kvlens knows only up to "
            f"version {known}: upgrade kvlens, or point --store at another file"
        )
