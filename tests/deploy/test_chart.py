"""The Helm chart (deploy/helm/tableserver), offline: rendered with Helm's own SDK for several value sets,
linted, every object validated against the Kubernetes OpenAPI schemas of two versions (strict), bad
values refused by values.schema.json, and the rendered daemon configuration, flags, ports and probes
run against the real daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest
import yaml
from conftest import EVENT_TIMEOUT, ROOT, wait_for

helm = pytest.importorskip("helm_python", reason="the dev extra installs helm-python-sdk")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

CHART = os.path.join(ROOT, "deploy", "helm", "tableserver")
AUTH = {"auth": {"existingSecret": "tableserver-token"}}
VALUE_SETS = {
    "defaults": (AUTH, ("1.29.0", "1.35.0")),
    "rdma-2Mi-multus-tls-monitoring": (
        {
            **AUTH,
            "rdma": {"enabled": True, "gidIndex": "3", "resourceName": "rdma/rdma_shared_device_a"},
            "hugepages": {"size": "2Mi", "amount": "210Gi"},
            "multusNetworks": "roce-sriov",
            "tls": {"existingSecret": "tableserver-tls", "clientCASecret": "tableserver-client-ca"},
            "metrics": {
                "serviceMonitor": {"enabled": True},
                "prometheusRule": {"enabled": True},
                "grafanaDashboard": {"enabled": True},
            },
            "replicas": 3,
        },
        ("1.29.0", "1.35.0"),
    ),
    "daemonset-hostnetwork-pvc": (
        {
            "kind": "daemonset",
            "hostNetwork": True,
            "transports": ["shm", "tcp"],
            "auth": {"allowAnonymous": True},
            "tables": {"file": "engram.bin", "source": "pvc", "pvc": {"claimName": "engram-tables"}},
            "hugepages": {"size": "off"},
        },
        ("1.29.0", "1.35.0"),
    ),
    "image-volume": (
        {
            **AUTH,
            "tables": {"file": "engram.bin", "source": "image", "image": {"reference": "registry.example/engram:v4.1"}},
        },
        ("1.31.0", "1.35.0"),
    ),
}


def render(values: dict) -> dict[str, list[dict]]:
    chart = helm.Chart.load(CHART)
    try:
        out = chart.render(values, name="mem", namespace="llm")
    finally:
        chart.close()
    return {path: [d for d in yaml.safe_load_all(text) if d] for path, text in out.items() if path.endswith(".yaml")}


def objects(rendered) -> list[dict]:
    return [d for docs in rendered.values() for d in docs]


def kind(rendered, name: str) -> dict:
    return next(d for d in objects(rendered) if d["kind"] == name)


@pytest.mark.parametrize("case", sorted(VALUE_SETS))
def test_chart_renders_lints_and_validates(case):
    values, versions = VALUE_SETS[case]
    lint = helm.lint(CHART, values, strict=True)
    assert not lint["errors"], lint
    rendered = render(values)
    kinds = sorted(d["kind"] for d in objects(rendered))
    workload = "DaemonSet" if values.get("kind") == "daemonset" else "StatefulSet"
    assert workload in kinds and "Service" in kinds and "ConfigMap" in kinds
    for obj in objects(rendered):
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # custom resources: checked below against our own files
        for version in versions:
            kubernetes_validate.validate(obj, version, strict=True)  # raises ValidationError
    pod = kind(rendered, workload)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    limits = c["resources"]["limits"]
    size = values.get("hugepages", {}).get("size", "1Gi")
    if size != "off":
        assert limits[f"hugepages-{size}"] == c["resources"]["requests"][f"hugepages-{size}"]  # Kubernetes wants equal
    if values.get("rdma", {}).get("enabled"):
        assert limits["rdma/rdma_shared_device_a"] == 1
    if values.get("multusNetworks"):
        meta = kind(rendered, workload)["spec"]["template"]["metadata"]
        assert meta["annotations"]["k8s.v1.cni.cncf.io/networks"] == "roce-sriov"
    assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
    doctor = pod["initContainers"][0]
    assert doctor["args"][:1] == ["doctor"] and doctor["args"][1:] == c["args"][1:]  # the same configuration
    if workload == "StatefulSet":
        assert kind(rendered, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
        assert pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    service = kind(rendered, "Service")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is False
    if values.get("metrics", {}).get("prometheusRule", {}).get("enabled"):
        with open(os.path.join(ROOT, "deploy", "prometheus", "alerts.yml")) as f:
            assert kind(rendered, "PrometheusRule")["spec"] == yaml.safe_load(f)
        monitor = kind(rendered, "ServiceMonitor")
        assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
        dashboard = next(d for d in objects(rendered) if d["kind"] == "ConfigMap" and "tableserver.json" in d["data"])
        with open(os.path.join(ROOT, "deploy", "grafana", "dashboards", "tableserver.json")) as f:
            assert json.loads(dashboard["data"]["tableserver.json"]) == json.load(f)


def test_the_chart_carries_the_same_alerts_and_dashboard():
    for ours, theirs in (
        ("alerts.yml", ("prometheus", "alerts.yml")),
        ("dashboard.json", ("grafana", "dashboards", "tableserver.json")),
    ):
        with open(os.path.join(CHART, "files", ours)) as a, open(os.path.join(ROOT, "deploy", *theirs)) as b:
            assert a.read() == b.read(), f"deploy/helm/tableserver/files/{ours} drifted: copy it again"


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({"replicas": 0}, "replicas"),
        ({"hugepages": {"size": "3Gi"}}, "size"),
        ({"tables": {"file": "engram.bin", "source": "ftp"}}, "source"),
        ({"tables": {"file": "engram.bin", "source": "pvc", "pvc": {"claimName": ""}}}, "claimName"),
        ({"ports": {"grpc": 70000, "tcp": 7071, "metrics": 7072}}, "grpc"),
        ({"extraArgs": ["rm -rf /"]}, "extraArgs"),
        ({"unknownKey": 1}, "unknownKey"),
    ],
)
def test_the_schema_refuses_bad_values(bad, needle):
    with pytest.raises(helm.HelmError, match=needle):
        render({**AUTH, **bad})


def test_no_token_secret_is_refused_with_the_fix():
    with pytest.raises(helm.HelmError, match="auth.existingSecret is required"):
        render({})


def test_the_daemon_runs_what_the_chart_renders(tmp_path, demo_file, demo_local):
    """The rendered tableserver.toml, container command, args and env, run for real: ports and probe paths
    of the pod spec are the ones the daemon serves, and /readyz says SERVING."""
    import tomllib

    rendered = render({**AUTH, "hugepages": {"size": "off"}})
    pod = kind(rendered, "StatefulSet")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    config = tomllib.loads(kind(rendered, "ConfigMap")["data"]["tableserver.toml"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert config["listen"].endswith(f":{ports['grpc']}") and config["tcp-listen"].endswith(f":{ports['tcp-data']}")
    assert int(config["metrics-port"]) == ports["metrics"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] == "metrics"
    # the pod's paths and ports, mapped into this test (free ports: others may run here)
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    config.update(
        {
            "tables": [demo_file],
            "auth-token-file": str(token),
            "shm-socket": str(tmp_path / "s.sock"),
            "ready-file": str(tmp_path / "ready.json"),
            "listen": "0.0.0.0:0",
            "tcp-listen": "0.0.0.0:0",
            "metrics-port": "0",
        }
    )
    conf = tmp_path / "tableserver.toml"
    conf.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in config.items()) + "\n")
    args = [str(conf) if a == "/etc/tableserver/tableserver.toml" else a for a in c["args"]]
    env = dict(os.environ, TABLESERVER_NODE_ID="mem-tableserver-0", TABLESERVER_TCP_ADVERTISE="127.0.0.1")
    assert c["command"] == ["tableserver"] and {e["name"] for e in c["env"]} == {
        "TABLESERVER_NODE_ID",
        "TABLESERVER_TCP_ADVERTISE",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "tableserver", *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "log", "w"),
    )
    try:
        wait_for(lambda: (tmp_path / "ready.json").exists() or proc.poll() is not None, "SERVING")
        assert proc.poll() is None, (tmp_path / "log").read_text()[-3000:]
        ready = json.loads((tmp_path / "ready.json").read_text())
        ports = {"grpc": int(ready["control"].rsplit(":", 1)[1]), "metrics": int(ready["metrics"].rsplit(":", 1)[1])}
        base = f"http://127.0.0.1:{ports['metrics']}"
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            with urllib.request.urlopen(base + c[probe]["httpGet"]["path"], timeout=EVENT_TIMEOUT) as r:
                assert r.status == 200
        from tableclient import TableClient

        doctor = pod["initContainers"][0]
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "tableserver",
                *[str(conf) if a == "/etc/tableserver/tableserver.toml" else a for a in doctor["args"]],
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=EVENT_TIMEOUT,
        )
        assert "ok    tables:" in res.stdout and "ok    memory plan:" in res.stdout, res.stdout
        with TableClient(f"127.0.0.1:{ports['grpc']}", token="s3cret", transport="tcp") as client:
            assert client.server.node_id == "mem-tableserver-0"
            assert client.table("tiny").gather([0]).tobytes() == demo_local["tiny"][0].tobytes()
    finally:
        proc.terminate()
        proc.wait(EVENT_TIMEOUT)
