"""The connector's options (:class:`kvrecord.config.Options`) and a store's
name (:class:`kvrecord.location.StoreLocation`): each built and checked once,
where the user's text enters, and passed on from there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exporters import pipeline
from kvrecord import config
from kvrecord.config import KNOWN_KEYS, Options
from kvrecord.location import StoreLocation, StoreUrlError
from kvrecord.recorder import DEFAULT_CAPACITY

URL = "postgresql://kvlens:s3cret@db.internal:5433/traces"


# ------------------------------------------------------------ StoreLocation
def test_a_path_is_an_absolute_sqlite_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    loc = StoreLocation.parse("sub/traces.db")
    assert (loc.kind, loc.path, loc.url) == ("sqlite", tmp_path.resolve() / "sub" / "traces.db", None)
    assert not loc.is_postgres and loc.name == loc.path and str(loc) == str(loc.path) == loc.text
    assert StoreLocation.parse(tmp_path / "t.db").path == tmp_path.resolve() / "t.db"


def test_a_path_expands_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert StoreLocation.parse("~/kv/traces.db").path == tmp_path.resolve() / "kv" / "traces.db"


@pytest.mark.parametrize("url", [URL, "postgres://u@h/db", " postgresql://u@h/db?sslmode=require "])
def test_a_postgresql_url_is_kept_whole(url):
    loc = StoreLocation.parse(url)
    assert (loc.kind, loc.path, loc.url) == ("postgresql", None, url.strip())
    assert loc.is_postgres and loc.name == loc.text == url.strip()


def test_the_password_is_hidden_wherever_the_location_is_shown():
    loc = StoreLocation.parse(URL)
    shown = "postgresql://kvlens:***@db.internal:5433/traces"
    assert str(loc) == loc.display == f"{loc}" == shown
    assert "s3cret" not in repr(loc) and "s3cret" not in repr(Options.from_config({"kvlens_store": URL}))
    assert loc.text == URL  # for a child's command line, never for a message


@pytest.mark.parametrize(
    "bad, why",
    [
        ("postgresql://u:pw@h:99999/db", "bad port"),
        ("postgresql://u@h:5432/", "no database name"),
        ("postgresql:///db", "no host"),
    ],
)
def test_a_malformed_url_names_the_problem_without_the_password(bad, why):
    with pytest.raises(StoreUrlError, match=why) as e:
        StoreLocation.parse(bad)
    assert isinstance(e.value, ValueError) and ":pw@" not in str(e.value)


@pytest.mark.parametrize("bad", ["mysql://u@h/db", "postgresq://u@h/db", "sqlite:///tmp/x.db"])
def test_an_unknown_scheme_is_refused(bad):
    with pytest.raises(StoreUrlError, match=f"unknown store URL scheme {bad.split(':')[0]!r}"):
        StoreLocation.parse(bad)


def test_a_location_passes_through_and_compares_by_value(tmp_path):
    loc = StoreLocation.parse(URL)
    assert StoreLocation.parse(loc) is loc
    assert StoreLocation.parse(URL) == loc and hash(StoreLocation.parse(URL)) == hash(loc)
    assert StoreLocation.sqlite(tmp_path / "t.db") == StoreLocation.parse(tmp_path / "t.db")
    with pytest.raises(ValueError):
        StoreLocation("sqlite", url=URL)


# ------------------------------------------------------------------ Options
def test_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv(config.HOME_ENV, str(tmp_path))
    o = Options.from_config({})
    assert o == Options.from_config(None)
    assert o.home == tmp_path.resolve() and o.store == StoreLocation.sqlite(tmp_path.resolve() / "traces.db")
    assert (o.metrics, o.retention_s, o.buffer_events, o.span_builder, o.service_name, o.otlp_endpoint) == (
        True,
        None,
        None,
        None,
        None,
        None,
    )


def test_every_known_key_becomes_a_typed_field(tmp_path):
    o = Options.from_config(
        {
            "kvlens_home": str(tmp_path),
            "kvlens_store": URL,
            "otlp_endpoint": "http://collector:4318",
            "kvlens_buffer_events": " 64 ",
            "kvlens_metrics": "OFF",
            "kvlens_service_name": "p-east",
            "kvlens_retention": "7d",
            "kvlens_span_builder": "Inline",
            "kv_lease_duration": 7,  # vLLM's own: ignored
        }
    )
    assert o.home == tmp_path.resolve() and o.store == StoreLocation.parse(URL)
    assert (o.metrics, o.retention_s, o.buffer_events, o.span_builder) == (False, 7 * 86400.0, 64, "inline")
    assert (o.service_name, o.otlp_endpoint) == ("p-east", "http://collector:4318")
    assert Options.from_config({"kvlens_store": "off"}).store is None
    assert Options.from_config({"kvlens_store": True, "kvlens_metrics": False}).metrics is False


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"kvlens_store": "off", "kvlens_metrics": "off", "kvlens_retention": 90},
        {"kvlens_store": URL, "kvlens_buffer_events": 8, "kvlens_span_builder": "sidecar"},
        {"kvlens_service_name": "x", "otlp_endpoint": "https://c/v1/traces", "kvlens_retention": "12h"},
    ],
)
def test_the_dict_sent_to_the_sidecar_rebuilds_the_same_options(tmp_path, cfg):
    o = Options.from_config({"kvlens_home": str(tmp_path), **cfg})
    sent = json.loads(json.dumps(o.to_config()))
    assert set(sent) <= KNOWN_KEYS and Options.from_config(sent) == o


@pytest.mark.parametrize(
    "key, bad, words",
    [
        ("kvlens_buffer_events", 0, "must be a positive integer"),
        ("kvlens_buffer_events", True, "must be a positive integer"),
        ("kvlens_metrics", "maybe", "must be 'on' or 'off'"),
        ("kvlens_store", "elsewhere", "must be 'on', 'off' or a postgresql://"),
        ("kvlens_store", "postgresql://u@h/", "kvlens_store: no database name"),
        ("kvlens_retention", "forever", "kvlens_retention: "),
        ("kvlens_retention", -1, "must be > 0 seconds"),
        ("kvlens_span_builder", "thread", "must be 'sidecar' or 'inline'"),
        ("kvlens_home", 5, "must be a string"),
        ("kvlens_service_name", ["a"], "must be a string"),
        ("otlp_endpoint", "collector:4318", "must be an http(s) URL"),
    ],
)
def test_each_bad_value_names_its_key(key, bad, words):
    with pytest.raises(ValueError) as e:
        Options.from_config({key: bad})
    assert key in str(e.value) and words in str(e.value)


@pytest.mark.parametrize("typo, meant", [("otlp_endpiont", "otlp_endpoint"), ("kvlens_retension", "kvlens_retention")])
def test_a_near_miss_key_is_refused_with_the_key_it_was_meant_to_be(typo, meant):
    with pytest.raises(ValueError, match=f"unknown kvlens option {typo!r}.*did you mean {meant!r}"):
        Options.from_config({typo: "x", "kv_lease_duration": 7})


def test_the_engine_process_checks_its_options_once(tmp_path, monkeypatch):
    """The connector builds the options; the recorder and the pipeline it
    makes (and the dict the sidecar gets) take them without checking again."""
    checks = []
    real = config._checked
    monkeypatch.setattr(config, "_checked", lambda cfg: checks.append(cfg) or real(cfg))
    opts = Options.from_config({"kvlens_home": str(tmp_path), "kvlens_metrics": "off", "kvlens_buffer_events": 9})
    r = pipeline.get_recorder("prefill", "push", "once-p0", opts, span_builder="sidecar")
    try:
        assert type(r).__name__ == "ShippingRecorder" and r.capacity == 9
        assert len(checks) == 1
        spec = json.loads(r._spec)
        assert "kvlens_span_builder" not in spec["config"] and Path(spec["config"]["kvlens_home"]) == opts.home
    finally:
        pipeline._recorders.pop(next(k for k, v in pipeline._recorders.items() if v is r), None)
    r = pipeline.get_recorder("router", "push", "once-router", {"kvlens_store": "off", "kvlens_metrics": "off"})
    try:  # a dict (tests, benchmarks) is checked once, on entry
        assert r.capacity == DEFAULT_CAPACITY and len(checks) == 2
    finally:
        pipeline._recorders.pop(next(k for k, v in pipeline._recorders.items() if v is r), None)


def test_options_naming_another_file_cannot_travel_as_a_config(tmp_path):
    o = Options(home=tmp_path, store=StoreLocation.sqlite(tmp_path / "other.db"))
    with pytest.raises(ValueError, match="kvlens_store names only"):
        o.to_config()


def test_the_keep_rule_is_a_connector_option_and_crosses_to_the_sidecar(tmp_path):
    from kvrecord.keeprule import KeepRule

    opts = Options.from_config(
        {
            "kvlens_home": str(tmp_path),
            "kvlens_keep": "sampled",
            "kvlens_keep_ratio": "0.1",
            "kvlens_keep_slow": "750ms",
        }
    )
    assert opts.keep == KeepRule.parse("sampled", 0.1, "750ms")
    assert Options.from_config(opts.to_config()).keep == opts.keep
    assert not Options.from_config({"kvlens_home": str(tmp_path)}).keep.sampled
    for key, bad in (("kvlens_keep", "most"), ("kvlens_keep_ratio", 2), ("kvlens_keep_slow", "p0")):
        with pytest.raises(ValueError, match=key):
            Options.from_config({"kvlens_home": str(tmp_path), "kvlens_keep": "sampled", key: bad})
