"""The shipped Prometheus rules (``exporters/assets``): both files pass
``promtool check rules``; the alert rules pass their ``promtool test rules``
suite (each alert shown to fire and not to fire); every alert carries what an
on-call engineer needs (instance, mode, role, phase, a runbook section that
exists).

promtool comes with Debian's ``prometheus`` package, which ``make setup``
installs: where it is missing these tests fail (they do not skip), so a CI
machine without it cannot pass ``make test`` silently."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from exporters.prometheus_server import RULE_FILES, alert_rules_path, rules_path

ASSETS = rules_path().parent
TESTS_FILE = ASSETS / "alert_rules_test.yml"
RUNBOOK = Path(__file__).resolve().parents[2] / "docs" / "handoff-health.md"


def promtool() -> str:
    found = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None)
    if found is None:
        pytest.fail(
            "promtool not found: install Debian package prometheus (apt-get install prometheus; make setup does it)"
        )
    return found


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120, cwd=ASSETS)


def alerts() -> list[dict]:
    doc = yaml.safe_load(alert_rules_path().read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


@pytest.mark.parametrize("name", RULE_FILES)
def test_promtool_check_rules(name):
    out = run("check", "rules", name)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_test_rules():
    out = run("test", "rules", TESTS_FILE.name)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout, out.stdout


def test_the_suite_catches_a_broken_rule(tmp_path):
    # the same tests against a rule with its bound moved must fail: they pin behaviour, not just syntax
    for f in ("alert_rules.yml", TESTS_FILE.name):
        shutil.copyfile(ASSETS / f, tmp_path / f)
    rules = tmp_path / "alert_rules.yml"
    text = rules.read_text()
    broken = text.replace(
        "kvlens_handoff_oldest_open_start_timestamp_seconds > 10",
        "kvlens_handoff_oldest_open_start_timestamp_seconds > 100",
    )
    assert broken != text
    rules.write_text(broken)
    out = subprocess.run(
        [promtool(), "test", "rules", TESTS_FILE.name], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode != 0
    assert "KvlensHandoffStuck" in out.stdout + out.stderr


def test_every_alert_is_shown_to_fire_and_not_to_fire():
    suite = yaml.safe_load(TESTS_FILE.read_text())
    fired: set[str] = set()
    quiet: set[str] = set()
    for t in suite["tests"]:
        for case in t.get("alert_rule_test", ()):
            (fired if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {a["alert"] for a in alerts()}
    assert names == {
        "KvlensHandoffStuck",
        "KvlensStaleKV",
        "KvlensHandoffsFailing",
        "KvlensPinnedKVGrowing",
        "KvlensRegistrationTimeouts",
    }
    assert names - fired == set(), "alerts never shown to fire"
    assert names - quiet == set(), "alerts never shown to stay quiet"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def test_every_alert_says_where_what_and_links_its_runbook():
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", RUNBOOK.read_text(), flags=re.M)}
    for a in alerts():
        name, labels, notes = a["alert"], a.get("labels", {}), a.get("annotations", {})
        assert labels.get("severity") in ("page", "warning"), name
        for key in ("summary", "description", "runbook_url"):
            assert notes.get(key), f"{name}: no {key}"
        text = notes["summary"] + notes["description"]
        for label in ("instance", "mode"):
            assert "$labels." + label in text, f"{name} does not say its {label}"
        # role and phase: from the series, or set by the rule, or said in words
        for label in ("role", "phase"):
            assert label in labels or "$labels." + label in text or label + ":" in text or label + " " in text, (
                f"{name} does not say its {label}"
            )
        path, _, anchor = notes["runbook_url"].partition("#")
        assert path == "docs/handoff-health.md", name
        assert anchor in anchors, f"{name}: runbook section #{anchor} missing from docs/handoff-health.md"


def test_every_metric_an_alert_reads_is_one_kvlens_exports_with_those_labels():
    from prometheus_client import CollectorRegistry

    from exporters.handoffhealth import HealthFamilies

    reg = CollectorRegistry()
    fams = HealthFamilies(reg)
    exported = set()
    for fam in reg.collect():
        exported.add(fam.name + ("_total" if fam.type == "counter" else ""))
    for a in alerts():
        used = set(re.findall(r"\bkvlens_[a-z_]+", a["expr"]))
        assert used, a["alert"]
        for name in used:
            assert name in exported, f"{a['alert']} reads {name}, which kvlens does not export"
    # the labels the rules group, match and describe by (a wrong label name raises ValueError)
    fams.oldest.labels(mode="push", role="decode", phase="awaiting_kv")
    fams.outcomes.labels(mode="pull", role="prefill", outcome="expired")
    fams.attempts.labels(mode="pull", role="prefill")
    fams.pinned_blocks.labels(mode="push", state="unregistered_prefill")
    fams.pinned_oldest.labels(mode="push", state="unregistered_prefill")
    fams.stale.labels(mode="pull")
    fams.reg_timeouts.labels(mode="push")
    # the outcomes the failure alert matches are ones the connector counts (exported at 0 from the start)
    outcomes = {
        x.labels["outcome"] for f in reg.collect() for x in f.samples if x.name == "kvlens_handoff_outcomes_total"
    }
    assert {"failed", "timeout", "expired"} <= outcomes
