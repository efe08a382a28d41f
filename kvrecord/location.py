"""How a trace store is named, in one place: where the user's text enters.

A store is named by a **path** (an SQLite file, the default for one host) or
a **URL** ``postgresql://user[:password]@host[:port]/dbname`` (also
``postgres://``; libpq query parameters such as ``?sslmode=require`` pass
through): a PostgreSQL database the whole fleet shares.
:meth:`StoreLocation.parse` turns what a user typed into one of the two,
once, and everything after it passes the :class:`StoreLocation` on instead
of the text (``Path(...)`` would mangle ``postgresql://u@h/db`` into
``postgresql:/u@h/db``); ``str()`` of one names it in messages, a URL's
password hidden.

Pure Python (no driver, no SQL), so options can be checked in the bottom
layer; the store (:mod:`kvtrace.store`) re-exports these names.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

URL_SCHEMES = ("postgresql", "postgres")
#: Where libpq (and so psycopg) reads a password the URL does not hold; the
#: processes kvlens starts get a URL's password here, never on their command line.
PASSWORD_ENV = "PGPASSWORD"
SQLITE = "sqlite"
POSTGRESQL = "postgresql"
_USE = "(use postgresql://user@host:port/dbname)"


class StoreError(Exception):
    """The store cannot be used: not a kvlens store, corrupt, locked, too new.
    Its kinds are in :mod:`kvtrace.store.errors`."""


class StoreUrlError(StoreError, ValueError):
    """A malformed store URL (``postgresql://user@host:port/dbname`` expected).
    Also a ``ValueError``, for argument checks that catch that."""


@dataclass(frozen=True)
class StoreLocation:
    """Where a trace store is: ``kind`` ``"sqlite"`` with an absolute
    ``path``, or ``"postgresql"`` with a checked ``url``. Immutable and
    hashable; ``str()`` is :attr:`display` (a URL's password hidden), so a
    location can go into any message or log line. :attr:`text` is the whole
    name, password included: only for what must reach the store itself (a
    child's command line, a config value).

    Build one with :meth:`parse` (what a user typed) or :meth:`sqlite` (a
    file path kvlens made itself, such as ``<home>/traces.db``)."""

    kind: str
    path: Path | None = None
    url: str | None = None

    def __post_init__(self) -> None:
        if (self.kind, self.path is None, self.url is None) not in ((SQLITE, False, True), (POSTGRESQL, True, False)):
            raise ValueError("a store location is kind 'sqlite' with a path, or 'postgresql' with a url")

    @classmethod
    def parse(cls, name: "str | os.PathLike | StoreLocation") -> "StoreLocation":
        """What a user typed for ``--store`` (or a config value) as a
        location: a checked PostgreSQL URL, else an absolute file path
        (``~`` expanded). A location passes through as it is.
        :class:`StoreUrlError` (a ``ValueError``) naming the problem for a
        malformed URL or a scheme that is not PostgreSQL's."""
        if isinstance(name, StoreLocation):
            return name
        if isinstance(name, str) and is_url(name):
            return cls(POSTGRESQL, url=check_url(name))
        if isinstance(name, str) and "://" in name:
            scheme = name.split("://", 1)[0]
            raise StoreUrlError(
                f"unknown store URL scheme {scheme!r} in {redact(name)!r}: a store is a file path "
                "or postgresql://user@host:port/dbname"
            )
        return cls(SQLITE, path=Path(name).expanduser().resolve())

    @classmethod
    def sqlite(cls, path: "str | os.PathLike") -> "StoreLocation":
        """An SQLite file kvlens names itself (not user text: taken as it is)."""
        return cls(SQLITE, path=Path(path))

    @property
    def is_postgres(self) -> bool:
        return self.kind == POSTGRESQL

    @property
    def name(self) -> "str | Path":
        """What the backend connects to: the URL (str) or the file (Path)."""
        return self.url if self.url is not None else self.path  # type: ignore[return-value]

    @property
    def text(self) -> str:
        """The whole name as text, a URL's password included (never for messages)."""
        return str(self.name)

    @property
    def display(self) -> str:
        """The name for messages and logs: a URL's password as ``***``."""
        return redact(self.url) if self.url is not None else str(self.path)

    @property
    def password(self) -> str | None:
        """A URL's password (from ``user:password@`` or ``?password=``), or None."""
        return None if self.url is None else split_password(self.url)[1]

    def without_password(self) -> "StoreLocation":
        """This location with a URL's password taken out: what may go on a
        command line or into a file (``stack.json``). libpq finds the password
        in ``$PGPASSWORD`` (:meth:`password_env`) or ``~/.pgpass`` instead."""
        if self.url is None or self.password is None:
            return self
        return StoreLocation(POSTGRESQL, url=split_password(self.url)[0])

    def password_env(self) -> dict[str, str]:
        """The environment that gives a child process this URL's password
        (``{"PGPASSWORD": ...}``), empty when the URL holds none (the child
        then inherits ours: ``$PGPASSWORD`` or ``~/.pgpass`` as the user set them)."""
        pw = self.password
        return {} if pw is None else {PASSWORD_ENV: pw}

    def __str__(self) -> str:
        return self.display

    def __repr__(self) -> str:
        return f"StoreLocation({self.display!r})"


def is_url(name: Any) -> bool:
    """Whether ``name`` names a PostgreSQL store (``postgresql://`` / ``postgres://``)."""
    if not isinstance(name, str):
        return False
    head = name.strip().split("://", 1)[0].lower() if "://" in name else ""
    return head in URL_SCHEMES


def check_url(url: str) -> str:
    """``url`` when it is a usable PostgreSQL URL; :class:`StoreUrlError`
    (a ``ValueError``) naming the problem otherwise (a typo'd scheme, no
    host, no database, a bad port)."""
    text = url.strip()
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    if scheme not in URL_SCHEMES:
        raise StoreUrlError(f"not a PostgreSQL URL: {redact(text)!r} {_USE}")
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        raise StoreUrlError(f"bad port in {redact(text)!r} {_USE}") from None
    del port
    host = parts.hostname or ""
    if not host and "host=" not in parts.query:
        raise StoreUrlError(f"no host in {redact(text)!r} {_USE}")
    if not unquote(parts.path.lstrip("/")) and "dbname=" not in parts.query:
        raise StoreUrlError(f"no database name in {redact(text)!r} {_USE}")
    try:
        from psycopg.conninfo import conninfo_to_dict

        conninfo_to_dict(text)
    except ImportError:  # the driver is checked when a connection is opened
        pass
    except Exception as e:  # psycopg.ProgrammingError: libpq could not parse it
        raise StoreUrlError(f"bad PostgreSQL URL {redact(text)!r}: {e}") from None
    return text


def _query_without_password(query: str) -> tuple[str, str | None]:
    """(the query without ``password=``, the last password given there or None)."""
    if "password" not in query.lower():
        return query, None
    pairs = parse_qsl(query, keep_blank_values=True)
    pw = [v for k, v in pairs if k.lower() == "password"]
    rest = [(k, v) for k, v in pairs if k.lower() != "password"]
    return urlencode(rest, quote_via=quote), (pw[-1] if pw else None)


def split_password(url: str) -> tuple[str, str | None]:
    """(``url`` without its password, the password or None). libpq takes a
    password from the user part (``user:pw@host``) or the query
    (``?password=pw``); the query's wins there, so it wins here."""
    parts = urlsplit(url)
    query, in_query = _query_without_password(parts.query)
    in_netloc = parts.password
    if in_netloc is None and in_query is None:
        return url, None
    netloc = parts.netloc
    if in_netloc is not None:
        user, host = netloc.rsplit("@", 1)
        netloc = f"{user.split(':', 1)[0]}@{host}"
    pw = in_query if in_query is not None else unquote(in_netloc or "")
    return parts._replace(netloc=netloc, query=query).geturl(), pw


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and logs)."""
    parts = urlsplit(url)
    query, in_query = _query_without_password(parts.query)
    if parts.password is None and in_query is None:
        return url
    netloc = parts.netloc
    if parts.password is not None:
        user, host = netloc.rsplit("@", 1)
        netloc = f"{user.split(':', 1)[0]}:***@{host}"
    if in_query is not None:
        query = "&".join(x for x in (query, "password=***") if x)
    return parts._replace(netloc=netloc, query=query).geturl()


_URL_IN_TEXT = re.compile(r"postgres(?:ql)?://[^\s\"'<>,;]+", re.IGNORECASE)


def redact_text(text: str) -> str:
    """``text`` with the password of every PostgreSQL URL in it as ``***``
    (a command-line argument, a JSON value, a log line)."""
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda m: redact(m.group(0)), text)


def endpoint(url: str) -> tuple[str, int, str, str]:
    """(host, port, database, user) of a URL, with libpq's defaults filled in."""
    parts = urlsplit(url)
    from urllib.parse import parse_qs

    q = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    host = parts.hostname or q.get("host") or "localhost"
    port = parts.port or int(q.get("port") or 5432)
    db = unquote(parts.path.lstrip("/")) or q.get("dbname") or ""
    user = unquote(parts.username or "") or q.get("user") or os.environ.get("PGUSER") or ""
    return host, port, db, user
