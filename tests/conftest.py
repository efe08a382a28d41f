"""Fixtures every test folder may use: a session kvlens home and the tiny
generated model. The real P/D stacks live in ``tests/e2e/conftest.py``.

``tests/`` itself is on ``sys.path`` (pytest's ``pythonpath`` option), so
helpers such as ``store_fixture`` import by name.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def kvlens_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("kvlens_home")
    os.environ["KVLENS_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def tiny_model(kvlens_home) -> Path:
    from kvlens.model import ensure_model

    return ensure_model(kvlens_home / "model")
