"""The deployment files agree with the code: docker-compose.yml, deploy/Dockerfile,
deploy/prometheus, deploy/grafana and deploy/k8s.

- docker-compose.yml validates against the Compose Specification JSON schema (the copy
  vendored by the check-jsonschema package, Apache-2.0), and every file it refers to
  exists;
- every ``neardup`` command line in them parses with the real CLI parser, and the
  settings it gives (with the ConfigMap's TOML for the StatefulSet) validate;
- every metric the Grafana dashboards query is in a real /metrics output, every query
  selects one deployment (``job``, ``instance``) and parses (promtool);
- the dashboards import into any Grafana (``__inputs``, a ``$datasource`` variable) and
  still resolve the datasource provisioned for docker-compose.yml;
- ports, paths and names match across the files (state dir and volumes, metrics port,
  Prometheus target, Grafana datasource uid).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import time
import tomllib
import urllib.request
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from dockerfile_parse import DockerfileParser
from prometheus_client.parser import text_string_to_metric_families

from neardup.cli import _settings, build_parser
from neardup.config import DEFAULT_METRICS_PORT
from neardup.core.settings import EngineSettings
from neardup.core.types import Document
from neardup.detector import Detector
from neardup.run import BatchStats
from neardup.metrics import Metrics
from neardup.server import MetricsServer
from neardup.state.rocksdb import RocksDBStateStore

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
K8S = ROOT / "deploy" / "k8s"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "neardup.json"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA_PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
STATE_DIR = "/var/lib/neardup"


@pytest.fixture(autouse=True)
def _no_neardup_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings come from the files under test only, not from this shell."""
    import os

    for name in list(os.environ):
        if name.startswith("NEARDUP_"):
            monkeypatch.delenv(name)


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _neardup_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Services that run the neardup image (built from deploy/Dockerfile)."""
    out = {}
    for name, service in compose["services"].items():
        build = service.get("build")
        if isinstance(build, dict) and build.get("dockerfile") == "deploy/Dockerfile":
            out[name] = service
    return out


def _command(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def _option(argv: list[str], dest: str) -> Any:
    """The value the CLI's own parser gives ``dest`` for the command line ``argv``."""
    return getattr(build_parser().parse_args(argv), dest)


def _dockerfile() -> DockerfileParser:
    return DockerfileParser(path=str(DOCKERFILE), env_replace=False)


def _instructions(parser: DockerfileParser, name: str) -> list[str]:
    return [s["value"] for s in parser.structure if s["instruction"] == name]


def _k8s_documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def _k8s(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in _k8s_documents() if d.get("kind") == kind]
    return doc


# --- docker-compose.yml -----------------------------------------------------------------
def test_compose_validates_against_the_compose_specification():
    schema = json.loads(
        (resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text()
    )
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    errors = sorted(validator_class(schema).iter_errors(_compose()), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_compose_refers_to_files_that_exist():
    compose = _compose()
    checked = 0
    for name, service in compose["services"].items():
        build = service.get("build")
        if build is not None:
            context = ROOT / (build if isinstance(build, str) else build.get("context", "."))
            assert context.is_dir(), f"{name}: build context {context}"
            dockerfile = context / (build.get("dockerfile", "Dockerfile") if isinstance(build, dict) else "Dockerfile")
            assert dockerfile.is_file(), f"{name}: {dockerfile}"
            checked += 1
        for volume in service.get("volumes", []):
            if isinstance(volume, str):
                source = volume.split(":", 1)[0]
                is_bind = source.startswith((".", "/", "~"))
            else:
                source, is_bind = volume.get("source", ""), volume.get("type") == "bind"
            if is_bind:
                assert (ROOT / source).exists(), f"{name}: mounted {source} does not exist"
                checked += 1
            else:
                assert source in (compose.get("volumes") or {}), f"{name}: undeclared volume {source}"
        for env_file in [service["env_file"]] if isinstance(service.get("env_file"), str) else service.get("env_file", []):
            path = env_file if isinstance(env_file, str) else env_file["path"]
            assert (ROOT / path).is_file(), f"{name}: env_file {path}"
    for section in ("configs", "secrets"):
        for name, item in (compose.get(section) or {}).items():
            if "file" in item:
                assert (ROOT / item["file"]).exists(), f"{section}.{name}: {item['file']}"
    assert checked >= 6  # two builds, the data file, prometheus.yml, two grafana folders


def test_compose_neardup_commands_parse_and_validate():
    services = _neardup_services(_compose())
    assert {"neardup", "producer"} <= set(services)
    for name, service in services.items():
        assert "entrypoint" not in service, f"{name}: the image's ENTRYPOINT is neardup"
        argv = _command(service)
        args = build_parser().parse_args(argv)
        if args.command in ("run", "dedup"):
            settings = _settings(args)
            settings.engine()

    run = _command(services["neardup"])
    assert run[0] == "run"
    state_dir = _option(run, "state_dir")
    assert str(state_dir) == STATE_DIR
    mounts = [v.split(":")[1] if isinstance(v, str) else v["target"] for v in services["neardup"]["volumes"]]
    assert STATE_DIR in mounts
    port = _option(run, "metrics_port")
    assert port == DEFAULT_METRICS_PORT
    assert any(str(p).endswith(f":{port}") for p in services["neardup"]["ports"])

    produce = _command(services["producer"])
    assert produce[0] == "produce"
    inputs = build_parser().parse_args(produce).inputs
    targets = [v.split(":")[1] for v in services["producer"]["volumes"]]
    assert set(inputs) <= set(targets), "the producer reads a file that is mounted"
    run_topics = _option(run, "input_topics")
    assert _option(produce, "topic") in run_topics


def test_prometheus_scrapes_the_neardup_service():
    config = yaml.safe_load(PROMETHEUS.read_text())
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    run = _command(_neardup_services(_compose())["neardup"])
    assert f"neardup:{_option(run, 'metrics_port')}" in targets


DASHBOARDS = (DASHBOARD, ROOT / "deploy" / "grafana" / "dashboards" / "neardup-sharded.json")
DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}


def _provisioned_prometheus() -> list[dict[str, Any]]:
    datasources = [
        d
        for path in sorted((GRAFANA_PROVISIONING / "datasources").glob("*.yml"))
        for d in yaml.safe_load(path.read_text())["datasources"]
    ]
    return [d for d in datasources if d["type"] == "prometheus"]


def _queries(path: Path) -> list[tuple[str, str]]:
    """(panel title, expr) of every query of a dashboard."""
    dashboard = json.loads(path.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


def test_grafana_is_provisioned_with_the_datasource_the_dashboard_uses():
    compose = _compose()
    mounts = {
        v.split(":")[0].removeprefix("./"): v.split(":")[1]
        for v in compose["services"]["grafana"]["volumes"]
        if isinstance(v, str) and v.startswith(".")
    }
    prometheus = _provisioned_prometheus()
    # The dashboards' $datasource variable falls back to the first Prometheus datasource
    # when its saved value (the import placeholder) names none: the provisioned one.
    assert len(prometheus) == 1 and prometheus[0]["url"] == "http://prometheus:9090"
    providers = [
        p
        for path in sorted((GRAFANA_PROVISIONING / "dashboards").glob("*.yml"))
        for p in yaml.safe_load(path.read_text())["providers"]
    ]
    assert mounts["deploy/grafana/dashboards"] in [p["options"]["path"] for p in providers]
    assert mounts["deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    home = compose["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (ROOT / "deploy" / "grafana" / "dashboards" / Path(home).name).exists()

    dashboard = json.loads(DASHBOARD.read_text())
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for wanted in ("verdict", "duplicate ratio", "latency", "lag", "dead-letter", "store size",
                   "retention: documents held", "expired", "oldest held age", "restore", "targets up", "memory"):
        assert wanted in titles


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_a_dashboard_imports_into_any_grafana(path):
    """The export format Grafana shares dashboards in: one datasource input, whose
    placeholder is the default of a ``$datasource`` variable that every panel, query and
    template variable uses; ``job`` and ``instance`` variables from the scraped series."""
    dashboard = json.loads(path.read_text())
    (source,) = dashboard["__inputs"]
    assert source["type"] == "datasource" and source["pluginId"] == "prometheus"
    placeholder = "${" + source["name"] + "}"
    assert {"type": "datasource", "id": "prometheus"} in [{"type": r["type"], "id": r["id"]} for r in dashboard["__requires"]]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert list(variables) == ["datasource", "job", "instance"]
    datasource = variables["datasource"]
    assert datasource["type"] == "datasource" and datasource["query"] == "prometheus" and not datasource["regex"]
    assert datasource["current"]["value"] == placeholder
    assert json.dumps(dashboard).count(placeholder) == 1  # nothing else is bound to one datasource
    for name in ("job", "instance"):
        assert variables[name]["type"] == "query" and variables[name]["datasource"] == DATASOURCE_REF
        assert re.fullmatch(rf"label_values\(neardup_build_info\{{[^}}]*\}}, {name}\)", variables[name]["query"])
    assert '$job' in variables["instance"]["query"]
    for panel in dashboard["panels"]:
        assert panel["datasource"] == DATASOURCE_REF, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE_REF, panel["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(set(ids)) == len(ids)


#: A series selector (metric name and its matchers) and an aggregation's ``by`` clause.
_SELECTOR = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")
_AGGREGATION = re.compile(r"\b(sum|max|min|avg|count)\s*(by\s*\(([^)]*)\))?\s*\(")


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_dashboard_query_selects_one_deployment(path):
    """Every series a query reads is chosen by ``$job`` and ``$instance``, and every
    aggregation keeps ``job``: two deployments are never added together."""
    for title, expr in _queries(path):
        selectors = _SELECTOR.findall(expr)
        assert selectors, (title, expr)
        for name, matchers in selectors:
            assert 'job=~"$job"' in matchers and 'instance=~"$instance"' in matchers, (title, name)
        bare = set(re.findall(r"\b(?:neardup|process|python)_[a-z0-9_]+\b(?!\{)", expr))
        assert not bare, (title, bare)
        for aggregation in _AGGREGATION.finditer(expr):
            assert aggregation.group(3) is not None, (title, expr)
            assert "job" in [label.strip() for label in aggregation.group(3).split(",")], (title, expr)


def _promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("this test needs promtool (Debian's prometheus package: apt-get install prometheus)", pytrace=False)
    return binary


def promql(expr: str, job: str = "neardup") -> str:
    """A dashboard query as Grafana sends it: its variables replaced."""
    return (expr.replace("$__rate_interval", "1m").replace("$job", job).replace("$instance", ".+"))


def test_every_dashboard_query_parses(tmp_path):
    """promtool parses each query (variables replaced) as the expression of a recording rule."""
    rules = [{"record": f"dashboard:query_{i}", "expr": promql(expr)}
             for i, (_, expr) in enumerate(q for path in DASHBOARDS for q in _queries(path))]
    assert len(rules) >= 40
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = subprocess.run([_promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout
    broken = tmp_path / "broken.yml"  # the check does parse
    broken.write_text(yaml.safe_dump({"groups": [{"name": "b", "rules": [{"record": "b:q", "expr": "sum by (job (up)"}]}]}))
    assert subprocess.run([_promtool(), "check", "rules", str(broken)], capture_output=True).returncode != 0


def real_metrics(tmp_path: Path) -> Metrics:
    """A Metrics fed with real batches (real detector, RocksDB)."""
    import gzip

    with gzip.open(ROOT / "tests" / "data" / "reuters_excerpt.jsonl.gz", "rt") as f:
        records = [json.loads(line) for _, line in zip(range(400), f)]
    engine = EngineSettings()
    metrics = Metrics()
    metrics.set_build_info(engine)
    with RocksDBStateStore(tmp_path / "state", engine.state_shape()) as store:
        detector = Detector(engine, store)
        for start in range(0, len(records), 100):
            docs = [Document(str(r["id"]), r["text"]) for r in records[start:start + 100]]
            result = detector.detect(docs)
            store.commit(result.update)
            verdicts = result.verdicts
            stats = BatchStats(
                messages=len(docs),
                unique=sum(not v.is_duplicate for v in verdicts),
                duplicate=sum(v.is_duplicate for v in verdicts),
                dead_letter={"invalid_json": 1},
                columns=result.columns,
                timestamps_ms=[int(time.time() * 1000) - 40] * len(docs),
                seconds=0.05,
            )
            metrics.observe_batch(stats)
        metrics.set_lag({("wire", 0): 3, ("wire", 1): 0})
        metrics.transaction_aborted()
        metrics.refresh_state(store, force=True)
    return metrics


def _real_metrics_output(tmp_path: Path) -> str:
    """/metrics of ``real_metrics``, over HTTP."""
    metrics = real_metrics(tmp_path)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with MetricsServer(metrics, "127.0.0.1", 0) as server:
        with opener.open(f"{server.url}/metrics", timeout=5) as resp:
            return resp.read().decode()


def _exposed(text: str) -> set[str]:
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def _queried_metrics(path: Path) -> set[str]:
    return {name for _, expr in _queries(path) for name, _ in _SELECTOR.findall(expr)}


def test_every_dashboard_metric_is_exposed(tmp_path):
    exposed = _exposed(_real_metrics_output(tmp_path)) | {"up"}  # up: Prometheus's own
    queried = _queried_metrics(DASHBOARD)
    assert len(queried) >= 20
    assert {"up", "process_resident_memory_bytes", "neardup_documents_expired_total",
            "neardup_restore_records_total"} <= queried
    assert not queried - exposed, f"queried but not exposed: {sorted(queried - exposed)}"


# --- deploy/Dockerfile --------------------------------------------------------------------
def test_dockerfile():
    parser = _dockerfile()
    assert parser.baseimage == "python:3.11-slim"
    users = _instructions(parser, "USER")
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert json.loads(_instructions(parser, "ENTRYPOINT")[-1]) == ["neardup"]
    cmd = json.loads(_instructions(parser, "CMD")[-1])
    build_parser().parse_args(cmd)
    assert STATE_DIR in json.loads(_instructions(parser, "VOLUME")[-1])
    assert str(DEFAULT_METRICS_PORT) in _instructions(parser, "EXPOSE")[-1].split()
    runs = _instructions(parser, "RUN")
    # the first stage builds the wheel from the source (kernels compiled ahead of time), the
    # image installs it
    assert any(re.search(r"\bpip wheel .*--wheel-dir /tmp/wheels \.(\s|$)", run) for run in runs)
    assert any(re.search(r"\bpip install /tmp/wheels/neardup-\*\.whl", run) for run in runs)
    assert f"NEARDUP_STATE_DIR={STATE_DIR}" in " ".join(_instructions(parser, "ENV"))
    for copy in _instructions(parser, "COPY"):
        if copy.startswith("--from="):  # from the first stage, not the build context
            continue
        *sources, _ = copy.split()
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}"
    ignored = [
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for needed in ("pyproject.toml", "setup.py", "README.md", "src"):
        assert needed not in ignored


# --- deploy/k8s ------------------------------------------------------------------------------
def test_k8s_manifests_parse():
    kinds = sorted(d["kind"] for d in _k8s_documents())
    assert kinds == ["ConfigMap", "Kustomization", "PodDisruptionBudget", "Service", "StatefulSet"]
    kustomization = _k8s("Kustomization")
    assert {(K8S / r).is_file() for r in kustomization["resources"]} == {True}


def test_k8s_statefulset_keeps_state_on_a_claim_and_probes_health(tmp_path):
    sts = _k8s("StatefulSet")
    spec = sts["spec"]
    pod = spec["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["image"].startswith("neardup:")]
    assert "command" not in container
    argv = container["args"]
    assert argv[0] == "run"

    # The state directory is a volumeClaimTemplate's mount.
    state_dir = str(_option(argv, "state_dir"))
    claims = {t["metadata"]["name"] for t in spec["volumeClaimTemplates"]}
    mounted = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounted.get(state_dir) in claims

    # --config names the ConfigMap's key where the ConfigMap is mounted; its TOML validates.
    config_path = Path(str(_option(argv, "config")))
    config_volume = mounted[str(config_path.parent)]
    (volume,) = [v for v in pod["volumes"] if v["name"] == config_volume]
    configmap = _k8s("ConfigMap")
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    toml_text = configmap["data"][config_path.name]
    config = tomllib.loads(toml_text)
    local = tmp_path / config_path.name
    local.write_text(toml_text)
    args = build_parser().parse_args([a if a != str(config_path) else str(local) for a in argv])
    settings = _settings(args)
    settings.engine()
    assert settings.bootstrap_servers and settings.input_topics
    assert str(settings.state_dir) == state_dir

    # Probes and the metrics port.
    port = config.get("metrics_port", DEFAULT_METRICS_PORT)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == port
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert pod["securityContext"]["runAsNonRoot"] is True

    # The transactional id: the group and the pod name (expanded by Kubernetes; checked
    # expanded in tests/test_k8s.py), and the static group membership: the pod name.
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["NEARDUP_TRANSACTIONAL_ID"]["value"] == "neardup-$(NEARDUP_GROUP_ID)-$(POD_NAME)"
    assert settings.kafka["group.instance.id"] == "$(POD_NAME)"

    # The service selects the pods and tells Prometheus where to scrape.
    service = _k8s("Service")
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    labels = spec["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    annotations = service["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port
    assert annotations["prometheus.io/path"] == "/metrics"
    assert service["spec"]["ports"][0]["port"] == port


# --- deploy/k8s/sharded and the sharded dashboard -----------------------------------------------
SHARDED = K8S / "sharded"
SHARDED_DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "neardup-sharded.json"


def _sharded_documents() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((SHARDED / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in SHARDED.glob("*.yaml")
                                                         if p.name != "kustomization.yaml")
    return [d for r in kustomization["resources"] for d in yaml.safe_load_all((SHARDED / r).read_text()) if d]


def test_k8s_sharded_has_a_workload_per_stage_whose_args_parse(tmp_path):
    docs = _sharded_documents()
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    workloads = {d["spec"]["template"]["spec"]["containers"][0]["args"][1]: d
                 for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    assert sorted(workloads) == ["decide", "prepare", "shard"]
    assert {w["kind"] for w in workloads.values()} == {"StatefulSet"}  # stable pod names: the instances
    config_text = configmap["data"]["neardup.toml"]
    config = tomllib.loads(config_text)
    local = tmp_path / "neardup.toml"
    local.write_text(config_text)
    for role, w in workloads.items():
        pod = w["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        argv = container["args"]
        assert argv[:2] == ["stage", role]
        mounted = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        config_path = Path(str(_option(argv, "config")))
        (volume,) = [v for v in pod["volumes"] if v["name"] == mounted[str(config_path.parent)]]
        assert volume["configMap"]["name"] == configmap["metadata"]["name"]
        args = build_parser().parse_args([a if a != str(config_path) else str(local) for a in argv])
        settings = _settings(args)
        settings.engine()
        assert settings.bootstrap_servers and settings.input_topics and settings.app
        assert w["spec"]["replicas"] <= {"prepare": 10**6, "shard": settings.shards,
                                         "decide": settings.decide_partitions}[role]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == config["metrics_port"] == settings.metrics_port
        annotations = w["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == settings.metrics_port
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        assert pod["terminationGracePeriodSeconds"] >= 30
        # a stable pod name: the instance, hence the transactional id
        assert settings.instance == "$(POD_NAME)"
        service = services[w["spec"]["serviceName"]]
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        assert service["spec"]["clusterIP"] == "None"
        claims = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        if role in ("shard", "decide"):  # its stores on the pod's own volume, kept across restarts
            assert settings.state_dir is not None and mounted.get(str(settings.state_dir)) in claims
        else:  # the stateless stage refuses --state-dir
            assert settings.state_dir is None and not claims


def real_stage_metrics_output() -> str:
    """/metrics of every stage's StageMetrics, fed with the stages' own batch results, over HTTP."""
    from neardup.sharded.decide_stage import DecideWritten
    from neardup.sharded.prepare_stage import PrepareWritten
    from neardup.sharded.shard_stage import ShardWritten
    from neardup.metrics import StageMetrics
    from confluent_kafka import TopicPartition

    written = {
        "prepare": PrepareWritten([], messages=100, band_records=3200, band_bytes=96_000, document_bytes=40_000, seconds=0.05),
        "shard": ShardWritten([], messages=1600, released=1500, late=3, lateness_ms=[120, 40, 5], held=100,
                              finding_bytes=9_000, changelog_bytes=30_000, seconds=0.04),
        "decide": DecideWritten([], messages=400, unique=80, duplicate=15, dead_letter=5, waiting=7, seconds=0.02),
    }
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    texts = []
    for stage, result in written.items():
        metrics = StageMetrics(stage)
        metrics.set_build_info(EngineSettings())
        metrics.set_assignment([TopicPartition("in", 0), TopicPartition("in", 1)])
        metrics.set_lag({("in", 0): 4, ("in", 1): 0})
        metrics.observe(result)
        metrics.transaction_aborted()
        with MetricsServer(metrics, "127.0.0.1", 0) as server:
            with opener.open(f"{server.url}/metrics", timeout=5) as resp:
                texts.append(resp.read().decode())
    return "".join(texts)


def test_every_sharded_dashboard_metric_is_exposed():
    exposed = _exposed(real_stage_metrics_output()) | {"up"}
    queried = _queried_metrics(SHARDED_DASHBOARD)
    assert len(queried) >= 12
    assert not queried - exposed, f"queried but never exposed: {sorted(queried - exposed)}"
    dashboard = json.loads(SHARDED_DASHBOARD.read_text())
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for wanted in ("throughput", "lag", "late", "waiting", "verdict", "targets up", "memory"):
        assert wanted in titles


def _workloads() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")) + sorted((K8S / "sharded").glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") in ("StatefulSet", "Deployment"))
    return docs


def test_k8s_containers_start_under_a_read_only_root_without_being_killed():
    """Every neardup container with a read-only root file system has numba's cache on a
    writable mount (the image's prebuilt kernels are copied there; tests/
    test_container_start.py runs the process so), and a startup probe long enough for
    the kernels to compile when the image's do not fit the node's CPU."""
    image_env = DockerfileParser(path=str(DOCKERFILE), env_replace=True).envs
    workloads = _workloads()
    assert len(workloads) == 4  # run, and the three stages
    for workload in workloads:
        pod = workload["spec"]["template"]["spec"]
        for container in pod["containers"]:
            name = f"{workload['metadata']['name']}/{container['name']}"
            env = {**image_env, **{e["name"]: e.get("value") for e in container.get("env", [])}}
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, name
            writable = [m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")]
            cache = env["NUMBA_CACHE_DIR"]
            assert any(cache == w or cache.startswith(w.rstrip("/") + "/") for w in writable), (name, cache, writable)
            startup = container["startupProbe"]
            assert startup["httpGet"]["path"] == container["livenessProbe"]["httpGet"]["path"] == "/healthz", name
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, name
