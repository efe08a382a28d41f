"""A benchmark's scratch directory (stores, homes, logs, a model): made
under the system's temp dir and removed when the benchmark's process exits,
however it ends short of a kill. Benchmarks write hundreds of MB a run; left
behind, a few dozen runs filled /tmp."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path


def scratch_dir(prefix: str) -> Path:
    """A new directory ``<tmp>/<prefix>XXXX``, removed at exit."""
    d = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, d, True)
    return d
