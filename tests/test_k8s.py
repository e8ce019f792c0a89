"""The Kubernetes manifests as a cluster would get them: deploy/k8s and deploy/k8s/sharded
rendered as ``kubectl apply -k`` renders them (their kustomizations only list
resources, and the optional monitoring components only add theirs), every object
validated against the Kubernetes OpenAPI schemas (strict: no unknown field), and the
operators' expectations checked on the rendered objects: the recommended
``app.kubernetes.io/*`` labels, a PodDisruptionBudget per workload, a startup probe and
the compiled-kernel cache under a writable /tmp in every container, a ServiceMonitor
that selects the metrics port, and transactional ids unique per consumer group and
stable per pod once Kubernetes has expanded the ``$(VAR)`` references.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from neardup.cli import _settings, build_parser

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
BASES = {"single": K8S, "sharded": K8S / "sharded"}
#: The oldest Kubernetes minor version whose schemas kubernetes-validate ships, and its newest.
VERSIONS = ["1.25", kubernetes_validate.latest_version()]
#: Kinds of CustomResourceDefinitions (no schema in kubernetes-validate): only in components.
CRD_KINDS = {"ServiceMonitor"}
RECOMMENDED_LABELS = {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                      "app.kubernetes.io/part-of", "app.kubernetes.io/managed-by"}


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects of a kustomization (or component) directory: its ``resources``, files
    or directories, in order, then its ``components``'.

    Raises:
        ValueError: the kustomization uses anything else (patches, generators, ...),
            which this renderer does not do.
    """
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - {"apiVersion", "kind", "resources", "components"}
    if unknown:
        raise ValueError(f"{directory}: kustomization fields not rendered here: {sorted(unknown)}")
    objects: list[dict[str, Any]] = []
    for entry in [*kustomization.get("resources", []), *kustomization.get("components", [])]:
        path = directory / entry
        if path.is_dir():
            objects += render(path)
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return objects


def with_monitoring(name: str) -> list[dict[str, Any]]:
    """The base ``name`` with its optional monitoring component, as an overlay gives it."""
    return render(BASES[name]) + render(BASES[name] / "monitoring")


def _workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def _expand(value: str, env: dict[str, str]) -> str:
    """``$(NAME)`` references expanded as the kubelet does (``$$`` a literal ``$``;
    a name not defined is left as it is)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


def _pod_env(container: dict[str, Any], pod_name: str, **values: str) -> dict[str, str]:
    """The container's environment in pod ``pod_name``: fieldRef metadata.name gives the
    pod name; ``values`` replace the manifest's values of those variables (an overlay's)."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "valueFrom" in e:
            assert e["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, e
            env[e["name"]] = pod_name
        else:
            env[e["name"]] = _expand(values.get(e["name"], e["value"]), env)
    return env


def _settings_in_pod(container: dict[str, Any], configmap: dict[str, Any], env: dict[str, str],
                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The settings the container's command gets in a pod with ``env``."""
    toml = tmp_path / "neardup.toml"
    toml.write_text(configmap["data"]["neardup.toml"])
    argv = [_expand(a, env) for a in container["args"]]
    argv = [str(toml) if a.endswith("neardup.toml") else a for a in argv]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return build_parser().parse_args(argv), _settings(build_parser().parse_args(argv))


@pytest.fixture(autouse=True)
def _no_neardup_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("NEARDUP_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize("name", sorted(BASES))
@pytest.mark.parametrize("version", VERSIONS)
def test_k8s_rendered_objects_validate_against_the_kubernetes_schemas(name, version):
    base = render(BASES[name])
    assert not {o["kind"] for o in base} & CRD_KINDS, "a CRD kind in the base: apply -k fails without the CRD"
    for obj in base:
        kubernetes_validate.validate(obj, version, strict=True)
    extra = render(BASES[name] / "monitoring")
    assert {o["kind"] for o in extra} == {"ServiceMonitor"}
    names = [(o["kind"], o["metadata"]["name"]) for o in base + extra]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("name", sorted(BASES))
def test_k8s_every_object_has_the_recommended_labels(name):
    objects = with_monitoring(name)
    for obj in objects:
        labels = obj["metadata"]["labels"]
        assert RECOMMENDED_LABELS <= set(labels), (obj["kind"], obj["metadata"]["name"])
        assert labels["app.kubernetes.io/part-of"] == "neardup"
    for w in _workloads(objects):
        pod_labels = w["spec"]["template"]["metadata"]["labels"]
        assert RECOMMENDED_LABELS - {"app.kubernetes.io/managed-by"} <= set(pod_labels)
        assert w["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        assert pod_labels["app.kubernetes.io/version"] == w["spec"]["template"]["spec"]["containers"][0]["image"] \
            .rsplit(":", 1)[1]


@pytest.mark.parametrize("name", sorted(BASES))
def test_k8s_every_workload_has_one_disruption_budget(name):
    objects = render(BASES[name])
    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    workloads = _workloads(objects)
    assert workloads
    for w in workloads:
        pod_labels = w["spec"]["template"]["metadata"]["labels"]
        covering = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()]
        assert len(covering) == 1, w["metadata"]["name"]
        # a drain never waits for a person, and never takes more than one pod at a time
        assert covering[0]["spec"] == {"maxUnavailable": 1, "selector": covering[0]["spec"]["selector"]}
    assert len(budgets) == len(workloads)


@pytest.mark.parametrize("name", sorted(BASES))
def test_k8s_every_container_has_a_startup_probe_and_its_kernel_cache_under_a_writable_tmp(name):
    for w in _workloads(render(BASES[name])):
        pod = w["spec"]["template"]["spec"]
        tmp_volumes = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for c in pod["containers"]:
            startup = c["startupProbe"]
            assert startup["httpGet"] == {"path": "/healthz", "port": "metrics"}
            # at least 5 minutes for kernels compiled at start
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
            for probe in ("livenessProbe", "readinessProbe"):
                assert "initialDelaySeconds" not in c[probe]  # the startup probe holds them back
            env = _pod_env(c, "pod-0")
            cache = Path(env["NUMBA_CACHE_DIR"])
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            mounts = {Path(m["mountPath"]): m for m in c["volumeMounts"]}
            writable = [p for p, m in mounts.items() if m["name"] in tmp_volumes and not m.get("readOnly")]
            assert any(cache.is_relative_to(p) for p in writable), (w["metadata"]["name"], cache)


@pytest.mark.parametrize("name", sorted(BASES))
def test_k8s_the_servicemonitor_scrapes_the_metrics_port_of_every_workload(name):
    objects = with_monitoring(name)
    (monitor,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selected = [s for s in objects if s["kind"] == "Service"
                and monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    for service in selected:
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    # every workload's pods are behind a selected service
    for w in _workloads(objects):
        pod_labels = w["spec"]["template"]["metadata"]["labels"]
        assert any(s["spec"]["selector"].items() <= pod_labels.items() for s in selected), w["metadata"]["name"]


def test_k8s_single_process_transactional_id_is_unique_per_group_and_stable_per_pod(tmp_path, monkeypatch):
    objects = render(K8S)
    (sts,) = _workloads(objects)
    (configmap,) = [o for o in objects if o["kind"] == "ConfigMap"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert "group_id" not in configmap["data"]["neardup.toml"]  # one place: the pod's environment

    def ids(pod: str, group: str) -> tuple[str, str, str]:
        env = _pod_env(container, pod, NEARDUP_GROUP_ID=group)
        with monkeypatch.context() as m:
            _, settings = _settings_in_pod(container, configmap, env, tmp_path, m)
        return settings.group_id, settings.transactional_id, settings.kafka["group.instance.id"]

    wire, crawl = ids("neardup-0", "wire-dedup"), ids("neardup-0", "crawl-dedup")
    assert wire[0] == "wire-dedup" and crawl[0] == "crawl-dedup"
    # two deployments whose pods have the same name do not fence each other's producers
    assert wire[1] != crawl[1]
    # stable per pod: the same after a restart; another pod of the same group has another
    assert ids("neardup-0", "wire-dedup") == wire
    assert ids("neardup-1", "wire-dedup")[1] != wire[1]
    # under the prefix the ACLs grant (deploy/README.md): neardup-<group>
    assert wire[1].startswith("neardup-wire-dedup") and "$(" not in wire[1]
    assert wire[2] == "neardup-0"  # static membership, scoped to the group


def test_k8s_sharded_stages_have_stable_instances_and_static_membership(tmp_path, monkeypatch):
    from neardup.sharded.prepare_stage import PrepareStage
    from neardup.sharded.topology import Topology

    objects = render(K8S / "sharded")
    (configmap,) = [o for o in objects if o["kind"] == "ConfigMap"]
    workloads = {w["spec"]["template"]["spec"]["containers"][0]["args"][1]: w for w in _workloads(objects)}
    assert sorted(workloads) == ["decide", "prepare", "shard"]
    for role, w in workloads.items():
        # a stable pod name for every stage: its instance, hence its transactional id
        assert w["kind"] == "StatefulSet", role
        (container,) = w["spec"]["template"]["spec"]["containers"]
        pod = f"{w['metadata']['name']}-2"
        env = _pod_env(container, pod)
        with monkeypatch.context() as m:
            args, settings = _settings_in_pod(container, configmap, env, tmp_path, m)
        assert settings.instance == pod
        assert settings.kafka["group.instance.id"] == pod
        if role == "prepare":
            app = settings.app or settings.group_id
            stage = PrepareStage(settings.model_copy(update={"group_id": f"{app}.{role}"}),
                                 Topology(app, settings.shards, settings.decide_partitions), settings.instance)
            assert stage.transactional_id == f"neardup-{app}.prepare-{pod}"
