"""The two trace-store backends as one test parameter.

``backend`` (a fixture in ``tests/conftest.py``, parametrized
``sqlite`` / ``postgresql``) is a :class:`Backend`: where the store is
(``store``: a file path, or the URL of a database of its own on the session's
real PostgreSQL server) and the connector config that makes the real pipeline
write there (``config``). What a test needs beneath the store API (the
schema version, a table's columns) is in ``tests/store_sql.py``, given
``backend.store``.
"""

from __future__ import annotations

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
