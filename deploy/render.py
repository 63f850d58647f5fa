"""``lmforge render``: container and Kubernetes files for serving a model on Triton at scale.

    lmforge render --target docker --out build/docker --model-name smollm2_135m
    lmforge render --target k8s --out build/k8s --model-name smollm2_135m --image REGISTRY/lmforge-triton:0.1.0 \\
        --replicas 2 --max-replicas 8 --gpus 1 --model-repository s3://bucket/model_repository

The files are built from ``DeployValues`` (every field documented below) so users never hand-edit
YAML; ``deploy/docker/`` and ``deploy/k8s/{gpu,cpu}/`` in the repository are these files rendered
with the defaults (a test keeps them in sync). ``render_deploy`` is the function
``lmforge export --target docker|k8s`` calls.

Kubernetes target (apply with ``kubectl apply -k OUT``): a Triton Deployment (startup, liveness
and readiness probes on the model's ``/v2/models/NAME/ready``, so a model that unloaded itself
after its engine died gets the pod restarted; the startup probe waits out the model load; ``nvidia.com/gpu`` in the GPU
variant, an in-memory ``/dev/shm`` for the Python backend), a
Service (HTTP 8000, gRPC 8001, metrics 8002), a HorizontalPodAutoscaler on Triton's queue time
per request served through prometheus-adapter (its Helm values are rendered too), a
ServiceMonitor (or PodMonitor) for the Prometheus Operator, Locust master and worker
Deployments for in-cluster load, and a PVC for the model repository unless it is ``s3://``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from deploy.triton import API_KEY_HEADER, DEFAULT_PORTS, RESTRICTED_APIS
from engine.checkpoint.outputs import RENDERED, check_output_dir
from engine.errors import LmforgeError, UsageError

TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"  # NGC 24.10 = Triton 2.51, the server lmforge tests against
TORCH_VERSION = "2.13.0"  # the pyproject pin; the CPU image installs this version's CPU build
TRITON_PORTS = DEFAULT_PORTS  # the ports tritonserver listens on (deploy.triton)
LOCUST_PORTS = {"web": 8089, "master": 5557}
#: Triton 2.51 metric families the autoscaling rule reads (checked against a real server's /metrics).
QUEUE_METRIC = "nv_inference_queue_duration_us"
SUCCESS_METRIC = "nv_inference_request_success"
#: Name prometheus-adapter serves the per-pod average queue time per request under (custom.metrics.k8s.io).
HPA_METRIC = "triton_queue_duration_us_per_request"
TARGETS = ("docker", "k8s")

#: pyproject extras the CPU image installs: the Triton server and OpenAI frontend (``serve``), and
#: Locust with the OpenAI client (``bench``: the compose and Kubernetes load generators use the
#: image). ``dev`` (tests, lint, manifest schemas) stays out.
IMAGE_EXTRAS = ("serve", "bench")
#: pyproject dependencies the CPU image leaves out: the Triton compiler (about 1 GB; it only builds
#: the CUDA paged-attention kernels).
IMAGE_SKIPPED_DEPENDENCIES = ("triton",)
#: The non-root user the CPU image runs as (uid = gid).
IMAGE_UID = 1000
#: Python the CPU image runs to build the C++ CPU kernels (those ``make venv`` builds); it fails
#: the build when the engine's own kernels do not build (the INT8 ones may not apply to the CPU).
IMAGE_KERNEL_BUILD = (
    "import sys; from engine.cpu_ops import use_cpu_kernels; "
    "from engine.quant.int8 import amx_cpu_kernel, fused_cpu_kernels, weight_only_cpu_kernel; "
    "built = [use_cpu_kernels(), fused_cpu_kernels(), weight_only_cpu_kernel(), amx_cpu_kernel()]; "
    "print('C++ CPU kernels built:', built); sys.exit(0 if built[0] else 'the engine kernels did not build')"
)


#: Kubernetes object names (RFC 1123 label / subdomain), as the API server checks them.
DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
#: A Triton model directory name that is also safe inside a PromQL string and a command line.
MODEL_NAME = re.compile(r"[A-Za-z0-9_-]{1,63}")
#: Kubernetes resource quantity (decimal number, optional SI or binary suffix).
QUANTITY = re.compile(r"([0-9]+(\.[0-9]*)?|\.[0-9]+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
#: Docker image reference: [registry[:port]/]path[:tag][@sha256:digest], path components lowercase.
IMAGE_REFERENCE = re.compile(
    r"([A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*(:[0-9]+)?/)?"
    r"[a-z0-9]+([._-][a-z0-9]+)*(/[a-z0-9]+([._-][a-z0-9]+)*)*"
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?"
)
#: Locust ``--run-time``.
RUN_TIME = re.compile(r"(?=.)([0-9]+h)?([0-9]+m)?([0-9]+s)?")


def _check(key: str, value: str, pattern: re.Pattern[str], what: str) -> None:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ValueError(f"{key}={value!r}: not {what}; fix --{key.replace('_', '-')} (or {key} in --values)")


@dataclass(frozen=True)
class DeployValues:
    """Everything the rendered files vary on. Defaults give the committed files.

    Raises:
        ValueError: an empty name, non-positive replica counts, ``max_replicas < replicas``,
            negative GPUs, an unknown ``monitor``, or a name, quantity, image reference or
            duration in the wrong format (names the field and the fix).
    """

    model_name: str = "smollm2_135m"  # Triton model to load (directory name in the model repository)
    image: str = "lmforge-triton:0.1.0"  # image built from deploy/docker/Dockerfile (Dockerfile.cpu when gpus == 0)
    name: str = "lmforge-triton"  # name and app label of the Deployment, Service, HPA, monitor
    namespace: str = "lmforge"
    replicas: int = 1  # Triton pods at start, and the HPA minimum
    max_replicas: int = 4  # HPA maximum
    gpus: int = 1  # nvidia.com/gpu per pod; 0 renders the CPU variant
    cpu: str = "4"  # CPU request (and limit) per Triton pod
    memory: str = "16Gi"  # memory request (and limit) per Triton pod
    shm_size: str = "2Gi"  # /dev/shm for the Python backend's shared-memory tensors
    model_repository: str = "pvc"  # "pvc" (mounted at /models) or an s3:// URL Triton reads itself
    pvc_size: str = "20Gi"
    pvc_access_mode: str = "ReadWriteMany"  # so a loader pod can fill it; Triton pods mount it read-only
    storage_class: str = ""  # PVC storageClassName; "" = the cluster default
    s3_secret: str = "lmforge-s3-credentials"  # Secret with AWS_ACCESS_KEY_ID/... for s3:// repositories
    queue_time_target_us: int = 50_000  # HPA target: average queue time per request, microseconds
    startup_timeout_s: int = 600  # how long the startup probe waits for the model to load
    monitor: str = "servicemonitor"  # "servicemonitor" or "podmonitor" (Prometheus Operator)
    prometheus_release: str = "prometheus"  # `release` label the Prometheus Operator selects monitors by
    locust_image: str = "lmforge-triton:0.1.0-cpu"  # image with lmforge + Locust for the load generators
    locust_workers: int = 4
    locust_users: int = 64  # docker target: users the headless Locust run starts
    locust_spawn_rate: int = 8
    locust_run_time: str = "10m"
    # A Secret (its key ``api-key``) holding the API key: set, every Triton API but health answers only
    # ``Authorization: Bearer KEY`` (inference, model control...), and Locust sends it. "" = open APIs.
    api_key_secret: str = ""

    def __post_init__(self) -> None:
        self._check_types()
        for key in ("model_name", "image", "name", "namespace", "locust_image"):
            if not getattr(self, key):
                raise ValueError(f"{key} is empty; pass --{key.replace('_', '-')}")
        for key in ("replicas", "max_replicas", "locust_workers", "startup_timeout_s", "queue_time_target_us"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)}: must be >= 1")
        if self.max_replicas < self.replicas:
            raise ValueError(f"max_replicas={self.max_replicas} < replicas={self.replicas}; raise --max-replicas")
        if self.gpus < 0:
            raise ValueError(f"gpus={self.gpus}: must be >= 0 (0 renders the CPU variant)")
        if self.pvc_access_mode not in ("ReadWriteMany", "ReadOnlyMany", "ReadWriteOnce"):
            raise ValueError(
                f"pvc_access_mode={self.pvc_access_mode!r}: use ReadWriteMany, ReadOnlyMany or ReadWriteOnce"
            )
        if self.monitor not in ("servicemonitor", "podmonitor"):
            raise ValueError(f"monitor={self.monitor!r}: use 'servicemonitor' or 'podmonitor'")
        if self.model_repository != "pvc" and not self.model_repository.startswith("s3://"):
            raise ValueError(f"model_repository={self.model_repository!r}: use 'pvc' or an s3:// URL")
        self._check_formats()

    def _check_types(self) -> None:
        """YAML gives ints and floats where a string is meant (``cpu: 4``) and anything anywhere."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "str" and isinstance(value, (int, float)) and not isinstance(value, bool):
                object.__setattr__(self, f.name, str(value))  # cpu: 4 -> "4"
            elif f.type == "str" and not isinstance(value, str):
                raise ValueError(f"{f.name}={value!r}: must be a string")
            elif f.type == "int" and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{f.name}={value!r}: must be an integer")

    def _check_formats(self) -> None:
        """Names, quantities, images and durations the cluster or Docker would reject later."""
        for key in ("name", "namespace"):
            _check(
                key,
                getattr(self, key),
                DNS1123_LABEL,
                "a Kubernetes name: lowercase letters, digits and '-', at most 63, e.g. lmforge-triton",
            )
        for key in ("s3_secret", "prometheus_release") + (("storage_class",) if self.storage_class else ()):
            _check(
                key,
                getattr(self, key),
                DNS1123_SUBDOMAIN,
                "a Kubernetes name: lowercase letters, digits, '-' and '.', at most 253",
            )
        _check(
            "model_name",
            self.model_name,
            MODEL_NAME,
            "a Triton model name: letters, digits, '_' and '-', at most 63 (lmforge export --name)",
        )
        for key in ("cpu", "memory", "shm_size", "pvc_size"):
            _check(key, getattr(self, key), QUANTITY, "a Kubernetes quantity, e.g. 4, 500m, 16Gi, 512Mi")
        if not float(re.match(r"[0-9.]+", self.cpu).group()) > 0:
            raise ValueError(f"cpu={self.cpu!r}: must be > 0; fix --cpu (or cpu in --values)")
        for key in ("image", "locust_image"):
            _check(
                key,
                getattr(self, key),
                IMAGE_REFERENCE,
                "an image reference, e.g. registry.example.com:5000/team/lmforge-triton:0.1.0",
            )
        _check("locust_run_time", self.locust_run_time, RUN_TIME, "a duration like 10m, 1h30m or 90s")

    @property
    def repository_path(self) -> str:
        return "/models" if self.model_repository == "pvc" else self.model_repository


# ---------------------------------------------------------------------------------------------
# Kubernetes
# ---------------------------------------------------------------------------------------------


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


#: The environment variable the API key reaches Triton and Locust in (from ``api_key_secret``).
API_KEY_ENV = "LMFORGE_API_KEY"


def triton_args(v: DeployValues, key_ref: str = f"$({API_KEY_ENV})") -> list[str]:
    """tritonserver flags: the repository, explicit loading of the one model, ports, metrics, and with
    ``api_key_secret`` every API but health restricted to the key (``key_ref``: how the manifest refers to
    the variable holding it: ``$(VAR)`` in Kubernetes, ``${VAR}`` in compose)."""
    args = [
        f"--model-repository={v.repository_path}",
        "--model-control-mode=explicit",
        f"--load-model={v.model_name}",
        f"--http-port={TRITON_PORTS['http']}",
        f"--grpc-port={TRITON_PORTS['grpc']}",
        f"--metrics-port={TRITON_PORTS['metrics']}",
        "--allow-metrics=true",
        f"--allow-gpu-metrics={'true' if v.gpus else 'false'}",
        "--exit-timeout-secs=30",
    ]
    if v.api_key_secret:
        rule = f"{','.join(RESTRICTED_APIS)}:{API_KEY_HEADER}=Bearer {key_ref}"
        args += [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]
    return args


def _api_key_env(v: DeployValues) -> list[dict[str, Any]]:
    """The container's ``LMFORGE_API_KEY`` from ``api_key_secret`` (none without one)."""
    if not v.api_key_secret:
        return []
    return [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": v.api_key_secret, "key": "api-key"}}}]


def model_ready_path(model_name: str) -> str:
    """Triton's per-model readiness endpoint, the one probes and health checks poll."""
    return f"/v2/models/{model_name}/ready"


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


#: The Triton ports a client needs (the Service's); ``metrics`` is only Prometheus' (its own Service).
CLIENT_PORTS = ("http", "grpc")


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


# ---------------------------------------------------------------------------------------------
# Docker
# ---------------------------------------------------------------------------------------------

#: The source tree both images install (the build context is the repository root).
_COPY_SOURCES = """\
WORKDIR /opt/lmforge
COPY pyproject.toml README.md Makefile ./
COPY lmforge_cli.py ./
COPY compress ./compress
COPY engine ./engine
COPY deploy ./deploy
COPY bench ./bench
"""

DOCKERFILE_GPU = (
    """\
# lmforge on Triton Inference Server 2.51 (NGC 24.10), GPU.
# Build from the repository root:  docker build -f deploy/docker/Dockerfile -t {image} .
# The container's Python is 3.10 and lmforge needs 3.11, so Python 3.11 gets its own venv and the
# Python backend uses the 3.11 stub that nvidia-pytriton (a lmforge dependency) ships for 2.51
# (linked, not copied, so its $ORIGIN-relative library path still finds nvidia_pytriton.libs).
FROM {triton_image}

ARG MODEL_REPOSITORY=model_repository
ENV DEBIAN_FRONTEND=noninteractive \\
    PIP_NO_CACHE_DIR=1 \\
    VIRTUAL_ENV=/opt/lmforge/venv \\
    PATH=/opt/lmforge/venv/bin:$PATH

RUN apt-get update \\
 && apt-get install -y --no-install-recommends software-properties-common curl \\
 && add-apt-repository -y ppa:deadsnakes/ppa \\
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev \\
 && rm -rf /var/lib/apt/lists/* \\
 && python3.11 -m venv $VIRTUAL_ENV

"""
    + _COPY_SOURCES
    + """\
RUN pip install --upgrade pip && pip install . \\
 && STUB=$(python -c "import pytriton, pathlib; print(pathlib.Path(pytriton.__file__).parent / 'tritonserver/python_backend_stubs/3.11/triton_python_backend_stub')") \\
 && ln -sf "$STUB" /opt/tritonserver/backends/python/triton_python_backend_stub

# Baked-in model repository (export first: lmforge export --repo model_repository --copy-weights);
# mount one over /models instead to serve another.
COPY ${{MODEL_REPOSITORY}} /models

EXPOSE {http_port} {grpc_port}
HEALTHCHECK --interval=10s --timeout=5s --start-period={startup_timeout_s}s --retries=3 \\
    CMD curl -fsS http://127.0.0.1:{http_port}/v2/models/{model_name}/ready || exit 1
ENTRYPOINT ["tritonserver"]
CMD ["--model-repository=/models", "--model-control-mode=explicit", "--load-model={model_name}", "--allow-metrics=true"]
"""  # noqa: E501
)

#: Build-context exclusions BuildKit reads next to each Dockerfile (the context is the repository root).
DOCKERIGNORE = """\
.git
.venv
**/__pycache__
**/*.pyc
.pytest_cache
build
"""

DOCKERFILE_CPU = (
    """\
# lmforge on Triton Inference Server 2.51, CPU only: the tritonserver that nvidia-pytriton ships
# (the same build the lmforge tests run) with the CPU build of PyTorch, run as a non-root user.
# The model repository is a volume: export one with `lmforge export --repo DIR --copy-weights`
# and mount DIR at /models.
# Build from the repository root:  docker build -f deploy/docker/Dockerfile.cpu -t {image_cpu} .
# Build arguments (the defaults are the public sources):
#   BASE_IMAGE        Debian bookworm with Python 3.11: python3, its venv module, libpython3.11.so
#   PIP_INDEX_URL     the package index of every dependency but torch
#   TORCH_INDEX_URL   where torch=={torch_version} comes from: PyTorch's CPU index (PyPI's torch is a
#                     CUDA build that pulls gigabytes of nvidia-* wheels; the build refuses one)
#   TORCH_FIND_LINKS  a directory of wheels pip looks in as well (e.g. mounted with `podman build -v`)
#   PIP_CERT          a CA bundle pip trusts instead of its own (behind a TLS-inspecting proxy)
#   EXTRAS            pyproject extras installed: serve (Triton, OpenAI frontend), bench (Locust)
#   SKIP_DEPENDENCIES pyproject dependencies left out: the Triton compiler (CUDA kernels only)
#   CPU_KERNELS       1: g++ and the engine's C++ CPU kernels in the image; 0: neither
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${{BASE_IMAGE}} AS build
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_FIND_LINKS=
ARG PIP_CERT
ARG EXTRAS="{extras}"
ARG SKIP_DEPENDENCIES="{skipped}"
ENV PIP_NO_CACHE_DIR=1 \\
    PIP_DISABLE_PIP_VERSION_CHECK=1 \\
    VIRTUAL_ENV=/opt/lmforge/venv \\
    PATH=/opt/lmforge/venv/bin:$PATH
WORKDIR /opt/lmforge
RUN python3 -m venv $VIRTUAL_ENV
# Dependencies first (from pyproject.toml alone: its dependencies and EXTRAS, less SKIP_DEPENDENCIES),
# so a source change rebuilds only the layers below.
COPY pyproject.toml ./
RUN pip install --index-url "$TORCH_INDEX_URL" ${{TORCH_FIND_LINKS:+--find-links "$TORCH_FIND_LINKS"}} torch=={torch_version} \\
 && python -c "import sys, torch; sys.exit(torch.version.cuda and f'torch {{torch.__version__}} is a CUDA build; set TORCH_INDEX_URL to a CPU index')" \\
 && python -c "import os, re, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; skip = set(os.environ['SKIP_DEPENDENCIES'].split()); deps = p['dependencies'] + [d for e in os.environ['EXTRAS'].split() for d in p['optional-dependencies'][e]]; print('\\\\n'.join(d for d in deps if re.match(r'[A-Za-z0-9._-]+', d).group().lower().replace('_', '-') not in skip))" > /tmp/requirements.txt \\
 && pip install -r /tmp/requirements.txt
"""  # noqa: E501
    + _COPY_SOURCES
    + """\
RUN pip install --no-deps . \\
 && TRITON=$VIRTUAL_ENV/lib/python3.11/site-packages/pytriton/tritonserver \\
 && cp $TRITON/python_backend_stubs/3.11/triton_python_backend_stub $TRITON/backends/python/ \\
 && rm -rf build *.egg-info

FROM ${{BASE_IMAGE}}
ARG CPU_KERNELS=1
ENV VIRTUAL_ENV=/opt/lmforge/venv \\
    PATH=/opt/lmforge/venv/bin:$PATH \\
    LD_LIBRARY_PATH=/opt/lmforge/venv/lib/python3.11/site-packages/nvidia_pytriton.libs \\
    HOME=/home/lmforge
RUN apt-get update \\
 && apt-get install -y --no-install-recommends curl libgomp1 $([ "$CPU_KERNELS" = 1 ] && echo g++) \\
 && rm -rf /var/lib/apt/lists/* \\
 && groupadd --gid {uid} lmforge \\
 && useradd --uid {uid} --gid {uid} --create-home --shell /usr/sbin/nologin lmforge \\
 && ln -s $VIRTUAL_ENV/lib/python3.11/site-packages/pytriton/tritonserver/bin/tritonserver /usr/local/bin/tritonserver
COPY --from=build /opt/lmforge /opt/lmforge
USER {uid}:{uid}
WORKDIR /home/lmforge
# The engine's C++ CPU kernels, built now for this CPU into ~/.cache/torch_extensions; a node with
# another CPU builds its own on the first model load (g++ stays in the image for that).
# CPU_KERNELS=0: no compiler in the image; the engine runs its torch ops instead (slower decode).
RUN if [ "$CPU_KERNELS" = 1 ]; then python -c "{kernels}"; fi
VOLUME ["/models"]

EXPOSE {http_port} {grpc_port}
HEALTHCHECK --interval=10s --timeout=5s --start-period={startup_timeout_s}s --retries=3 \\
    CMD curl -fsS http://127.0.0.1:{http_port}/v2/models/{model_name}/ready || exit 1
ENTRYPOINT ["tritonserver", "--backend-directory=/opt/lmforge/venv/lib/python3.11/site-packages/pytriton/tritonserver/backends"]
CMD ["--model-repository=/models", "--model-control-mode=explicit", "--load-model={model_name}", "--allow-metrics=true", "--allow-gpu-metrics=false"]
"""  # noqa: E501
)


def cpu_image(image: str) -> str:
    """The CPU image tag next to ``image``: ``lmforge-triton:0.1.0`` -> ``lmforge-triton:0.1.0-cpu``."""
    return f"{image}-cpu" if ":" in image.rsplit("/", 1)[-1] else f"{image}:cpu"


def _triton_service(v: DeployValues, profile: str) -> dict[str, Any]:
    gpu = profile == "gpu"
    service: dict[str, Any] = {
        "profiles": [profile],
        "build": {"context": "../..", "dockerfile": "deploy/docker/Dockerfile" + ("" if gpu else ".cpu")},
        "image": v.image if gpu else cpu_image(v.image),
        "command": triton_args(
            dataclasses.replace(v, model_repository="pvc", gpus=v.gpus if gpu else 0),
            f"${{{API_KEY_ENV}:?set {API_KEY_ENV} (api_key_secret is set)}}",
        ),
        "shm_size": v.shm_size.replace("Gi", "gb"),
        # the client ports only: Prometheus reaches the metrics port on the compose network
        "ports": [f"127.0.0.1:{TRITON_PORTS[n]}:{TRITON_PORTS[n]}" for n in CLIENT_PORTS],
        "volumes": ["${MODEL_REPOSITORY:-../../model_repository}:/models:ro"],
        "networks": {"default": {"aliases": ["triton"]}},
        "healthcheck": {
            "test": ["CMD", "curl", "-fsS", f"http://127.0.0.1:8000{model_ready_path(v.model_name)}"],
            "interval": "10s",
            "timeout": "5s",
            "retries": 3,
            "start_period": f"{v.startup_timeout_s}s",
        },
    }
    if gpu:
        service["deploy"] = {
            "resources": {
                "reservations": {"devices": [{"driver": "nvidia", "count": max(v.gpus, 1), "capabilities": ["gpu"]}]}
            }
        }
    return service


def compose(v: DeployValues) -> dict[str, Any]:
    """compose.yaml: Triton (profiles ``gpu`` / ``cpu``), Prometheus, Locust master + workers."""
    locust_image = v.locust_image
    return {
        "name": "lmforge",
        "services": {
            "triton-gpu": _triton_service(v, "gpu"),
            "triton-cpu": _triton_service(v, "cpu"),
            "prometheus": {
                "image": "prom/prometheus:v2.55.1",
                "command": ["--config.file=/etc/prometheus/prometheus.yml"],
                "volumes": ["./prometheus.yml:/etc/prometheus/prometheus.yml:ro"],
                "ports": ["127.0.0.1:9090:9090"],
            },
            "locust-master": {
                "profiles": ["load"],
                "image": locust_image,
                "entrypoint": ["locust"],
                "command": [
                    "-f",
                    "/opt/lmforge/bench/locustfile.py",
                    "--master",
                    "--headless",
                    f"--users={v.locust_users}",
                    f"--spawn-rate={v.locust_spawn_rate}",
                    f"--run-time={v.locust_run_time}",
                    f"--expect-workers={v.locust_workers}",
                    f"--host=http://triton:{TRITON_PORTS['http']}",
                    f"--model={v.model_name}",
                    *([f"--api-key=${{{API_KEY_ENV}:?set {API_KEY_ENV}}}"] if v.api_key_secret else []),
                    "--csv=/results/locust",
                    "--html=/results/locust.html",
                ],
                "volumes": ["./results:/results"],
                "ports": [f"127.0.0.1:{LOCUST_PORTS['web']}:{LOCUST_PORTS['web']}"],
            },
            "locust-worker": {
                "profiles": ["load"],
                "image": locust_image,
                "entrypoint": ["locust"],
                "command": ["-f", "/opt/lmforge/bench/locustfile.py", "--worker", "--master-host=locust-master"],
                "deploy": {"replicas": v.locust_workers},
                "depends_on": ["locust-master"],
            },
        },
    }


def prometheus_config(v: DeployValues) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": "5s"},
        "scrape_configs": [
            {
                "job_name": "triton",
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [f"triton:{TRITON_PORTS['metrics']}"]}],
            }
        ],
    }


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------

#: Directories of this repository that hold files rendered with these targets and values
#: (regenerate with ``python -m deploy.render``; tests/deploy/test_deploy_render.py keeps them in sync).
COMMITTED: dict[str, tuple[str, dict[str, Any]]] = {
    "deploy/docker": ("docker", {}),
    "deploy/k8s/gpu": ("k8s", {}),
    "deploy/k8s/cpu": ("k8s", {"gpus": 0, "image": "lmforge-triton:0.1.0-cpu", "cpu": "8"}),
}

HEADER = "# Rendered by `lmforge render`; change values there rather than editing this file.\n"


def dump_yaml(documents: list[dict[str, Any]]) -> str:
    """YAML text of ``documents`` (``---`` separated), keys in the order built."""
    return HEADER + "---\n".join(yaml.safe_dump(d, sort_keys=False, default_flow_style=False) for d in documents)


def render_files(target: str, values: DeployValues) -> dict[str, str]:
    """File name -> text for ``target`` (``docker`` or ``k8s``).

    Raises:
        ValueError: unknown target.
    """
    if target == "k8s":
        files = {name: dump_yaml(docs) for name, docs in k8s_documents(values).items()}
        files["kustomization.yaml"] = dump_yaml([kustomization(values, list(files))])
        files["prometheus-adapter-values.yaml"] = dump_yaml([prometheus_adapter_values(values)])
        return files
    if target == "docker":
        fields = {
            "image": values.image,
            "image_cpu": cpu_image(values.image),
            "triton_image": TRITON_IMAGE,
            "model_name": values.model_name,
            "startup_timeout_s": values.startup_timeout_s,
            "torch_version": TORCH_VERSION,
            "skipped": " ".join(IMAGE_SKIPPED_DEPENDENCIES),
            "extras": " ".join(IMAGE_EXTRAS),
            "uid": IMAGE_UID,
            "kernels": IMAGE_KERNEL_BUILD,
            **{f"{name}_port": port for name, port in TRITON_PORTS.items()},
        }
        return {
            "Dockerfile": DOCKERFILE_GPU.format(**fields),
            "Dockerfile.cpu": DOCKERFILE_CPU.format(**fields),
            "compose.yaml": dump_yaml([compose(values)]),
            "prometheus.yml": dump_yaml([prometheus_config(values)]),
            "Dockerfile.dockerignore": DOCKERIGNORE,
            "Dockerfile.cpu.dockerignore": DOCKERIGNORE,
        }
    raise ValueError(f"target={target!r}: use one of {TARGETS}")


def render_deploy(
    target: str, out_dir: str | Path, *, values: DeployValues | None = None, **overrides: Any
) -> list[Path]:
    """Write the ``target`` files into ``out_dir`` and return their paths.

    Args:
        target: ``docker`` (Dockerfiles, compose.yaml, prometheus.yml) or ``k8s`` (manifests,
            kustomization.yaml, prometheus-adapter Helm values).
        out_dir: created if missing; new, empty or an earlier ``lmforge render`` output (its
            files of the same name are replaced, others kept).
        values: a ``DeployValues``; ``overrides`` (its field names: ``model_name``, ``image``,
            ``replicas``, ``gpus``, ``cpu``, ``memory``, ...) replace fields of it.

    Raises:
        ValueError: unknown target or field, or an invalid value (names the field).
        OutputDirError: ``out_dir`` holds files that are not ours (``engine.checkpoint.outputs``).
    """
    unknown = set(overrides) - {f.name for f in dataclasses.fields(DeployValues)}
    if unknown:
        raise ValueError(
            f"unknown deploy values {sorted(unknown)}; known: {[f.name for f in dataclasses.fields(DeployValues)]}"
        )
    values = dataclasses.replace(values or DeployValues(), **overrides)
    files = render_files(target, values)
    out = check_output_dir(out_dir, kind=RENDERED)  # files of the same name are replaced: ours only
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        (out / name).write_text(text)
        written.append(out / name)
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", choices=TARGETS, required=True, help="docker: image + compose; k8s: manifests")
    parser.add_argument("--out", required=True, help="directory to write the files into")
    parser.add_argument("--values", help="YAML file of DeployValues fields (flags override it)")
    for f in dataclasses.fields(DeployValues):
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=type(f.default),
            default=None,
            help=f"default {f.default!r}",
        )


def run(args: argparse.Namespace) -> int:
    base: dict[str, Any] = {}
    if args.values:
        try:
            base = yaml.safe_load(Path(args.values).read_text(encoding="utf-8")) or {}
        except (UnicodeDecodeError, yaml.YAMLError) as error:
            raise UsageError(f"--values {args.values}: not a UTF-8 YAML file ({error})") from error
        if not isinstance(base, dict):
            raise UsageError(f"--values {args.values}: expected a mapping of DeployValues fields")
    try:
        flags = {
            f.name: getattr(args, f.name) for f in dataclasses.fields(DeployValues) if getattr(args, f.name) is not None
        }
        paths = render_deploy(args.target, args.out, **{**base, **flags})
    except ValueError as error:  # a value the manifests cannot hold
        raise error if isinstance(error, LmforgeError) else UsageError(str(error)) from error
    for path in paths:
        print(path)
    return 0


def render_committed(root: str | Path = ".") -> list[Path]:
    """Re-render every directory in ``COMMITTED`` under the repository ``root``."""
    return [
        path
        for rel, (target, values) in COMMITTED.items()
        for path in render_deploy(target, Path(root) / rel, **values)
    ]


if __name__ == "__main__":
    for written in render_committed():
        print(written)
