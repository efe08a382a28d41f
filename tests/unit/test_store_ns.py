"""The store's own namespace (``kvlens up --hosts --store-command``,
docs/links.md): its conditions and messages, the URL's host ``store`` put at
the namespace's address, and, as root with PostgreSQL installed (here and in
CI), the stack's own code running a real PostgreSQL in a ``store``
namespace: reached from the host's end with its password, then nothing left
(namespaces, veths, PostgreSQL's processes) after the stack's stop and
after SIGKILL of its supervisor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvlens.stack.errors import StackError
from kvlens.stack.netstack import place_store, store_argv
from kvrecord.location import StoreLocation

REPO = Path(__file__).resolve().parents[2]
URL = "postgresql://kvlens:s3cret@store:5433/traces"


def _stack(tmp_path, **kw):
    from kvlens.stack.launch import Stack

    base = {"hosts": True, "separate_homes": True, "collector_store": URL, "store_command": "postgres -D /x"}
    return Stack("push", kvlens_home=tmp_path, **{**base, **kw})


def test_store_command_conditions_named(tmp_path):
    with pytest.raises(StackError, match="--store-command needs --hosts"):
        _stack(tmp_path, hosts=False)
    with pytest.raises(StackError, match="needs --separate-homes, --collector process and --collector-store"):
        _stack(tmp_path, separate_homes=False, collector_store=None)
    with pytest.raises(StackError, match="needs --separate-homes"):
        _stack(tmp_path, collector="router", collector_store=None)
    with pytest.raises(StackError, match="needs --separate-homes"):
        _stack(tmp_path, collector_store=None)
    with pytest.raises(StackError, match="must be postgresql://USER@store") as e:
        _stack(tmp_path, collector_store="postgresql://kvlens:s3cret@db.example:5432/traces")
    assert "s3cret" not in str(e.value)  # the URL named, its password hidden
    with pytest.raises(StackError, match="must be postgresql://USER@store"):
        _stack(tmp_path, collector_store=str(tmp_path / "traces.db"))
    with pytest.raises(StackError, match="--store-command is empty"):
        _stack(tmp_path, store_command="  ")
    from kvlens.stack.linkspec import parse_links
    from kvlens.stack.netns import expand

    links = parse_links(["collector-store=5ms"])  # the collector's writes over a shaped link
    assert set(expand(links, ["router", "collector", "store", "p0", "d0"])) == {
        ("collector", "store"),
        ("store", "collector"),
    }
    with pytest.raises(StackError, match="store, which this stack does not run"):  # without --store-command
        expand(links, ["router", "collector", "p0", "d0"])


def test_store_argv_split_as_a_shell_would():
    assert store_argv("postgres -D '/var/lib/my pg' -c listen_addresses='*'") == [
        "postgres",
        "-D",
        "/var/lib/my pg",
        "-c",
        "listen_addresses=*",
    ]
    assert store_argv(("postgres", "-p", 5432)) == ["postgres", "-p", "5432"]


def test_place_store_keeps_user_password_port_and_query():
    got = place_store(StoreLocation.parse(URL + "?sslmode=disable"), "198.18.7.3")
    assert got.text == "postgresql://kvlens:s3cret@198.18.7.3:5433/traces?sslmode=disable"
    assert got.password == "s3cret" and "s3cret" not in str(got)
    assert place_store(StoreLocation.parse("postgres://u@store/db"), "198.18.9.3").text == "postgres://u@198.18.9.3/db"


def test_stack_store_at_the_namespace_once_its_network_exists(tmp_path):
    from kvlens.stack.netns import Net

    s = _stack(tmp_path)
    assert s.store.text == URL  # before start: as given (the subnet is picked at start)
    s.net = Net("abcdef", ["router", "collector", "store", "p0", "d0"], 7)
    assert s.store.text == "postgresql://kvlens:s3cret@198.18.7.3:5433/traces"
    assert s.role_host("store") == "198.18.7.3" and s.role_host("collector") == "198.18.7.2"
    assert s.manifest()["store"] == "postgresql://kvlens@198.18.7.3:5433/traces"  # no password in stack.json


def test_cli_store_command_without_hosts_exits_2(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "kvlens.cli", "up", "--mode", "push", "--separate-homes", "--collector-store", URL,
         "--store-command", "postgres -D /x"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "KVLENS_HOME": str(tmp_path), "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert r.returncode == 2 and "--store-command needs --hosts" in r.stderr, r.stderr
    assert "s3cret" not in r.stderr + r.stdout
    h = subprocess.run(
        [sys.executable, "-m", "kvlens.cli", "up", "--help"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert "--store-command" in h.stdout


def _need_root() -> None:
    from kvlens.stack import netns

    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    try:
        netns.check_tools(need_queue=False)
    except StackError as e:
        pytest.skip(str(e))


def test_a_store_command_that_exits_is_a_start_error_with_its_log(tmp_path):
    """Real namespaces, no database: the command's exit stops the start, named with its log's tail, and the
    network goes with the stack."""
    from kvlens.stack import netclean

    _need_root()
    s = _stack(tmp_path, store_command="sh -c 'echo no database here; exit 3'", log_dir=tmp_path / "logs")
    s.network.check_tools()
    try:
        with pytest.raises(StackError, match=r"(?s)--store-command: store exited with code 3.*no database here"):
            s.network.start(time.monotonic() + 60)
        assert s.net.ns("store") in netclean.objects(s.net.sid)["namespaces"]
    finally:
        s.stop()
    assert netclean.objects(s.net.sid) == {"namespaces": [], "veths": [], "pids": []}
    with pytest.raises(StackError, match="command not found: no-such-db-server"):
        _stack(tmp_path, store_command="no-such-db-server -D /x").network.check_tools()


# ------------------------------------------------------------------ real PostgreSQL in a namespace (root)
_SUPERVISOR = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from kvlens.stack.launch import Stack
    work, url, argv = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    s = Stack("push", hosts=True, separate_homes=True, collector_store=url, store_command=argv,
              kvlens_home=work / "home", log_dir=work / "logs", quiet=True)
    s.network.check_tools()
    s.network.start(time.monotonic() + 120)  # the stack's own start, up to the collector
    print(json.dumps({"sid": s.net.sid, "addr": s.net.addr("store"), "url": s.store.text,
                      "pid": s.manifest()["pids"]["store"]}), flush=True)
    if sys.stdin.readline().strip() == "stop":
        s.stop()
        print("stopped", flush=True)
    time.sleep(600)
    """
)


def _pg_processes(data_dir: str, pids: set[int]) -> list[int]:
    """Live processes among ``pids``, or with ``data_dir`` on their command line (the postmaster)."""
    import psutil

    return [p.pid for p in psutil.process_iter(["cmdline", "status"]) if p.info["status"] != psutil.STATUS_ZOMBIE
            and (p.pid in pids or data_dir in (p.info["cmdline"] or []))]  # fmt: skip


@pytest.mark.parametrize("how", ["stop", "sigkill"])
def test_real_postgres_in_its_namespace_then_nothing_left(tmp_path, how):
    import psutil
    import psycopg

    from kvlens.stack import netclean

    _need_root()
    from pg_server import PW_USER, PgServer, missing_reason

    if why := missing_reason():
        pytest.skip(why)
    pg = PgServer(net="198.18.0.0/15")
    sup = None
    try:
        pg.init().start()
        url, password = pg.new_password_database("ns")
        pg.stop()
        db = url.rsplit("/", 1)[1]
        given = f"postgresql://{PW_USER}:{password}@store:5432/{db}"
        argv = pg.postmaster_argv(port=5432, listen="*")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        sup = subprocess.Popen(
            [sys.executable, "-c", _SUPERVISOR, str(tmp_path), given, json.dumps(argv)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        line = sup.stdout.readline()
        assert line, f"the supervisor failed; logs: {list((tmp_path / 'logs').glob('*'))}"
        got = json.loads(line)
        sid, placed, net_addr = got["sid"], StoreLocation.parse(got["url"]), got["addr"]
        assert placed.text == given.replace("@store:", f"@{net_addr}:")
        # reached from the host's end, over the bridge, as the password's user; not over loopback
        with psycopg.connect(placed.text, connect_timeout=5) as conn:
            row = conn.execute("select current_user::text, host(inet_server_addr())").fetchone()
            assert row == (PW_USER, net_addr), row
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(placed.text.replace(password, "wrong"), connect_timeout=5).close()
        with pytest.raises(psycopg.OperationalError):  # nothing listens on the host's own loopback
            psycopg.connect(f"postgresql://{PW_USER}:{password}@127.0.0.1:5432/{db}", connect_timeout=5).close()
        pids = {got["pid"], *(c.pid for c in psutil.Process(got["pid"]).children(recursive=True))}
        assert len(pids) >= 3 and _pg_processes(str(pg.data), set()), pids  # guard, postmaster, its processes
        if how == "stop":
            sup.stdin.write("stop\n")
            sup.stdin.flush()
            assert sup.stdout.readline().strip() == "stopped"
        else:
            sup.kill()
            sup.wait()
        deadline = time.monotonic() + 40  # SIGKILL: the guards stop PostgreSQL, the keeper the network
        while time.monotonic() < deadline:
            if not any(netclean.objects(sid).values()) and not _pg_processes(str(pg.data), pids):
                break
            time.sleep(0.3)
        assert netclean.objects(sid) == {"namespaces": [], "veths": [], "pids": []}
        assert not _pg_processes(str(pg.data), pids)
    finally:
        if sup is not None and sup.poll() is None:
            sup.kill()
            sup.wait()
        pg.remove()
