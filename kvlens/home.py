"""Where kvlens keeps its files: ``$KVLENS_HOME`` (default ``./.kvlens``)."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """The kvlens home directory (not created)."""
    return Path(os.environ.get("KVLENS_HOME") or ".kvlens").resolve()


def store_path() -> Path:
    """Default trace store: ``$KVLENS_HOME/traces.db``."""
    return home() / "traces.db"


def model_dir() -> Path:
    """Default generated tiny model."""
    return home() / "model"
