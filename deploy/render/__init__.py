"""``lmforge render``: container and Kubernetes files for serving a model on Triton at scale.

    lmforge render --target docker --out build/docker --model-name smollm2_135m
    lmforge render --target k8s --out build/k8s --model-name smollm2_135m --image REGISTRY/lmforge-triton:0.1.0 \\
        --replicas 2 --max-replicas 8 --gpus 1 --model-repository s3://bucket/model_repository

The files are built from ``DeployValues`` (every field documented below) so users never hand-edit
YAML; ``deploy/docker/`` and ``deploy/k8s/{gpu,cpu}/`` in the repository are these files rendered
with the defaults (a test keeps them in sync). ``render_deploy`` is the function
``lmforge export --target docker|k8s`` calls.
Modules: ``values`` (``DeployValues`` and the images' fixed facts), ``server`` (the tritonserver
flags both targets run), ``k8s`` and ``docker`` (each target's objects and files); this one renders
and writes them.

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
from pathlib import Path
from typing import Any

import yaml

from deploy.render.docker import DOCKERFILE_CPU, DOCKERFILE_GPU, DOCKERIGNORE, compose, cpu_image, prometheus_config
from deploy.render.k8s import (
    adapter_query,
    horizontal_pod_autoscaler,
    k8s_documents,
    kustomization,
    locust_master,
    locust_workers,
    metrics_service,
    model_repository_pvc,
    monitor,
    prometheus_adapter_values,
    triton_deployment,
    triton_service,
)
from deploy.render.server import API_KEY_ENV, CLIENT_PORTS, model_ready_path, triton_args
from deploy.render.values import (
    HPA_METRIC,
    IMAGE_EXTRAS,
    IMAGE_KERNEL_BUILD,
    IMAGE_PACKAGES,
    IMAGE_SKIPPED_DEPENDENCIES,
    IMAGE_SOURCE_FILES,
    IMAGE_UID,
    LOCUST_PORTS,
    QUEUE_METRIC,
    SUCCESS_METRIC,
    TARGETS,
    TORCH_VERSION,
    TRITON_IMAGE,
    TRITON_PORTS,
    DeployValues,
)
from engine.checkpoint.outputs import RENDERED, check_output_dir
from engine.errors import LmforgeError, UsageError

__all__ = [
    "API_KEY_ENV",
    "CLIENT_PORTS",
    "COMMITTED",
    "DOCKERFILE_CPU",
    "DOCKERFILE_GPU",
    "DOCKERIGNORE",
    "HEADER",
    "HPA_METRIC",
    "IMAGE_EXTRAS",
    "IMAGE_KERNEL_BUILD",
    "IMAGE_PACKAGES",
    "IMAGE_SKIPPED_DEPENDENCIES",
    "IMAGE_SOURCE_FILES",
    "IMAGE_UID",
    "LOCUST_PORTS",
    "QUEUE_METRIC",
    "SUCCESS_METRIC",
    "TARGETS",
    "TORCH_VERSION",
    "TRITON_IMAGE",
    "TRITON_PORTS",
    "DeployValues",
    "adapter_query",
    "add_arguments",
    "compose",
    "cpu_image",
    "dump_yaml",
    "horizontal_pod_autoscaler",
    "k8s_documents",
    "kustomization",
    "locust_master",
    "locust_workers",
    "metrics_service",
    "model_ready_path",
    "model_repository_pvc",
    "monitor",
    "prometheus_adapter_values",
    "prometheus_config",
    "render_committed",
    "render_deploy",
    "render_files",
    "run",
    "triton_args",
    "triton_deployment",
    "triton_service",
]

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
