"""Docker target: the GPU and CPU Dockerfiles, their ignore file, compose.yaml and prometheus.yml."""

from __future__ import annotations

import dataclasses
from typing import Any

from deploy.render.server import API_KEY_ENV, CLIENT_PORTS, model_ready_path, triton_args
from deploy.render.values import IMAGE_PACKAGES, IMAGE_SOURCE_FILES, LOCUST_PORTS, TRITON_PORTS, DeployValues

#: The source tree both images install (the build context is the repository root).
_COPY_SOURCES = (
    "WORKDIR /opt/lmforge\n"
    + "".join(f"COPY {files} ./\n" for files in IMAGE_SOURCE_FILES)
    + "".join(f"COPY {package} ./{package}\n" for package in IMAGE_PACKAGES)
)

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
