"""The example alerting rules (deploy/prometheus/neardup-alerts.yml) with promtool and a
real Prometheus (Debian's ``prometheus`` package):

- the rules and the Prometheus configuration that loads them pass ``promtool check``;
- ``promtool test rules`` runs their unit tests, in which every alert fires on its
  series and stays quiet on a healthy deployment next to it;
- every metric they read is in a real /metrics output (``neardup run``'s and the stages');
- a real Prometheus loading deploy/prometheus/prometheus.yml and scraping a real
  ``Metrics`` evaluates every rule without error, raises no alert for the healthy process,
  and answers every query of the dashboard with data;
- docker-compose.yml gives its Prometheus the rule files next to the configuration.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from kafka_util import free_port
from neardup.server import MetricsServer
from test_deploy import (
    DASHBOARD,
    _exposed,
    _promtool,
    _queries,
    _real_metrics_output,
    promql,
    real_metrics,
    real_stage_metrics_output,
)

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
CONFIG = PROMETHEUS_DIR / "prometheus.yml"
RULES = PROMETHEUS_DIR / "neardup-alerts.yml"
RULE_TESTS = PROMETHEUS_DIR / "neardup-alerts.test.yml"
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))



def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([_promtool(), *args], capture_output=True, text=True, cwd=PROMETHEUS_DIR)


def _alerts() -> dict[str, dict]:
    return {rule["alert"]: rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]}


def test_the_rules_and_the_configuration_pass_promtool_check():
    result = _run("check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in result.stdout
    config = yaml.safe_load(CONFIG.read_text())
    assert config["rule_files"] == [RULES.name]
    result = _run("check", "config", CONFIG.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout


def test_every_alert_fires_on_its_series_and_not_on_a_healthy_one():
    alerts = _alerts()
    assert {"NeardupTargetDown", "NeardupNoBatchCommitted", "NeardupConsumerLagGrowing",
            "NeardupDeadLettersRising", "NeardupRestoreRunning", "NeardupStalled", "NeardupStageStalled",
            "NeardupDecideDocumentsStuck"} <= set(alerts)
    cases = [case for test in yaml.safe_load(RULE_TESTS.read_text())["tests"] for case in test["alert_rule_test"]]
    for name, rule in alerts.items():
        mine = [case for case in cases if case["alertname"] == name]
        assert any(case["exp_alerts"] for case in mine), f"{name} never fires in {RULE_TESTS.name}"
        assert any(not case["exp_alerts"] for case in mine), f"{name} is never expected quiet"
        assert "job" in rule["expr"] and rule["labels"]["severity"] in ("warning", "critical"), name
        assert {"summary", "description"} <= set(rule["annotations"]), name
    result = _run("test", "rules", RULE_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_metric_the_alerts_read_is_exposed(tmp_path):
    exposed = _exposed(_real_metrics_output(tmp_path)) | _exposed(real_stage_metrics_output())
    read = {name for rule in _alerts().values() for name in re.findall(r"\bneardup_[a-z0-9_]+", rule["expr"])}
    assert len(read) >= 8
    assert not read - exposed, f"read by an alert but never exposed: {sorted(read - exposed)}"


def test_compose_gives_prometheus_the_rule_files():
    """Prometheus reads ``rule_files`` relative to its configuration file: the compose
    service must have each of them next to the prometheus.yml it mounts."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = {}
    for volume in compose["services"]["prometheus"]["volumes"]:
        if isinstance(volume, str) and volume.startswith("."):
            source, target = volume.split(":")[:2]
            mounts[(ROOT / source).resolve()] = Path(target)
    config_in_container = mounts[CONFIG.resolve()]
    for rule_file in yaml.safe_load(CONFIG.read_text())["rule_files"]:
        wanted = config_in_container.parent / rule_file
        local = (CONFIG.parent / rule_file).resolve()
        assert mounts.get(local) == wanted or any(
            source.is_dir() and local.is_relative_to(source) and target / local.relative_to(source) == wanted
            for source, target in mounts.items()
        ), f"docker-compose.yml does not mount {local.relative_to(ROOT)} at {wanted}"


def _api(base: str, path: str, **params: str) -> dict:
    with _HTTP.open(f"{base}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=10) as resp:
        out = json.loads(resp.read())
    assert out["status"] == "success", out
    return out["data"]


def test_a_real_prometheus_evaluates_the_rules_and_the_dashboard(tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("this test needs Debian's prometheus package: apt-get install prometheus", pytrace=False)
    metrics = real_metrics(tmp_path)
    metrics.set_lag({("wire", 0): 0, ("wire", 1): 0})  # caught up: nothing waits, nothing to alert on
    with MetricsServer(metrics, "127.0.0.1", 0) as server:
        config = yaml.safe_load(CONFIG.read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(PROMETHEUS_DIR / f) for f in config["rule_files"]]
        (job,) = config["scrape_configs"]
        job["static_configs"] = [{"targets": [f"127.0.0.1:{server.port}"]}]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        with open(tmp_path / "prometheus.log", "wb") as log:
            proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                                     f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
                                     "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60

            def scraped_and_evaluated() -> bool:
                try:
                    samples = _api(base, "query", query=f'count_over_time(up{{job="{job["job_name"]}"}}[1m])')["result"]
                    groups = _api(base, "rules")["groups"]
                except OSError:
                    return False
                rules = [r for g in groups for r in g["rules"]]
                return (bool(samples) and float(samples[0]["value"][1]) >= 4
                        and bool(rules) and all(r.get("lastEvaluation", "0001").startswith("20") for r in rules))

            while not scraped_and_evaluated():
                assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
                assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()
                time.sleep(0.5)
            rules = [r for g in _api(base, "rules")["groups"] for r in g["rules"]]
            assert len(rules) == len(_alerts())
            assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
            assert _api(base, "alerts")["alerts"] == []  # a healthy process raises nothing
            empty = [(title, expr) for title, expr in _queries(DASHBOARD)
                     if not _api(base, "query", query=promql(expr, job["job_name"]))["result"]]
            assert not empty, f"dashboard queries without data: {empty}"
            # and the job variable does select: another job's name finds nothing
            assert not _api(base, "query", query=promql(_queries(DASHBOARD)[0][1], "elsewhere"))["result"]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
