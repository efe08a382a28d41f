"""kvlens.exits: the same error gets the same exit code in every command.

The read commands (``traces``, ``verdict``, ``whatif``) run through
``kvlens.cli.main`` against the same unusable stores and must agree on the
code (2: bad input, as argparse's) and say the problem in one line naming
it; a server that cannot be reached now is 1 in all of them
(tests/unit/test_store_pg.py, with ``collect`` and ``dashboard``). A model
directory that is none is 2 in ``up`` and ``bench`` alike, a busy port 1
(as in ``collect``).
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

import store_sql
from kvlens import exits
from kvlens.cli import main
from kvlens.stack.errors import StackError, StackInputError
from kvtrace import store

#: Each read command with what else it needs (``whatif`` the mode to predict from).
READ_COMMANDS = {"traces": [], "verdict": [], "whatif": ["--from", "push"]}


def test_the_codes():
    assert (exits.OK, exits.FAILED, exits.USAGE, exits.INTERRUPTED) == (0, 1, 2, 130)
    assert StackError("x").exit_code == exits.FAILED and StackInputError("x").exit_code == exits.USAGE


@pytest.mark.parametrize("cmd", READ_COMMANDS)
def test_a_missing_store_is_the_same_usage_error_in_every_read_command(tmp_path, capsys, cmd):
    missing = tmp_path / "absent.db"
    assert main([cmd, *READ_COMMANDS[cmd], "--store", str(missing)]) == exits.USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"kvlens {cmd}: "), err
    assert "trace store not found" in err[0] and str(missing) in err[0] and "pass --store" in err[0], err
    assert not missing.exists()  # a reader never creates one


def _unusable(kind: str, tmp_path) -> tuple[str, str]:
    """(a store name no reader can use, words its one line must hold)."""
    if kind == "directory":
        return str(tmp_path), "is a directory"
    if kind == "garbage":
        bad = tmp_path / "junk.db"
        bad.write_bytes(b"garbage" * 1000)
        return str(bad), str(bad)
    if kind == "newer":
        newer = tmp_path / "newer.db"
        store.connect(newer).close()
        store_sql.set_schema_version(newer, store.SCHEMA_VERSION + 1)
        return str(newer), "schema version"
    return "postgresql://u@h/", "no database"  # a malformed URL: no database named


@pytest.mark.parametrize("kind", ["directory", "garbage", "newer", "malformed URL"])
def test_an_unusable_store_is_the_same_usage_error_in_every_read_command(tmp_path, capsys, kind):
    name, words = _unusable(kind, tmp_path)
    for cmd in READ_COMMANDS:
        assert main([cmd, *READ_COMMANDS[cmd], "--store", name]) == exits.USAGE, cmd
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"kvlens {cmd}: ") and words in err[0], (cmd, err)


def test_the_process_exits_with_the_code(tmp_path):
    """``kvlens`` as users run it: the process's status is main()'s code."""
    for cmd, more in READ_COMMANDS.items():
        r = subprocess.run(
            [sys.executable, "-m", "kvlens.cli", cmd, *more, "--store", str(tmp_path / "absent.db")],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == exits.USAGE and "trace store not found" in r.stderr, (cmd, r.stderr)


def test_up_and_bench_agree_on_a_model_that_is_none(kvlens_home, tmp_path, capsys):
    missing = tmp_path / "no-model"
    logs = tmp_path / "logs"
    assert main(["up", "--mode", "push", "--model", str(missing), "--port", "0", "--log-dir", str(logs)]) == 2
    assert str(missing) in capsys.readouterr().err
    argv = ["bench", "--modes", "push", "--model", str(missing), "--store", str(tmp_path / "bench.db")]
    assert main(argv) == exits.USAGE
    assert str(missing) in capsys.readouterr().err


def test_a_busy_port_is_a_failed_start_not_bad_input(tiny_model, tmp_path, capsys):
    """As ``collect``'s busy port (tests/unit/test_collector.py): another
    process holds it now; the same command line may work later."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = str(s.getsockname()[1])
        argv = ["up", "--mode", "push", "--model", str(tiny_model), "--port", port, "--log-dir", str(tmp_path / "u")]
        assert main(argv) == exits.FAILED
        assert f"{port} is already in use" in capsys.readouterr().err
