"""``DeployValues``: everything the rendered files vary on, checked field by field, and the images'
fixed facts (Triton image, torch pin, ports, metric names)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from deploy.triton import DEFAULT_PORTS

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
#: What both images copy from the source tree and install: the files ``pip install .`` reads and
#: the project's packages (those pyproject's ``packages.find`` includes), each into its own directory.
IMAGE_SOURCE_FILES = ("pyproject.toml README.md Makefile", "lmforge_cli.py")
IMAGE_PACKAGES = ("compress", "engine", "deploy", "bench")
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
