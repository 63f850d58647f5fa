"""Deployment files: they parse, validate against the Kubernetes and Compose schemas, autoscale on
metrics Triton 2.51 really exports, and rendering with custom values changes only what it should.

The Triton metric names are checked against ``tests/data/triton_2.51_metrics.txt``, the
``/metrics`` page captured from the real tritonserver 2.51 (nvidia-pytriton 0.7.0) serving a
Python-backend model on 127.0.0.1.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import check_jsonschema
import jsonschema
import kubernetes_validate
import pytest
import yaml

from deploy.render import (
    COMMITTED,
    HPA_METRIC,
    IMAGE_PACKAGES,
    QUEUE_METRIC,
    SUCCESS_METRIC,
    TRITON_IMAGE,
    DeployValues,
    render_deploy,
    render_files,
)
from lmforge_cli import main

ROOT = Path(__file__).resolve().parents[2]
#: Kubernetes API version the manifests are validated against (schemas ship in kubernetes-validate).
K8S_SCHEMA_VERSION = "1.31.0"
CUSTOM_RESOURCE_KINDS = {"ServiceMonitor", "PodMonitor"}  # Prometheus Operator CRDs, no upstream schema
METRICS_CAPTURE = ROOT / "tests" / "data" / "triton_2.51_metrics.txt"


def _documents(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def _k8s_docs(files: dict[str, str]) -> list[dict]:
    return [
        d
        for name, text in files.items()
        if name.endswith(".yaml") and name not in ("kustomization.yaml", "prometheus-adapter-values.yaml")
        for d in _documents(text)
    ]


def test_committed_files_are_the_rendered_defaults(tmp_path):
    for rel, (target, values) in COMMITTED.items():
        rendered = render_files(target, dataclasses.replace(DeployValues(), **values))
        committed = {p.name: p.read_text() for p in (ROOT / rel).iterdir() if p.is_file()}
        assert committed == rendered, f"{rel} is stale; run python -m deploy.render"


def test_images_copy_every_package_pyproject_installs():
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert list(IMAGE_PACKAGES) == [pattern.rstrip("*") for pattern in include]
    for name in ("Dockerfile", "Dockerfile.cpu"):
        text = (ROOT / "deploy" / "docker" / name).read_text()
        assert all(f"COPY {package} ./{package}\n" in text for package in IMAGE_PACKAGES), name


def test_every_yaml_under_deploy_parses():
    files = sorted((ROOT / "deploy").rglob("*.y*ml"))
    assert len(files) >= 18
    for path in files:
        assert _documents(path.read_text()), path


def _custom_values(**more) -> DeployValues:
    return DeployValues(
        model_name="llama_int8",
        image="registry.example.com/ml/lmforge:1.2",
        replicas=3,
        max_replicas=12,
        gpus=2,
        cpu="8",
        memory="32Gi",
        **more,
    )


@pytest.mark.parametrize(
    "values",
    [
        DeployValues(),
        DeployValues(gpus=0),
        _custom_values(),
        _custom_values(model_repository="s3://models-bucket/lmforge", monitor="podmonitor"),
    ],
    ids=["gpu", "cpu", "custom", "s3-podmonitor"],
)
def test_k8s_manifests_validate_against_kubernetes_schemas(values):
    docs = _k8s_docs(render_files("k8s", values))
    kinds = [d["kind"] for d in docs]
    assert {"Deployment", "Service", "HorizontalPodAutoscaler"} <= set(kinds)
    for doc in docs:
        if doc["kind"] in CUSTOM_RESOURCE_KINDS:
            continue
        kubernetes_validate.validate(doc, K8S_SCHEMA_VERSION, strict=True)  # raises ValidationError
    with pytest.raises(kubernetes_validate.ValidationError):  # the validator does reject a broken manifest
        broken = next(d for d in docs if d["kind"] == "Deployment")
        broken = {**broken, "spec": {**broken["spec"], "replicas": "three"}}
        kubernetes_validate.validate(broken, K8S_SCHEMA_VERSION, strict=True)


@pytest.mark.parametrize("values", [DeployValues(), _custom_values(monitor="podmonitor")], ids=["service", "pod"])
def test_monitor_and_hpa_point_at_the_triton_pods(values):
    docs = _k8s_docs(render_files("k8s", values))
    by_kind = {d["kind"]: d for d in docs if d["metadata"]["name"] == values.name}
    deployment, service, hpa = by_kind["Deployment"], by_kind["Service"], by_kind["HorizontalPodAutoscaler"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    monitor = by_kind["ServiceMonitor" if values.monitor == "servicemonitor" else "PodMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    metrics = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == f"{values.name}-metrics"]
    selected = metrics[0]["metadata"]["labels"] if monitor["kind"] == "ServiceMonitor" else pod_labels
    assert monitor["spec"]["selector"]["matchLabels"].items() <= selected.items()
    if monitor["kind"] == "ServiceMonitor":  # it scrapes the metrics Service, never the clients' one
        assert not monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    endpoints = monitor["spec"].get("endpoints") or monitor["spec"]["podMetricsEndpoints"]
    assert endpoints[0]["port"] == "metrics" and endpoints[0]["path"] == "/metrics"
    assert service["spec"]["selector"].items() <= pod_labels.items()
    # the clients' Service has the client ports only; the metrics port has its own Service (ServiceMonitor only)
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"http": 8000, "grpc": 8001}
    assert len(metrics) == (values.monitor == "servicemonitor")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):  # the model's readiness, not the server's
        assert container[probe]["httpGet"]["path"] == f"/v2/models/{values.model_name}/ready"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= values.startup_timeout_s
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == HPA_METRIC


def _exported_metric_types() -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (\w+) (\w+)$", METRICS_CAPTURE.read_text(), flags=re.M))


def test_autoscaling_reads_metrics_the_real_triton_exports():
    exported = _exported_metric_types()
    assert exported[QUEUE_METRIC] == "counter" and exported[SUCCESS_METRIC] == "counter"
    assert re.search(
        r'^nv_inference_queue_duration_us\{model="echo",version="1"\} \d+$', METRICS_CAPTURE.read_text(), re.M
    )
    adapter = _documents(render_files("k8s", DeployValues())["prometheus-adapter-values.yaml"])[0]
    rule = adapter["rules"]["custom"][0]
    used = set(re.findall(r"\bnv_\w+", rule["seriesQuery"] + " " + rule["metricsQuery"]))
    assert used == {QUEUE_METRIC, SUCCESS_METRIC} and used <= exported.keys()
    assert rule["name"]["as"] == HPA_METRIC
    assert re.fullmatch(
        rf"sum by \(<<.GroupBy>>\) \(rate\({QUEUE_METRIC}\{{.*\}}\[1m\]\)\) / "
        rf"clamp_min\(sum by \(<<.GroupBy>>\) \(rate\({SUCCESS_METRIC}\{{.*\}}\[1m\]\)\), 0.001\)",
        rule["metricsQuery"],
    )


def test_compose_validates_against_the_compose_spec():
    schema_path = Path(check_jsonschema.__file__).parent / "builtin_schemas" / "vendor" / "compose-spec.json"
    schema = json.loads(schema_path.read_text())
    for values in (DeployValues(), _custom_values()):
        compose = _documents(render_files("docker", values)["compose.yaml"])[0]
        jsonschema.Draft202012Validator(schema).validate(compose)
        assert set(compose["services"]) == {"triton-gpu", "triton-cpu", "prometheus", "locust-master", "locust-worker"}
        assert compose["services"]["triton-gpu"]["profiles"] == ["gpu"] and compose["services"]["triton-cpu"][
            "profiles"
        ] == ["cpu"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schema).validate({"services": {"x": {"shm_size": [1]}}})
    prometheus = _documents((ROOT / "deploy/docker/prometheus.yml").read_text())[0]
    assert prometheus["scrape_configs"][0]["static_configs"][0]["targets"] == ["triton:8002"]


def test_dockerfiles_build_on_triton_2_51_and_copy_existing_paths():
    files = render_files("docker", DeployValues())
    gpu, cpu = files["Dockerfile"], files["Dockerfile.cpu"]
    assert re.search(rf"^FROM {re.escape(TRITON_IMAGE)}$", gpu, re.M) and TRITON_IMAGE.endswith(":24.10-py3")
    # the CPU base is a build argument whose default is the public image
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim-bookworm$", cpu, re.M)
    assert re.findall(r"^FROM (\S+)", cpu, re.M) == ["${BASE_IMAGE}", "${BASE_IMAGE}"]
    for text in (gpu, cpu):
        assert (
            "EXPOSE 8000 8001\n" in text  # the client ports (Prometheus reaches 8002 on the network)
            and "/v2/models/smollm2_135m/ready" in text
            and "--load-model=smollm2_135m" in text
        )
        for source in re.findall(r"^COPY (?!\$|--from)(.+) \S+$", text, re.M):
            for item in source.split():
                assert (ROOT / item).exists(), item
    assert "python_backend_stubs/3.11/triton_python_backend_stub" in gpu and "python_backend_stubs/3.11" in cpu


def _flatten(value, prefix=()) -> dict[tuple, object]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flatten(item, prefix + (key,)).items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in _flatten(item, prefix + (i,)).items()}
    return {prefix: value}


def _changed_paths(before: dict[str, str], after: dict[str, str]) -> set[tuple]:
    changed = set()
    for name in before.keys() | after.keys():
        old = _flatten([_documents(before[name])]) if name in before and name.endswith(("yaml", "yml")) else {}
        new = _flatten([_documents(after[name])]) if name in after and name.endswith(("yaml", "yml")) else {}
        changed |= {(name,) + path for path in old.keys() | new.keys() if old.get(path) != new.get(path)}
    return changed


def test_custom_values_change_what_they_should_and_nothing_else():
    base = render_files("k8s", DeployValues())
    changed = _changed_paths(base, render_files("k8s", DeployValues(replicas=3, max_replicas=9)))
    assert changed == {
        ("deployment.yaml", 0, 0, "spec", "replicas"),
        ("hpa.yaml", 0, 0, "spec", "minReplicas"),
        ("hpa.yaml", 0, 0, "spec", "maxReplicas"),
    }
    changed = _changed_paths(base, render_files("k8s", DeployValues(image="registry.example.com/ml/lmforge:1.2")))
    assert changed == {("deployment.yaml", 0, 0, "spec", "template", "spec", "containers", 0, "image")}
    container = ("deployment.yaml", 0, 0, "spec", "template", "spec", "containers", 0)
    changed = _changed_paths(base, render_files("k8s", DeployValues(cpu="8", memory="32Gi", gpus=2)))
    assert changed == {
        container + ("resources", kind, res)
        for kind in ("requests", "limits")
        for res in ("cpu", "memory", "nvidia.com/gpu")
    }
    changed = _changed_paths(base, render_files("k8s", DeployValues(model_name="llama_int8")))
    assert changed == {container + ("args", 2)} | {
        container + (probe, "httpGet", "path") for probe in ("startupProbe", "livenessProbe", "readinessProbe")
    } | {
        ("locust.yaml", 0, 0, "spec", "template", "spec", "containers", 0, "args", 4),
        ("prometheus-adapter-values.yaml", 0, 0, "rules", "custom", 0, "metricsQuery"),
    }
    gpu_off = _changed_paths(base, render_files("k8s", DeployValues(gpus=0)))
    tolerations = {
        ("deployment.yaml", 0, 0, "spec", "template", "spec", "tolerations", 0, key)
        for key in ("key", "operator", "effect")
    }
    # the CPU image runs as its non-root user (Dockerfile.cpu); the GPU one is NGC's
    security = {
        ("deployment.yaml", 0, 0, "spec", "template", "spec", "securityContext", key)
        for key in ("runAsNonRoot", "runAsUser", "runAsGroup", "fsGroup")
    }
    assert (
        gpu_off
        == {container + ("resources", kind, "nvidia.com/gpu") for kind in ("requests", "limits")}
        | {container + ("args", 7)}
        | tolerations
        | security
    )
    docker = render_files("docker", DeployValues())
    changed = _changed_paths(docker, render_files("docker", DeployValues(locust_workers=16)))
    assert changed == {
        ("compose.yaml", 0, 0, "services", "locust-master", "command", 7),
        ("compose.yaml", 0, 0, "services", "locust-worker", "deploy", "replicas"),
    }


def test_render_api_cli_and_errors(tmp_path, capsys):
    paths = render_deploy("k8s", tmp_path / "k8s", model_name="m1", replicas=2, max_replicas=2)
    assert {p.name for p in paths} >= {"deployment.yaml", "hpa.yaml", "kustomization.yaml"}
    kustomization = _documents((tmp_path / "k8s" / "kustomization.yaml").read_text())[0]
    assert all((tmp_path / "k8s" / r).is_file() for r in kustomization["resources"])
    example = yaml.safe_load((ROOT / "deploy" / "values.example.yaml").read_text())
    assert DeployValues(**example) == DeployValues()  # the documented defaults are the real ones
    values_file = tmp_path / "values.yaml"
    values_file.write_text("model_name: from_file\nreplicas: 2\nmax_replicas: 5\n")
    assert (
        main(
            [
                "render",
                "--target",
                "k8s",
                "--out",
                str(tmp_path / "cli"),
                "--values",
                str(values_file),
                "--replicas",
                "3",
            ]
        )
        == 0
    )
    deployment = _documents((tmp_path / "cli" / "deployment.yaml").read_text())[0]
    assert (
        deployment["spec"]["replicas"] == 3
        and "--load-model=from_file" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    capsys.readouterr()
    assert (
        main(["render", "--target", "k8s", "--out", str(tmp_path / "bad"), "--replicas", "5", "--max-replicas", "2"])
        == 2
    )
    assert "max_replicas=2 < replicas=5" in capsys.readouterr().err
    with pytest.raises(ValueError, match="model_repository='gs://x'"):
        render_deploy("k8s", tmp_path / "x", model_repository="gs://x")
    with pytest.raises(ValueError, match="unknown deploy values"):
        render_deploy("docker", tmp_path / "x", replica=2)


def test_api_key_secret_restricts_triton_and_reaches_locust():
    values = DeployValues(api_key_secret="lmforge-api-key")
    docs = _k8s_docs(render_files("k8s", values))
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == values.name)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    restricted = [a for a in container["args"] if "restricted" in a]
    assert [a.split("=", 1)[0] for a in restricted] == ["--http-restricted-api", "--grpc-restricted-protocol"]
    assert all(a.endswith(":authorization=Bearer $(LMFORGE_API_KEY)") and "health" not in a for a in restricted)
    assert all("inference" in a and "model-repository" in a for a in restricted)
    [env] = container["env"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "lmforge-api-key", "key": "api-key"}
    master = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("locust-master"))
    assert "--api-key=$(LMFORGE_API_KEY)" in master["spec"]["template"]["spec"]["containers"][0]["args"]
    compose = yaml.safe_load(render_files("docker", values)["compose.yaml"].split("\n", 1)[1])
    triton = compose["services"]["triton-cpu"]
    assert triton["ports"] == ["127.0.0.1:8000:8000", "127.0.0.1:8001:8001"]
    assert any(a.startswith("--http-restricted-api=") and "${LMFORGE_API_KEY:?" in a for a in triton["command"])
    open_docs = _k8s_docs(render_files("k8s", DeployValues()))
    open_deployment = next(
        d for d in open_docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "lmforge-triton"
    )
    assert not any("restricted" in a for a in open_deployment["spec"]["template"]["spec"]["containers"][0]["args"])
