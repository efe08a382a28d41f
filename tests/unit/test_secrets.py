"""A PostgreSQL store's password reaches no command line and no file: the
argv builders of every child kvlens starts (collector, vLLM's
``--kv-transfer-config``, the dashboard's Streamlit), ``stack.json``, the
leftovers' records of command lines; the children get it as ``PGPASSWORD``
(libpq reads it), and a password typed on kvlens' own command line draws one
warning. The real thing (a running stack, /proc/<pid>/cmdline, a server that
refuses a missing password) is tests/e2e/test_e2e_fleet.py."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import pytest

from kvrecord.location import StoreLocation, redact, redact_text, split_password

PW = "s3cr:t/@pw"  # characters a URL must escape
URL = "postgresql://kvlens:s3cr%3At%2F%40pw@db.internal:5433/traces?sslmode=prefer"
BARE = "postgresql://kvlens@db.internal:5433/traces?sslmode=prefer"


def test_a_location_splits_its_password_off():
    loc = StoreLocation.parse(URL)
    assert loc.password == PW
    assert loc.without_password() == StoreLocation.parse(BARE) and loc.without_password().password is None
    assert loc.password_env() == {"PGPASSWORD": PW}
    assert StoreLocation.parse(BARE).password_env() == {} and StoreLocation.parse(BARE).without_password().text == BARE
    # libpq also takes ?password=...: the query's wins there, so here
    q = StoreLocation.parse("postgresql://u:a@h/db?password=b&sslmode=require")
    assert q.password == "b" and q.without_password().text == "postgresql://u@h/db?sslmode=require"
    assert "b&" not in q.display and q.display.endswith("password=***")
    sqlite = StoreLocation.sqlite("/tmp/traces.db")
    assert sqlite.password is None and sqlite.without_password() is sqlite and sqlite.password_env() == {}


def test_redaction_finds_urls_inside_text():
    assert redact(URL) == "postgresql://kvlens:***@db.internal:5433/traces?sslmode=prefer"
    ktc = json.dumps({"kv_connector_extra_config": {"kvlens_store": URL, "x": "postgres://a:b@h/d"}})
    out = redact_text(ktc)
    assert "s3cr" not in out and ":b@" not in out and json.loads(out)["kv_connector_extra_config"]["x"]
    assert redact_text(f"--store={URL}") == f"--store={redact(URL)}"
    assert redact_text("plain text, no url") == "plain text, no url"
    assert split_password(BARE) == (BARE, None)


def _stack(tmp_path, **kw):
    from kvlens.stack.launch import Stack

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return Stack(
        mode="push",
        model=model,
        kvlens_home=tmp_path / "home",
        log_dir=tmp_path / "run",
        port=18000,
        prefill_port=18001,
        decode_port=18002,
        prefill_side_port=18003,
        decode_side_port=18004,
        **kw,
    )


def _in(child) -> str:
    return " ".join(child.argv)


def test_stack_children_get_the_password_in_their_environment_only(tmp_path, monkeypatch):
    monkeypatch.delenv("PGPASSWORD", raising=False)
    s = _stack(
        tmp_path,
        separate_homes=True,
        collector="process",
        collector_port=18005,
        collector_store=URL,
        connector_options={"kvlens_store": URL.replace("traces?", "other?")},
    )
    col = s.roles.collector()
    assert PW not in _in(col) and "s3cr" not in _in(col)
    assert col.argv[col.argv.index("--store") + 1] == BARE
    assert col.env["PGPASSWORD"] == PW
    for role in ("prefill", "decode"):
        srv = s.roles.server(role)
        ktc = json.loads(srv.argv[srv.argv.index("--kv-transfer-config") + 1])
        assert ktc["kv_connector_extra_config"]["kvlens_store"] == BARE.replace("traces?", "other?")
        assert "s3cr" not in _in(srv) and srv.env["PGPASSWORD"] == PW
    r = s.roles.router("overlapped", 18000)
    assert "s3cr" not in _in(r) and "PGPASSWORD" not in r.env
    m = s.manifest()
    assert m["store"] == BARE and "s3cr" not in json.dumps(m)
    # the stack itself still reaches the store with the password (its own reads)
    assert s.store.password == PW


def test_a_password_given_as_pgpassword_passes_through(tmp_path, monkeypatch):
    """The URL without a password and PGPASSWORD set: the children inherit it."""
    monkeypatch.setenv("PGPASSWORD", "from-env")
    s = _stack(tmp_path, separate_homes=True, collector="process", collector_port=18005, collector_store=BARE)
    col = s.roles.collector()
    assert col.argv[col.argv.index("--store") + 1] == BARE and col.env["PGPASSWORD"] == "from-env"


def test_without_store_password_leaves_other_options_alone():
    from kvlens.stack.commands import without_store_password

    assert without_store_password(None) == (None, {})
    assert without_store_password({"kvlens_store": "off"}) == ({"kvlens_store": "off"}, {})
    opts, env = without_store_password({"kvlens_store": URL, "kvlens_metrics": "off"})
    assert opts == {"kvlens_store": BARE, "kvlens_metrics": "off"} and env == {"PGPASSWORD": PW}
    bad = {"kvlens_store": "postgresql://u:pw@h:99999/db"}  # the connector names the problem at start-up
    assert without_store_password(bad) == (bad, {})


def test_dashboard_child_gets_the_url_without_the_password(monkeypatch):
    from kvlens import dashboard_cmd

    args = argparse.Namespace(port=8501, host="127.0.0.1", prometheus=None, show_error_details=False)
    cmd = dashboard_cmd.command(args, URL)
    assert "s3cr" not in " ".join(cmd) and cmd[cmd.index("--store") + 1] == BARE
    assert dashboard_cmd.child_env(StoreLocation.parse(URL))["PGPASSWORD"] == PW


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_recorded_command_lines_are_redacted_and_still_recognised(tmp_path):
    """stack.json keeps each process's command line to recognise a survivor:
    kept redacted, compared redacted."""
    import subprocess

    from kvlens.stack.leftovers import _alive, cmdline

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--store", URL])
    try:
        deadline = time.monotonic() + 60  # until the child has exec'd (slow on a busy machine)
        while (got := cmdline(proc.pid)) is None or "--store" not in got:
            assert time.monotonic() < deadline, got
            time.sleep(0.02)
        assert got[-1] == redact(URL) and "s3cr" not in json.dumps(got)
        assert _alive({"pid": proc.pid, "cmdline": got})
    finally:
        proc.kill()
        proc.wait()


def test_one_warning_when_kvlens_own_command_line_holds_a_password(capsys):
    from kvlens.cli import warn_password_in_argv

    assert warn_password_in_argv("collect", ["--store", URL, "--port", "0"])
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "PGPASSWORD" in err and "s3cr" not in err
    assert not warn_password_in_argv("collect", ["--store", BARE])
    assert not warn_password_in_argv("traces", ["--store", "/tmp/traces.db"])
    assert capsys.readouterr().err == ""


def test_messages_never_show_the_password():
    from kvtrace.store import pgerrors

    class Refused(Exception):
        sqlstate = "28P01"

    msg = str(pgerrors.translate(Refused('password authentication failed for user "kvlens"'), URL))
    assert "s3cr" not in msg and "***" in msg
    assert os.environ.get("PGPASSWORD") != PW  # nothing above leaked into this process's environment


def test_a_store_that_needs_a_password_takes_it_from_pgpassword(pg_server, monkeypatch):
    """A real server that asks this role for its password (tests/pg_server.py):
    refused without it (the message names the user, never a password), and
    reached with it in PGPASSWORD (libpq reads it: the URL stays bare) or in
    the URL."""
    from kvtrace import store
    from kvtrace.store import pg

    bare, password = pg_server.new_password_database()
    monkeypatch.delenv("PGPASSWORD", raising=False)
    monkeypatch.setenv("PGPASSFILE", "/nonexistent")  # no ~/.pgpass of this host's user either
    try:
        with pytest.raises(store.StoreAccessDenied, match="refused user 'kvlens_pw'") as e:
            store.connect(bare).close()
        assert password not in str(e.value)
        pg.close_pool(bare)
        monkeypatch.setenv("PGPASSWORD", password)
        store.connect(bare).close()  # creates the tables: the role owns the database
        with store.reading(bare) as c:
            assert store.info(c)["traces"] == 0
        pg.close_pool(bare)
        monkeypatch.setenv("PGPASSWORD", "wrong")
        with_pw = StoreLocation.parse(bare.replace("kvlens_pw@", f"kvlens_pw:{password}@"))
        with store.reading(with_pw) as c:  # the URL's password wins over the environment's
            assert store.info(c)["traces"] == 0
    finally:
        pg.close_pools()
