"""The token files kvlens writes for Prometheus (issue 42, item 11): never
written through a link planted where the file goes (``O_NOFOLLOW``), mode
0600 whatever was there before, gone when Prometheus stops. The real
:class:`exporters.prometheus_server.PrometheusServer` writing its config
(no Prometheus started: writing is the part under test)."""

from __future__ import annotations

import os
import secrets

from exporters.prometheus_server import PrometheusServer

TOKEN = "tok-" + secrets.token_hex(16)


def test_a_link_planted_where_the_token_goes_is_replaced_not_followed(tmp_path):
    prom = PrometheusServer(
        {"kvlens-router": ["127.0.0.1:8000"]}, data_dir=tmp_path / "prom", credentials={"kvlens-router": TOKEN}
    )
    path = prom.credentials_path("kvlens-router")
    path.parent.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("the victim's own content\n")
    os.symlink(victim, path)  # another user of a shared directory, before kvlens writes
    prom.write_config()
    assert victim.read_text() == "the victim's own content\n"  # nothing went through the link
    assert not path.is_symlink() and path.read_text() == TOKEN
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []
    # a file left with another mode is replaced by a 0600 one
    path.chmod(0o644)
    prom.write_config()
    assert path.stat().st_mode & 0o777 == 0o600 and path.read_text() == TOKEN
    prom.stop()
    assert not path.exists() and victim.exists()
