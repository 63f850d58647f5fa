"""The tritonserver both targets run: its flags, the model's readiness path and the client ports."""

from __future__ import annotations

from deploy.render.values import TRITON_PORTS, DeployValues
from deploy.triton import API_KEY_HEADER, RESTRICTED_APIS

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


def model_ready_path(model_name: str) -> str:
    """Triton's per-model readiness endpoint, the one probes and health checks poll."""
    return f"/v2/models/{model_name}/ready"


#: The Triton ports a client needs (the Service's); ``metrics`` is only Prometheus' (its own Service).
CLIENT_PORTS = ("http", "grpc")
