"""Kubernetes target: the Triton Deployment, Services, PVC, HPA, prometheus-adapter values, the
Prometheus Operator monitor, the Locust master and workers, and the kustomization."""

from __future__ import annotations

from typing import Any

from deploy.render.server import API_KEY_ENV, CLIENT_PORTS, model_ready_path, triton_args
from deploy.render.values import (
    HPA_METRIC,
    IMAGE_UID,
    LOCUST_PORTS,
    QUEUE_METRIC,
    SUCCESS_METRIC,
    TRITON_PORTS,
    DeployValues,
)


def _labels(v: DeployValues, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": v.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "lmforge",
    }


def _meta(v: DeployValues, name: str, component: str, **extra_labels: str) -> dict[str, Any]:
    return {"name": name, "namespace": v.namespace, "labels": {**_labels(v, component), **extra_labels}}


def _resource(api_version: str, kind: str, metadata: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """A Kubernetes object: ``apiVersion``, ``kind``, ``metadata`` (``_meta``) and ``spec``."""
    return {"apiVersion": api_version, "kind": kind, "metadata": metadata, "spec": spec}


def _api_key_env(v: DeployValues) -> list[dict[str, Any]]:
    """The container's ``LMFORGE_API_KEY`` from ``api_key_secret`` (none without one)."""
    if not v.api_key_secret:
        return []
    return [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": v.api_key_secret, "key": "api-key"}}}]


def _probe(path: str, period_s: int, failures: int) -> dict[str, Any]:
    # the port by number: podman kube play (4.3) turns a named port into port 0
    return {
        "httpGet": {"path": path, "port": TRITON_PORTS["http"]},
        "periodSeconds": period_s,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def triton_deployment(v: DeployValues) -> dict[str, Any]:
    resources: dict[str, Any] = {
        "requests": {"cpu": v.cpu, "memory": v.memory},
        "limits": {"cpu": v.cpu, "memory": v.memory},
    }
    if v.gpus:
        resources["requests"]["nvidia.com/gpu"] = v.gpus
        resources["limits"]["nvidia.com/gpu"] = v.gpus
    volumes: list[dict[str, Any]] = [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": v.shm_size}}]
    mounts: list[dict[str, Any]] = [{"name": "shm", "mountPath": "/dev/shm"}]
    container: dict[str, Any] = {
        "name": "tritonserver",
        "image": v.image,
        "args": triton_args(v),
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in TRITON_PORTS.items()],
        **({"env": _api_key_env(v)} if v.api_key_secret else {}),
        "resources": resources,
        # The model's own ready endpoint: a model whose engine died unloads itself, and
        # /v2/health/ready would still answer 200 (strict readiness ignores unloaded models).
        "startupProbe": _probe(model_ready_path(v.model_name), 10, -(-v.startup_timeout_s // 10)),
        "livenessProbe": _probe(model_ready_path(v.model_name), 10, 3),
        "readinessProbe": _probe(model_ready_path(v.model_name), 5, 3),
        "volumeMounts": mounts,
    }
    if v.model_repository == "pvc":
        volumes.append(
            {"name": "model-repository", "persistentVolumeClaim": {"claimName": f"{v.name}-models", "readOnly": True}}
        )
        mounts.append({"name": "model-repository", "mountPath": "/models", "readOnly": True})
    else:
        container["envFrom"] = [{"secretRef": {"name": v.s3_secret, "optional": True}}]
    pod_spec: dict[str, Any] = {"containers": [container], "volumes": volumes, "terminationGracePeriodSeconds": 60}
    if not v.gpus:  # the CPU image runs as this user (Dockerfile.cpu); the GPU one is NGC's, as root
        pod_spec["securityContext"] = {
            "runAsNonRoot": True,
            "runAsUser": IMAGE_UID,
            "runAsGroup": IMAGE_UID,
            "fsGroup": IMAGE_UID,
        }
    if v.gpus:
        pod_spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return _resource(
        "apps/v1",
        "Deployment",
        _meta(v, v.name, "server"),
        {
            "replicas": v.replicas,
            "selector": {"matchLabels": _labels(v, "server")},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {"metadata": {"labels": _labels(v, "server")}, "spec": pod_spec},
        },
    )


def _triton_pods_service(
    metadata: dict[str, Any], selector: dict[str, str], port_names: tuple[str, ...]
) -> dict[str, Any]:
    """A ClusterIP Service of the Triton pods' ``port_names`` (keys of ``TRITON_PORTS``), over TCP."""
    ports = [{"name": n, "port": TRITON_PORTS[n], "targetPort": n, "protocol": "TCP"} for n in port_names]
    return _resource("v1", "Service", metadata, {"type": "ClusterIP", "selector": selector, "ports": ports})


def triton_service(v: DeployValues) -> dict[str, Any]:
    """The clients' Service: HTTP and gRPC only."""
    return _triton_pods_service(_meta(v, v.name, "server"), _labels(v, "server"), CLIENT_PORTS)


def metrics_service(v: DeployValues) -> dict[str, Any]:
    """The metrics port of the Triton pods, for the ServiceMonitor only."""
    return _triton_pods_service(_meta(v, f"{v.name}-metrics", "metrics"), _labels(v, "server"), ("metrics",))


def model_repository_pvc(v: DeployValues) -> dict[str, Any]:
    spec: dict[str, Any] = {"accessModes": [v.pvc_access_mode], "resources": {"requests": {"storage": v.pvc_size}}}
    if v.storage_class:
        spec["storageClassName"] = v.storage_class
    return _resource("v1", "PersistentVolumeClaim", _meta(v, f"{v.name}-models", "server"), spec)


def horizontal_pod_autoscaler(v: DeployValues) -> dict[str, Any]:
    return _resource(
        "autoscaling/v2",
        "HorizontalPodAutoscaler",
        _meta(v, v.name, "server"),
        {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": v.name},
            "minReplicas": v.replicas,
            "maxReplicas": v.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": HPA_METRIC},
                        "target": {"type": "AverageValue", "averageValue": str(v.queue_time_target_us)},
                    },
                }
            ],
            "behavior": {
                "scaleUp": {
                    "stabilizationWindowSeconds": 60,
                    "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}],
                },
                "scaleDown": {
                    "stabilizationWindowSeconds": 300,
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}],
                },
            },
        },
    )


def adapter_query(v: DeployValues, window: str = "1m") -> str:
    """PromQL prometheus-adapter runs per pod: queue microseconds per successful request over ``window``.

    ``rate(nv_inference_queue_duration_us) / rate(nv_inference_request_success)``, both counters of
    Triton 2.51, for the served model only; the denominator is clamped so an idle pod reads 0.
    """
    matchers = f'<<.LabelMatchers>>,model="{v.model_name}"'
    return (
        f"sum by (<<.GroupBy>>) (rate({QUEUE_METRIC}{{{matchers}}}[{window}])) / "
        f"clamp_min(sum by (<<.GroupBy>>) (rate({SUCCESS_METRIC}{{{matchers}}}[{window}])), 0.001)"
    )


def prometheus_adapter_values(v: DeployValues) -> dict[str, Any]:
    """Helm values for the prometheus-community/prometheus-adapter chart: one custom metrics rule."""
    return {
        "prometheus": {"url": "http://prometheus-operated.monitoring.svc", "port": 9090},
        "rules": {
            "default": False,
            "custom": [
                {
                    "seriesQuery": f'{QUEUE_METRIC}{{namespace!="",pod!=""}}',
                    "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
                    "name": {"matches": f"^{QUEUE_METRIC}$", "as": HPA_METRIC},
                    "metricsQuery": adapter_query(v),
                }
            ],
        },
    }


def monitor(v: DeployValues) -> dict[str, Any]:
    """ServiceMonitor (scrapes the metrics Service) or PodMonitor (the pods' ``metrics`` port) for Triton."""
    endpoint = {"port": "metrics", "path": "/metrics", "interval": "15s"}
    if v.monitor == "servicemonitor":
        kind, spec = "ServiceMonitor", {"selector": {"matchLabels": _labels(v, "metrics")}, "endpoints": [endpoint]}
    else:
        kind, spec = (
            "PodMonitor",
            {"selector": {"matchLabels": _labels(v, "server")}, "podMetricsEndpoints": [endpoint]},
        )
    spec["namespaceSelector"] = {"matchNames": [v.namespace]}
    return _resource("monitoring.coreos.com/v1", kind, _meta(v, v.name, "server", release=v.prometheus_release), spec)


def _locust_container(v: DeployValues, args: list[str], ports: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": "locust",
        "image": v.locust_image,
        "command": ["locust"],
        "args": args,
        **({"env": _api_key_env(v)} if v.api_key_secret else {}),
        "ports": ports,
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "1Gi"}},
    }


def locust_master(v: DeployValues) -> list[dict[str, Any]]:
    """Master Deployment (web UI on 8089, workers connect on 5557) and its Service."""
    name = f"{v.name}-locust-master"
    args = [
        "-f",
        "/opt/lmforge/bench/locustfile.py",
        "--master",
        f"--host=http://{v.name}:{TRITON_PORTS['http']}",
        f"--model={v.model_name}",
        f"--expect-workers={v.locust_workers}",
        *([f"--api-key=$({API_KEY_ENV})"] if v.api_key_secret else []),
    ]
    ports = [
        {"name": "web", "containerPort": LOCUST_PORTS["web"]},
        {"name": "master", "containerPort": LOCUST_PORTS["master"]},
    ]
    deployment = _resource(
        "apps/v1",
        "Deployment",
        _meta(v, name, "locust-master"),
        {
            "replicas": 1,
            "selector": {"matchLabels": _labels(v, "locust-master")},
            "template": {
                "metadata": {"labels": _labels(v, "locust-master")},
                "spec": {"containers": [_locust_container(v, args, ports)]},
            },
        },
    )
    service = _resource(
        "v1",
        "Service",
        _meta(v, name, "locust-master"),
        {
            "selector": _labels(v, "locust-master"),
            "ports": [{"name": n, "port": p, "targetPort": n} for n, p in LOCUST_PORTS.items()],
        },
    )
    return [deployment, service]


def locust_workers(v: DeployValues) -> dict[str, Any]:
    args = [
        "-f",
        "/opt/lmforge/bench/locustfile.py",
        "--worker",
        f"--master-host={v.name}-locust-master",
        f"--master-port={LOCUST_PORTS['master']}",
    ]
    return _resource(
        "apps/v1",
        "Deployment",
        _meta(v, f"{v.name}-locust-worker", "locust-worker"),
        {
            "replicas": v.locust_workers,
            "selector": {"matchLabels": _labels(v, "locust-worker")},
            "template": {
                "metadata": {"labels": _labels(v, "locust-worker")},
                "spec": {"containers": [_locust_container(v, args, [])]},
            },
        },
    )


def k8s_documents(v: DeployValues) -> dict[str, list[dict[str, Any]]]:
    """File name -> Kubernetes objects (``kustomization.yaml`` and the adapter values excluded)."""
    files = {
        "deployment.yaml": [triton_deployment(v)],
        "service.yaml": [triton_service(v)] + ([metrics_service(v)] if v.monitor == "servicemonitor" else []),
        "hpa.yaml": [horizontal_pod_autoscaler(v)],
        f"{v.monitor}.yaml": [monitor(v)],
        "locust.yaml": [*locust_master(v), locust_workers(v)],
    }
    if v.model_repository == "pvc":
        files["model-repository-pvc.yaml"] = [model_repository_pvc(v)]
    return files


def kustomization(v: DeployValues, resources: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": v.namespace,
        "resources": sorted(resources),
    }
