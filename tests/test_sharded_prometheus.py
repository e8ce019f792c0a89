"""The sharded stages' metrics scraped by a real Prometheus (Debian's ``prometheus``
package) during a real multi-process run on the real broker: every query of the sharded
Grafana dashboard (deploy/grafana/dashboards/neardup-sharded.json) returns data, and the
counters add up to the input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from kafka_util import free_port, produce, read_all
from neardup.sharded.topology import Topology
from test_sharded_kafka import _stories_and_copies

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "neardup-sharded.json"
PROCESSES = [("prepare", "a"), ("prepare", "b"), ("shard", "a"), ("shard", "b"), ("decide", "a")]
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))



def _get(url: str) -> dict:
    with _HTTP.open(url, timeout=10) as resp:
        return json.loads(resp.read())


def _query(base: str, expr: str) -> list[dict]:
    out = _get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert out["status"] == "success", out
    return out["data"]["result"]


def _value(base: str, expr: str) -> float:
    result = _query(base, expr)
    return float(result[0]["value"][1]) if result else float("nan")


def _dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


@pytest.fixture
def prometheus(tmp_path: Path):
    """A real Prometheus scraping the stage processes' ports every second: (its URL, the
    ports it scrapes, by process)."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("this test needs Debian's prometheus package: apt-get install prometheus", pytrace=False)
    ports = {p: free_port() for p in PROCESSES}
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": "neardup-stages",
                                  "static_configs": [{"targets": [f"127.0.0.1:{port}" for port in ports.values()]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(tmp_path / "prometheus.log", "ab")
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with _HTTP.open(f"{base}/-/ready", timeout=2) as resp:
                if resp.status == 200:
                    break
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-2000:]
        time.sleep(0.2)
    try:
        yield base, ports
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_every_dashboard_query_returns_data_from_a_multi_process_run(kafka_bootstrap, kafka_topic_factory,
                                                                      tmp_path, prometheus):
    base, ports = prometheus
    topic = kafka_topic_factory("sharded-prom", partitions=2)
    messages = _stories_and_copies(150)
    produce(kafka_bootstrap, topic, messages)
    topology = Topology(f"prom-{uuid.uuid4().hex[:8]}", shards=4, decide_partitions=2)
    log = open(tmp_path / "stages.log", "ab")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "neardup.cli", "stage", role, "--bootstrap-servers", kafka_bootstrap,
         "--input-topic", topic, "--app", topology.app, "--shards", str(topology.shards),
         "--decide-partitions", str(topology.decide_partitions), "--instance", instance,
         "--reorder-window-ms", "3000", "--from-beginning", "--text-field", "text", "--id-field", "id",
         "--batch-size", "50", "--metrics-port", str(ports[(role, instance)]), "--metrics-host", "127.0.0.1",
         "-X", "session.timeout.ms=6000", "-X", "heartbeat.interval.ms=500"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for role, instance in PROCESSES]
    try:
        deadline = time.monotonic() + 240
        while len(read_all(kafka_bootstrap, [f"{topic}.unique", f"{topic}.duplicates", f"{topic}.dlq"],
                           idle_s=1.0, timeout_s=30)) < len(messages):
            assert all(p.poll() is None for p in procs), (tmp_path / "stages.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the stages did not give every output"
        # every process scraped, and decide's last batch with them
        deadline = time.monotonic() + 60
        outputs = "sum(neardup_stage_documents_total) + sum(neardup_stage_dead_letter_total)"
        while (_value(base, 'count(up{job="neardup-stages"} == 1)') < len(PROCESSES)
               or _value(base, outputs) < len(messages)):
            assert time.monotonic() < deadline, _query(base, "up")
            time.sleep(0.5)
        # a rate needs two scrapes of its series: one that first appeared at the last scrape
        # (the decide counters when every output came in one batch) has data a second later
        deadline = time.monotonic() + 30
        while True:
            empty = [(title, expr) for title, expr in _dashboard_queries()
                     if not _query(base, expr.replace("$__rate_interval", "1m").replace("$job", "neardup-stages")
                                   .replace("$instance", ".+"))]
            if not empty or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        assert not empty, f"dashboard queries without data: {empty}"
        assert len(_dashboard_queries()) >= 10
        # the counters add up: every input message consumed by prepare, one output each
        assert _value(base, 'sum(neardup_stage_records_consumed_total{stage="prepare"})') == len(messages)
        assert _value(base, outputs) == len(messages)
        assert _value(base, 'sum(neardup_stage_documents_total{verdict="duplicate"})') >= 100
        assert _value(base, "count(count by (instance) (neardup_stage_records_consumed_total))") == len(PROCESSES)
        assert _value(base, 'sum(neardup_stage_assigned_partitions{stage="shard"})') == topology.shards
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
