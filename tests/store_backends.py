"""The two trace-store backends as one test parameter.

``backend`` (a fixture in ``tests/conftest.py``, parametrized
``sqlite`` / ``postgresql``) is a :class:`Backend`: where the store is
(``store``: a file path, or the URL of a database of its own on the session's
real PostgreSQL server), the connector config that makes the real pipeline
write there (``config``), and the few raw operations a test needs to reach
under the store API (set the schema version, list a table's columns).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Backend:
    name: str
    store: Any  # Path (sqlite) or URL (postgresql)
    home: Path

    @property
    def is_pg(self) -> bool:
        return self.name == "postgresql"

    def config(self, **more: Any) -> dict[str, Any]:
        """``kv_connector_extra_config`` writing this store (metrics off)."""
        cfg = {"kvlens_home": str(self.home), "kvlens_metrics": "off", **more}
        if self.is_pg:
            cfg["kvlens_store"] = self.store
        return cfg

    # raw access, under the store API --------------------------------------
    def raw(self, sql: str, params: tuple = ()) -> list[tuple]:
        """Run one statement outside the store API (autocommit); its rows."""
        if self.is_pg:
            import psycopg

            with psycopg.connect(self.store, autocommit=True) as c:
                cur = c.execute(sql.replace("?", "%s"), params)
                return cur.fetchall() if cur.description else []
        c = sqlite3.connect(self.store)
        try:
            rows = c.execute(sql, params).fetchall()
            c.commit()
            return rows
        finally:
            c.close()

    def set_version(self, version: int) -> None:
        self.raw("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(version),))

    def version_rows(self) -> list[tuple]:
        return self.raw("SELECT value FROM meta")

    def columns(self, table: str) -> list[str]:
        if self.is_pg:
            return [
                r[0]
                for r in self.raw(
                    "SELECT column_name FROM information_schema.columns "
                    "WHERE table_schema = current_schema() AND table_name = ?",
                    (table,),
                )
            ]
        return [r[1] for r in self.raw(f"PRAGMA table_info({table})")]
