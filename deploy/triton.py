"""Run the real Triton Inference Server that ships in ``nvidia-pytriton`` on a model repository.

``nvidia-pytriton`` 0.7.0 bundles ``tritonserver`` 2.51 with only the Python backend. It runs on
a CPU-only machine given

* a backend directory holding ``python/`` = ``libtriton_python.so``,
  ``triton_python_backend_utils.py`` and the ``triton_python_backend_stub`` built for this
  Python version (``python_backend_stubs/3.X``), built once under the lmforge cache;
* ``LD_LIBRARY_PATH`` pointing at the wheel's ``nvidia_pytriton.libs``;
* this interpreter's ``bin`` first on ``PATH``, so the stub process imports from this
  virtual environment, and this lmforge source tree on ``PYTHONPATH``, so a model's thin
  ``model.py`` imports the serving code of the lmforge that started the server.

``TritonServer`` is a context manager used by ``lmforge serve``, the tests and the demo:

    with TritonServer("model_repository", http_port=18000, grpc_port=18001, metrics_port=18002) as server:
        requests.post(server.http_url + "/v2/models/smollm2/generate", ...)

It starts the server on 127.0.0.1 with ``--model-control-mode=explicit`` and the chosen models,
waits for readiness under a deadline, writes the server log to a file, and stops it with SIGINT
then SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import http.client
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from deploy.model_config import ConfigCheckError, parse_config_file
from engine.checkpoint.outputs import cache_dir
from engine.errors import LmforgeError, UsageError

HOST = "127.0.0.1"
DEFAULT_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
PID_FILE_NAME = "tritonserver.pid"
LOG_FILE_NAME = "tritonserver.log"

#: Backends compiled into the bundled server; models needing another one run only in the
#: full Triton container (``nvcr.io/nvidia/tritonserver``).
BUNDLED_BACKENDS = ("python",)


class TritonError(LmforgeError, RuntimeError):
    """The server could not be found, started or stopped; the message says what to do."""


class PortsBusyError(TritonError):
    """A port the server needs is already taken by another process."""


class ModelLoadError(TritonError):
    """One or more models failed to load; ``reasons`` maps model name -> Triton's reason."""

    def __init__(self, reasons: dict[str, str], log_path: Path) -> None:
        self.reasons = reasons
        lines = "\n".join(f"  {name}: {reason}" for name, reason in sorted(reasons.items()))
        super().__init__(f"model(s) failed to load:\n{lines}\nfull server log: {log_path}")


# --------------------------------------------------------------------------------------------
# Locating the bundled server
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TritonInstallation:
    """Paths of the ``tritonserver`` bundled with ``nvidia-pytriton``."""

    binary: Path  # pytriton/tritonserver/bin/tritonserver
    libs: Path  # site-packages/nvidia_pytriton.libs (LD_LIBRARY_PATH)
    python_backend: Path  # pytriton/tritonserver/backends/python
    stub: Path  # python_backend_stubs/<major.minor>/triton_python_backend_stub


def find_triton() -> TritonInstallation:
    """Locate the bundled ``tritonserver`` and its Python backend files.

    Raises:
        TritonError: ``nvidia-pytriton`` is missing or lacks a file (names it and the fix).
    """
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonError(
            "the Triton server ships in nvidia-pytriton; install it with `pip install nvidia-pytriton==0.7.0`"
        )
    package = Path(list(spec.submodule_search_locations)[0])
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    install = TritonInstallation(
        binary=package / "tritonserver" / "bin" / "tritonserver",
        libs=package.parent / "nvidia_pytriton.libs",
        python_backend=package / "tritonserver" / "backends" / "python",
        stub=package / "tritonserver" / "python_backend_stubs" / version / "triton_python_backend_stub",
    )
    for path in (install.binary, install.libs, install.python_backend / "libtriton_python.so", install.stub):
        if not path.exists():
            raise TritonError(
                f"{path}: missing from nvidia-pytriton (Python {version}); reinstall nvidia-pytriton==0.7.0"
            )
    return install


def backend_directory(install: TritonInstallation) -> Path:
    """A ``--backend-directory`` whose ``python/`` holds the backend library, utils and stub.

    Built once (symbolic links) under the lmforge cache, atomically so concurrent servers can
    share it.
    """
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    digest = hashlib.sha256(str(install.binary).encode()).hexdigest()[:10]
    root = cache_dir() / "triton_backends" / f"py{version}-{digest}"
    python_dir = root / "python"
    if (python_dir / "triton_python_backend_stub").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = root.parent / f".{root.name}-{os.getpid()}"
    (staging / "python").mkdir(parents=True, exist_ok=True)
    for file in install.python_backend.iterdir():
        if file.is_file():
            (staging / "python" / file.name).symlink_to(file)
    (staging / "python" / "triton_python_backend_stub").symlink_to(install.stub)
    try:
        os.rename(staging, root)
    except OSError:  # another process built it first
        shutil.rmtree(staging, ignore_errors=True)
    return root


def lmforge_source_root() -> Path:
    """The directory holding this lmforge's packages (``deploy/``, ``engine/``...)."""
    return Path(__file__).resolve().parent.parent


def server_environment(install: TritonInstallation) -> dict[str, str]:
    """Environment for ``tritonserver``: bundled libraries, this venv first, this lmforge importable."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(install.libs), env.get("LD_LIBRARY_PATH")]))
    env["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.executable).parent), env.get("PATH")]))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(lmforge_source_root()), env.get("PYTHONPATH")]))
    return env


# --------------------------------------------------------------------------------------------
# Repository inspection
# --------------------------------------------------------------------------------------------


def repository_models(repo: Path) -> dict[str, Any]:
    """Parse every ``*/config.pbtxt`` under ``repo``: model name -> ``ModelConfig`` proto.

    Raises:
        TritonError: a config does not parse (names the file and the error).
    """
    configs = {}
    for path in sorted(repo.glob("*/config.pbtxt")):
        try:
            configs[path.parent.name] = parse_config_file(path)
        except ConfigCheckError as exc:
            raise TritonError(str(exc)) from exc
    return configs


#: The serving modules a ``model.py`` written by ``lmforge export`` imports -> the file of its version directory
#: that only an export writes (the weights' description; a committed ``config.pbtxt`` + ``model.py`` lack it) and
#: the command that writes it (``{name}``: the model's export name).
EXPORTED_MARKERS = {
    "deploy.triton_llm": ("model.json", "lmforge export --model CHECKPOINT --name {name}"),
    "deploy.triton_encoder": ("encoder.json", "lmforge export --kind encoder --model CHECKPOINT --name {name}"),
}


def unexported_reason(repo: Path, name: str) -> str | None:
    """Why model ``name`` of ``repo`` cannot load yet: its ``model.py`` comes from ``lmforge export`` but the
    weights were never exported (``"not exported yet (run `lmforge export ...`)"``); None otherwise."""
    try:
        model_py = (Path(repo) / name / "1" / "model.py").read_text(errors="replace")
    except OSError:
        return None
    for module, (marker, command) in EXPORTED_MARKERS.items():
        if f"from {module} import" in model_py and not (Path(repo) / name / "1" / marker).is_file():
            export_name = name.removesuffix("_tokenizer") if "TokenizerModel" in model_py else name
            return f"not exported yet (run `{command.format(name=export_name)}`)"
    return None


def servable_models(repo: Path, backends: tuple[str, ...] = BUNDLED_BACKENDS) -> tuple[list[str], dict[str, str]]:
    """Split the repository's models into those this server can load and those it cannot.

    Returns:
        ``(loadable, skipped)``: names to load, and name -> why it is skipped (a backend this
        server lacks, weights never exported (``unexported_reason``), or an ensemble step that is skipped).
    """
    configs = repository_models(repo)
    skipped: dict[str, str] = {}
    for name, config in configs.items():
        unexported = unexported_reason(repo, name)
        if unexported:
            skipped[name] = unexported
        elif config.platform != "ensemble" and config.backend not in backends:
            skipped[name] = (
                f"backend {config.backend or config.platform!r} is not in this server (only "
                f"{', '.join(backends)}); serve it in the full Triton container"
            )
    changed = True
    while changed:  # ensembles whose steps are skipped are skipped too
        changed = False
        for name, config in configs.items():
            if name in skipped or config.platform != "ensemble":
                continue
            missing = [
                s.model_name
                for s in config.ensemble_scheduling.step
                if s.model_name in skipped or s.model_name not in configs
            ]
            if missing:
                skipped[name] = f"ensemble step(s) {', '.join(missing)} cannot be served here"
                changed = True
    return [n for n in configs if n not in skipped], skipped


# --------------------------------------------------------------------------------------------
# Ports
# --------------------------------------------------------------------------------------------


def port_is_free(port: int, host: str = HOST) -> bool:
    """True when nothing listens on ``host:port`` (a bind test; TIME_WAIT sockets don't count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(count: int = 3, host: str = HOST) -> list[int]:
    """``count`` distinct ports the kernel reports free right now (for tests and benchmarks)."""
    sockets, ports = [], []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
            ports.append(sock.getsockname()[1])
    finally:
        for sock in sockets:
            sock.close()
    return ports


def check_ports(ports: dict[str, int], host: str = HOST) -> None:
    """Raise ``PortsBusyError`` naming every busy port and the flag that changes it.

    Raises:
        UsageError: a port outside 1-65535 (its ``--KIND-port`` flag named).
        PortsBusyError: a port already in use.
    """
    for kind, port in ports.items():
        if not 1 <= port <= 65535:
            raise UsageError(f"--{kind}-port {port}: not a TCP port", fix="use a port in 1-65535")
    busy = {kind: port for kind, port in ports.items() if not port_is_free(port, host)}
    if busy:
        listing = ", ".join(f"{kind} {host}:{port}" for kind, port in busy.items())
        flags = " ".join(f"--{kind}-port N" for kind in busy)
        raise PortsBusyError(
            f"port(s) already in use: {listing}. Another server (maybe a Triton started with `lmforge serve`; "
            f"stop it with `lmforge serve --repo REPO --stop`) holds them; or choose other ports with {flags}"
        )


# --------------------------------------------------------------------------------------------
# HTTP helpers (standard library, so the server manager needs no client package)
# --------------------------------------------------------------------------------------------


def http_json(
    url: str, *, method: str = "GET", body: Any = None, timeout_s: float = 5.0, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """One HTTP request (``headers`` added, e.g. ``api_key_headers``); returns ``(status, parsed JSON or text or
    None)``.

    Raises:
        OSError: the server is unreachable (connection refused, timeout, or closed mid-answer).
    """
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except http.client.HTTPException as exc:  # e.g. IncompleteRead: the server died while answering
        raise ConnectionError(f"{url}: {exc!r}") from exc
    if not raw:
        return status, None
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


#: Triton APIs ``--api-key`` restricts (its ``--http-restricted-api`` / ``--grpc-restricted-protocol`` names):
#: all but ``health``, which probes and load balancers poll without a key.
RESTRICTED_APIS = (
    "inference",
    "model-repository",
    "model-config",
    "metadata",
    "statistics",
    "trace",
    "logging",
    "shared-memory",
)
#: The header a restricted Triton API checks over HTTP: the OpenAI API's own, so one header opens both.
API_KEY_HEADER = "authorization"
#: The same over gRPC: Triton 2.51 prefixes a restricted protocol's metadata key with ``triton-grpc-protocol-``.
GRPC_API_KEY_HEADER = f"triton-grpc-protocol-{API_KEY_HEADER}"


def api_key_headers(api_key: str | None, grpc: bool = False) -> dict[str, str]:
    """``{"authorization": "Bearer KEY"}`` (HTTP) or ``{"triton-grpc-protocol-authorization": "Bearer KEY"}``
    (gRPC metadata), or ``{}`` without a key."""
    if not api_key:
        return {}
    return {GRPC_API_KEY_HEADER if grpc else API_KEY_HEADER: f"Bearer {api_key}"}


def restricted_api_flags(api_key: str) -> list[str]:
    """tritonserver flags that make ``RESTRICTED_APIS`` answer only requests carrying ``api_key_headers``.

    Raises:
        UsageError: a key Triton's flag syntax cannot carry (``:`` / ``=`` / ``,`` / whitespace / empty).
    """
    if not api_key or any(c in api_key for c in ":=,") or any(c.isspace() for c in api_key):
        raise UsageError(
            "--api-key: empty or holding ':', '=', ',' or whitespace, which Triton's restricted-API flags cannot "
            "carry; use letters, digits, '-', '_', '.'"
        )
    rule = f"{','.join(RESTRICTED_APIS)}:{API_KEY_HEADER}=Bearer {api_key}"
    return [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------


class TritonServer:
    """The bundled ``tritonserver`` on a model repository, as a context manager.

    Args:
        repo: the model repository directory.
        http_port, grpc_port, metrics_port: ports on 127.0.0.1.
        models: names to load (explicit model control); ``None`` loads every model this
            server can serve (``servable_models``), skipping container-only ones.
        log_path: the server log; default ``REPO/tritonserver.log``.
        write_pid_file: write the server's pid to ``REPO/tritonserver.pid`` (for
            ``lmforge serve --stop``; also refuses a second server on the same repository).
        startup_timeout_s: deadline for the server and all models to become ready.
        grace_s: seconds between SIGINT and SIGKILL on stop.
        exit_timeout_s: Triton's own drain time for in-flight requests and open connections.
        log_verbose: Triton's ``--log-verbose`` level.
        api_key: restrict every API but health (``RESTRICTED_APIS``: inference, model control...) on HTTP
            and gRPC to requests with ``Authorization: Bearer KEY`` (gRPC metadata
            ``triton-grpc-protocol-authorization``; ``api_key_headers``); this class sends it.
            Triton takes it on its command line, which local users can read (``ps``).

    Raises (on ``start``):
        PortsBusyError: a port is taken. ModelLoadError: a model failed to load (reasons from
        the repository index). TritonError: the server exited or missed the deadline (the log
        tail is in the message).
    """

    def __init__(
        self,
        repo: str | Path,
        http_port: int = DEFAULT_PORTS["http"],
        grpc_port: int = DEFAULT_PORTS["grpc"],
        metrics_port: int = DEFAULT_PORTS["metrics"],
        *,
        models: list[str] | None = None,
        log_path: str | Path | None = None,
        write_pid_file: bool = True,
        startup_timeout_s: float = 300.0,
        grace_s: float = 15.0,
        exit_timeout_s: int = 10,
        log_verbose: int = 0,
        api_key: str | None = None,
    ) -> None:
        if api_key:
            restricted_api_flags(api_key)  # refuses a key the flags cannot carry, before anything starts
        self.api_key = api_key or None
        self.headers = api_key_headers(self.api_key)  # HTTP
        self.grpc_headers = api_key_headers(self.api_key, grpc=True)
        self.ports = {"http": http_port, "grpc": grpc_port, "metrics": metrics_port}
        for kind, port in self.ports.items():
            if not isinstance(port, int) or not 1 <= port <= 65535:
                raise UsageError(f"--{kind}-port {port}: not a TCP port", fix="use 1-65535 (1024 and up without root)")
        if len(set(self.ports.values())) < 3:
            raise UsageError(f"ports {self.ports}: HTTP, gRPC and metrics need three different ports")
        self.repo = Path(repo).resolve()
        if not self.repo.is_dir():
            what = "is a file, not a model repository" if self.repo.exists() else "model repository not found"
            raise TritonError(f"{self.repo}: {what}; create one with `lmforge export --repo DIR ...` and pass that DIR")
        self.models = models
        self.skipped: dict[str, str] = {}
        self.log_path = Path(log_path) if log_path else self.repo / LOG_FILE_NAME
        self.pid_path = self.repo / PID_FILE_NAME if write_pid_file else None
        self.startup_timeout_s = startup_timeout_s
        self.grace_s = grace_s
        self.exit_timeout_s = exit_timeout_s
        self.log_verbose = log_verbose
        self.process: subprocess.Popen | None = None
        self.shm_prefix: str | None = None  # this process's Python-backend shared memory (set by ``start``)

    # URLs -----------------------------------------------------------------------------------

    @property
    def http_url(self) -> str:
        return f"http://{HOST}:{self.ports['http']}"

    @property
    def grpc_url(self) -> str:
        return f"{HOST}:{self.ports['grpc']}"

    @property
    def metrics_url(self) -> str:
        return f"http://{HOST}:{self.ports['metrics']}/metrics"

    # Lifecycle --------------------------------------------------------------------------------

    def command(self, install: TritonInstallation, models: list[str]) -> list[str]:
        """The ``tritonserver`` command line."""
        cmd = [
            str(install.binary),
            f"--model-repository={self.repo}",
            f"--backend-directory={backend_directory(install)}",
            "--model-control-mode=explicit",
            *[f"--load-model={name}" for name in models],
            "--exit-on-error=false",  # stay up so the repository index can tell why a model failed
            "--strict-readiness=true",
            f"--exit-timeout-secs={self.exit_timeout_s}",  # drain in-flight requests and connections
            f"--http-address={HOST}",
            f"--http-port={self.ports['http']}",
            f"--grpc-address={HOST}",
            f"--grpc-port={self.ports['grpc']}",
            f"--metrics-address={HOST}",
            f"--metrics-port={self.ports['metrics']}",
            "--allow-metrics=true",
            "--allow-gpu-metrics=false",
            "--allow-cpu-metrics=true",
            f"--log-verbose={self.log_verbose}",
            *(restricted_api_flags(self.api_key) if self.api_key else []),
            *([f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}"] if self.shm_prefix else []),
        ]
        return cmd

    def start(self) -> "TritonServer":
        """Start the server and block until every requested model is ready (see class doc)."""
        install = find_triton()
        self._check_not_running()
        check_ports(self.ports)
        if self.models is None:
            self.models, self.skipped = servable_models(self.repo)
        for name in self.models:
            if not (self.repo / name).is_dir():  # refused before Triton starts: one line, no server log to read
                present = sorted(d.name for d in self.repo.iterdir() if (d / "config.pbtxt").is_file())
                raise TritonError(
                    f"--models {name}: no model directory {self.repo / name}; the repository has: "
                    f"{', '.join(present) or 'nothing'}"
                )
            unexported = unexported_reason(self.repo, name)
            if unexported:
                raise TritonError(f"--models {name}: {unexported}")
        if not self.models:
            raise TritonError(
                f"{self.repo}: no model this server can load; export one with `lmforge export --repo {self.repo} ...`"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.shm_prefix = new_shm_prefix()
        log = open(self.log_path, "wb")
        try:
            self.process = subprocess.Popen(
                self.command(install, self.models),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=server_environment(install),
                start_new_session=True,  # its own process group: the stubs are stopped with it
            )
        finally:
            log.close()
        if self.pid_path is not None:
            self.pid_path.write_text(
                json.dumps(
                    {
                        "pid": self.process.pid,
                        "ports": self.ports,
                        "log": str(self.log_path),
                        "shm_prefix": self.shm_prefix,
                    }
                )
                + "\n"
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _check_not_running(self) -> None:
        """Refuse a second server on the same repository (it would share the pid and log files)."""
        if self.pid_path is None or not self.pid_path.is_file():
            return
        pid = _read_pid(self.pid_path)
        if pid is not None and _is_tritonserver(pid):
            raise TritonError(
                f"a tritonserver (pid {pid}) started by lmforge already serves {self.repo}; "
                f"stop it with `lmforge serve --repo {self.repo} --stop`"
            )
        self.pid_path.unlink(missing_ok=True)  # stale

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise TritonError(self._exit_message())
            try:
                status, _ = http_json(self.http_url + "/v2/health/ready", timeout_s=2.0)
            except OSError:  # HTTP starts after the startup models finished loading
                time.sleep(0.25)
                continue
            if status == 200:
                failures = self.load_failures()
                if failures:  # server-ready ignores names Triton never found
                    raise ModelLoadError(failures, self.log_path)
                return
            failures = self.load_failures()
            if failures:
                raise ModelLoadError(failures, self.log_path)
            time.sleep(0.25)
        raise TritonError(
            f"server not ready within {self.startup_timeout_s:.0f} s; see {self.log_path}\n{self.log_tail()}"
        )

    def _exit_message(self) -> str:
        tail = self.log_tail()
        hint = ""
        if "already in use" in tail:
            hint = f" (a port is taken; ports: {self.ports})"
        return f"tritonserver exited with status {self.process.returncode}{hint}; log {self.log_path}:\n{tail}"

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the server log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def repository_index(self) -> list[dict[str, Any]]:
        """``POST /v2/repository/index``: ``[{"name", "version", "state", "reason"}, ...]``."""
        status, index = http_json(self.http_url + "/v2/repository/index", method="POST", body={}, headers=self.headers)
        if status != 200 or not isinstance(index, list):
            raise TritonError(f"repository index failed: HTTP {status} {index}")
        return index

    def load_failures(self) -> dict[str, str]:
        """Requested models that are not ready and not loading, or not in the repository: name -> why."""
        failures = {}
        index = self.repository_index()
        for entry in index:
            if entry.get("name") in (self.models or []) and entry.get("state") not in ("READY", "LOADING"):
                failures[entry["name"]] = entry.get("reason") or f"state {entry.get('state')}"
        known = {entry.get("name") for entry in index}
        for name in self.models or []:
            if name not in known:
                failures[name] = (
                    f"no model directory {self.repo / name}; the repository has: "
                    f"{', '.join(sorted(known)) or 'nothing'}"
                )
        return failures

    def stub_pids(self, name: str) -> list[int]:
        """PIDs of the Python-backend stub processes of model ``name`` (children of this server)."""
        if not self.is_running():
            return []
        marker = f"{self.repo / name}{os.sep}"
        pids = []
        for child in psutil.Process(self.process.pid).children():
            try:
                cmdline = child.cmdline()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if len(cmdline) > 1 and "triton_python_backend_stub" in cmdline[0] and cmdline[1].startswith(marker):
                pids.append(child.pid)
        return pids

    def model_state(self, name: str) -> tuple[str | None, str]:
        """``(state, reason)`` of ``name`` in the repository index (``(None, "")`` if absent)."""
        for entry in self.repository_index():
            if entry.get("name") == name:
                return entry.get("state"), entry.get("reason") or ""
        return None, ""

    def reload(self, name: str, timeout_s: float = 600.0, swap: bool = False) -> None:
        """Load ``name`` again: new stub processes, a new engine.

        Triton 2.51 does nothing on a plain load of a loaded model whose files did not change,
        even when its stub is dead. By default the model is unloaded first (the unload of a model
        whose stub was killed never completes, it stays UNLOADING, but a load issued then brings up
        a fresh model): nothing serves it in between. With ``swap`` its ``config.pbtxt`` is touched
        instead, so the load brings the new version up beside the old one, which keeps serving
        (with several instances its live ones answer) until Triton swaps them.

        Raises:
            TritonError: the unload or the load failed (Triton's reason), or took over ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        if swap:
            os.utime(self.repo / name / "config.pbtxt")  # a newer timestamp: Triton loads the model anew
        elif self.model_state(name)[0] == "READY":
            self._repository_call(name, "unload", deadline, failure=f"unloading {name}")
            while self.model_state(name)[0] == "READY":
                if time.monotonic() > deadline:
                    raise TritonError(f"{name} did not start unloading within {timeout_s:.0f} s; see {self.log_path}")
                time.sleep(0.1)
        self._repository_call(name, "load", deadline, failure=f"loading {name} again")

    def _repository_call(self, name: str, action: str, deadline: float, *, failure: str) -> None:
        """``POST /v2/repository/models/NAME/{load,unload}`` before ``deadline`` (``time.monotonic()``).

        Raises:
            TritonError: Triton answered other than HTTP 200: "``failure`` failed", its reason, the server log.
        """
        status, body = http_json(
            f"{self.http_url}/v2/repository/models/{name}/{action}",
            method="POST",
            body={},
            timeout_s=max(1.0, deadline - time.monotonic()),
            headers=self.headers,
        )
        if status != 200:
            raise TritonError(f"{failure} failed: HTTP {status} {body}; see {self.log_path}")

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> int | None:
        """SIGINT (Triton drains in-flight requests), SIGKILL to the group after ``grace_s``.

        Returns the server's exit status (``None`` if it was never started).
        """
        if self.process is None:
            return None
        if self.process.poll() is None:
            returncode = stop_process(self.process.pid, self.grace_s, wait=self.process.wait)
        else:
            returncode = self.process.returncode
        _kill_group(self.process.pid)  # stubs left behind, if any
        remove_shm_regions(self.shm_prefix)
        if self.pid_path is not None and self.pid_path.is_file():
            try:
                if json.loads(self.pid_path.read_text()).get("pid") == self.process.pid:
                    self.pid_path.unlink()
            except (OSError, json.JSONDecodeError):
                pass
        return returncode

    def wait(self) -> int:
        """Block until the server exits (``lmforge serve`` in the foreground)."""
        return self.process.wait()

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


#: Seconds between two checks of ``ModelSupervisor``: a check is one repository-index request and a scan of the
#: server's child processes (milliseconds), and a killed stub's recovery starts at the next one.
SUPERVISOR_INTERVAL_S = 0.25
#: Default bound of one model (re)load request the supervisor sends: a generous multiple of the ~10 s a small LLM
#: takes on a busy machine, finite so that a server that stops answering cannot hold the supervisor.
SUPERVISOR_LOAD_TIMEOUT_S = 120.0
#: Default seconds without an answer from ``/v2/health/live`` after which a running server counts as hung.
SUPERVISOR_HANG_AFTER_S = 10.0
#: Consecutive unanswered liveness probes needed as well (one slow answer on a busy machine is not a hang), and
#: the fewer needed after the log printed ``TERMINATE_MARKER``.
HANG_MIN_PROBES = 3
HANG_MIN_PROBES_AFTER_TERMINATE = 2
#: What a C++ exception escaping a thread prints before ``abort()``; Triton 2.51 can hang right after it
#: (``boost::interprocess::lock_exception`` when a stub dies mid-request) instead of exiting.
TERMINATE_MARKER = "terminate called"


class LivenessWatch:
    """Counts a server's unanswered liveness probes and says when it counts as hung.

    A server is hung when it has not answered for ``hang_after_s`` over at least ``HANG_MIN_PROBES``
    consecutive probes, or sooner, after ``HANG_MIN_PROBES_AFTER_TERMINATE`` unanswered probes, when its log
    printed ``TERMINATE_MARKER`` since its last answer (or its start: the log is read from the offset it had
    then, so an older line, say of a stub that died and was reloaded, never counts).
    """

    def __init__(self, log_path: Path, hang_after_s: float) -> None:
        self.log_path = log_path
        self.hang_after_s = hang_after_s
        self.failures = 0
        self.last_answer = time.monotonic()
        self.log_offset = 0  # bytes of the log (fresh at each server start) written before the last answer

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def observe(self, answered: bool) -> str | None:
        """Record one probe; returns why the server counts as hung (``"stopped answering for X s..."``) or None."""
        if answered:
            self.failures, self.last_answer, self.log_offset = 0, time.monotonic(), self._log_size()
            return None
        self.failures += 1
        silent_s = time.monotonic() - self.last_answer
        terminate = self._new_terminate_line() if self.failures >= HANG_MIN_PROBES_AFTER_TERMINATE else ""
        if terminate or (self.failures >= HANG_MIN_PROBES and silent_s >= self.hang_after_s):
            return f"stopped answering for {silent_s:.1f} s" + (f" after {terminate!r} in its log" if terminate else "")
        return None

    def _new_terminate_line(self) -> str:
        """The last ``terminate called ...`` line the log gained since the last answer ('' if none); reads at
        most the last 64 KiB of that part."""
        try:
            with open(self.log_path, "rb") as log:
                size = log.seek(0, os.SEEK_END)
                log.seek(max(self.log_offset, size - 65536))
                text = log.read().decode(errors="replace")
        except OSError:
            return ""
        lines = [line.strip() for line in text.splitlines() if TERMINATE_MARKER in line]
        return lines[-1][:200] if lines else ""


class ModelSupervisor:
    """Keeps a started server's models served, on two background threads.

    Triton 2.51 neither restarts a Python-backend stub that died (``kill -9``, out of memory:
    every request then fails with "Stub process ... is not healthy" while the model still reads
    READY) nor reloads a model that unloaded itself (the LLM model does when its engine dies);
    and a stub killed while requests are in flight can take the whole server down with it
    (``boost::interprocess::lock_exception``, signal 6), or leave it hung after "terminate called"
    with no endpoint answering. Every ``interval_s`` this checks each served model (its state in the
    repository index; for Python-backend models, that its stub processes are alive) and reloads a
    broken one, each load bounded by ``load_timeout_s``. A watchdog thread probes ``/v2/health/live``
    as often (``LivenessWatch``) and SIGKILLs the process group of a server it started that stopped
    answering. A server that exited without being asked to (not status 0, no SIGINT/SIGTERM in its
    log), or was killed as hung, is started again on the same ports, at most ``max_restarts`` times,
    its log kept as ``LOG.N``. ``finished`` is set when the server stopped for good; ``exit_status``
    is its last status.

    Args:
        server: a started ``TritonServer``; the only process this ever kills is the one it started.
        interval_s: seconds between checks (and between liveness probes).
        report: called with one line per event (problem found, reloaded, hung, restarted, gave up).
        max_restarts: server restarts allowed (exits and hangs together).
        load_timeout_s: bound of one unload + load of a model (Triton goes on loading past it; the next
            check sees the model LOADING and waits).
        hang_after_s: seconds without a liveness answer after which the server counts as hung.
    """

    def __init__(
        self,
        server: TritonServer,
        interval_s: float = SUPERVISOR_INTERVAL_S,
        report=print,
        max_restarts: int = 5,
        load_timeout_s: float = SUPERVISOR_LOAD_TIMEOUT_S,
        hang_after_s: float = SUPERVISOR_HANG_AFTER_S,
    ) -> None:
        if load_timeout_s <= 0 or hang_after_s <= 0:
            raise UsageError(f"load_timeout_s {load_timeout_s}, hang_after_s {hang_after_s}: both must be > 0")
        self.server = server
        self.interval_s = interval_s
        self.report = report
        self.max_restarts = max_restarts
        self.load_timeout_s = load_timeout_s
        self.hang_after_s = hang_after_s
        self.restarts: list[tuple[str, float]] = []  # (why the server exited or was killed, seconds to serve again)
        self.finished = threading.Event()
        self.exit_status: int | None = None
        configs = repository_models(server.repo)
        self.python_models = [n for n in server.models or [] if n in configs and configs[n].backend == "python"]
        self.stub_counts = {name: len(server.stub_pids(name)) for name in self.python_models}
        self.reloads: list[tuple[str, str, float]] = []  # (model, problem, seconds to serve again)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # the watchdog's kill against the restart's swap of ``server.process``
        self._restarting = False
        self._hung: str | None = None  # why the watchdog killed the server, until the restart reports it

    def problems(self) -> dict[str, str]:
        """Served models that cannot answer: name -> why."""
        problems = {}
        states = {entry.get("name"): entry for entry in self.server.repository_index()}
        for name in self.server.models or []:
            entry = states.get(name, {})
            if entry.get("state") in ("LOADING", "UNLOADING"):  # in transition (a reload in progress)
                continue
            if entry.get("state") != "READY":
                problems[name] = f"state {entry.get('state')} ({entry.get('reason') or 'no reason given'})"
            elif name in self.python_models and entry.get("state") == "READY":
                alive = len(self.server.stub_pids(name))
                if alive < self.stub_counts[name]:
                    problems[name] = (
                        f"{self.stub_counts[name] - alive} of its {self.stub_counts[name]} Python backend stub "
                        "process(es) exited"
                    )
        return problems

    def check_once(self) -> dict[str, float]:
        """Reload every broken model; returns name -> seconds the reload took.

        A model that still has a live stub (one of several instances died) is reloaded beside
        itself (``TritonServer.reload(swap=True)``): its live instances serve until the new
        version is up. A model with no live stub, or not READY, is unloaded and loaded.
        """
        took = {}
        problems = self.problems()
        if problems and _asked_to_stop(self.server.log_tail(200)):  # unloading for `serve --stop`: not broken
            return took
        for name, problem in problems.items():
            alive = len(self.server.stub_pids(name)) if name in self.python_models else 0
            swap = alive > 0 and self.server.model_state(name)[0] == "READY"
            self.report(f"model {name}: {problem}; loading it again{' beside its live instances' if swap else ''}")
            start = time.monotonic()
            try:
                self.server.reload(name, timeout_s=self.load_timeout_s, swap=swap)
            except (TritonError, OSError) as exc:
                self.report(f"model {name}: {exc}")
                continue
            took[name] = time.monotonic() - start
            self.reloads.append((name, problem, took[name]))
            self.report(f"model {name}: served again after {took[name]:.1f} s")
        return took

    def start(self) -> "ModelSupervisor":
        for target, name in ((self._run, "lmforge-model-supervisor"), (self._watch, "lmforge-server-watchdog")):
            self._threads.append(threading.Thread(target=target, name=name, daemon=True))
            self._threads[-1].start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                if not self.server.is_running():
                    if self._stop.is_set() or not self._restart_server():
                        return
                    continue
                try:
                    self.check_once()
                except (TritonError, OSError) as exc:  # the server is stopping or busy: try again later
                    stopping = self._stop.is_set() or _asked_to_stop(self.server.log_tail(200))  # `serve --stop`
                    if self.server.is_running() and not stopping:
                        self.report(f"model check failed: {exc}")
        finally:
            if self.server.process is not None:
                self.exit_status = self.server.process.poll()
            self.finished.set()

    def _watch(self) -> None:
        """Watchdog thread: probe liveness every ``interval_s``; kill the server once ``LivenessWatch`` says hung."""
        process, watch = None, None
        probe_timeout_s = min(2.0, max(0.2, self.hang_after_s / HANG_MIN_PROBES))
        while not self._stop.wait(self.interval_s) and not self.finished.is_set():
            current = self.server.process
            if self._restarting or current is None or current.poll() is not None:
                process = None  # exited (the restart path takes it from here) or starting again
                continue
            if current is not process:  # a new server: watch it afresh
                process, watch = current, LivenessWatch(self.server.log_path, self.hang_after_s)
            try:
                http_json(self.server.http_url + "/v2/health/live", timeout_s=probe_timeout_s)
                answered = True  # any HTTP answer: the server is not hung
            except OSError:
                answered = False
            why = watch.observe(answered)
            if why is not None:
                self._kill_hung(process, why)

    def _kill_hung(self, process: subprocess.Popen, why: str) -> None:
        """SIGKILL the process group of ``process`` (this supervisor's server, still unreaped, so its pid is
        not reused); the supervisor thread then finds it exited and goes through ``_restart_server``."""
        with self._lock:
            if self._restarting or process is not self.server.process or process.poll() is not None:
                return
            if _asked_to_stop(self.server.log_tail(200)):  # shutting down: whoever stops it enforces its grace
                return
            self._hung = why
            self.report(f"tritonserver (pid {process.pid}) {why}; killing it")
            try:
                own_group = os.getpgid(process.pid) == process.pid  # ``start_new_session``: its stubs go too
            except ProcessLookupError:
                return
            if own_group:
                _kill_group(process.pid)
            else:
                process.kill()

    def _restart_server(self) -> bool:
        """Start a server that exited unasked (or was killed as hung) again; False when it was asked to stop or
        restarts ran out."""
        status = self.server.process.returncode
        tail = self.server.log_tail(200)
        hung, self._hung = self._hung, None
        if status == 0 or _asked_to_stop(tail):
            return False
        reasons = [line.strip() for line in tail.splitlines() if "what():" in line or "Signal (" in line]
        why = hung or f"exited (status {status}" + (f": {reasons[-1][:200]})" if reasons else ")")
        if len(self.restarts) >= self.max_restarts:
            self.report(
                f"tritonserver {why}; not restarting after {self.max_restarts} restarts; log {self.server.log_path}"
            )
            return False
        _kill_group(self.server.process.pid)  # its stubs, if any survived it
        remove_shm_regions(self.server.shm_prefix)
        kept = self.server.log_path.with_name(f"{self.server.log_path.name}.{len(self.restarts) + 1}")
        self.server.log_path.replace(kept)
        self.report(f"tritonserver {why}; log kept as {kept}; restarting it")
        start = time.monotonic()
        with self._lock:
            self._restarting = True
        try:
            self.server.start()
        except TritonError as exc:
            self.report(f"restarting tritonserver failed: {exc}")
            return False
        finally:
            self._restarting = False
        self.stub_counts = {name: len(self.server.stub_pids(name)) for name in self.python_models}
        self.restarts.append((why, time.monotonic() - start))
        self.report(f"tritonserver serves again after {self.restarts[-1][1]:.1f} s")
        return True


def _asked_to_stop(log_tail: str) -> bool:
    """True when a server log shows the SIGINT or SIGTERM that asks Triton to stop."""
    return "Signal (2) received" in log_tail or "Signal (15) received" in log_tail


#: Where POSIX shared memory (``shm_open``) lives on Linux.
SHM_DIR = Path("/dev/shm")
_SHM_PREFIX_RE = re.compile(r"lmforge_triton_[0-9a-f]{12}_")


def new_shm_prefix() -> str:
    """A fresh name prefix for one server process's Python-backend shared memory regions.

    Triton's Python backend names each stub's region ``PREFIX<uuid>`` in ``/dev/shm``
    (``--backend-config=python,shm-region-prefix-name``) and leaves it there when the server or a stub
    is killed; a prefix of our own lets ``remove_shm_regions`` delete exactly this process's regions, so
    that killed servers do not fill a small ``/dev/shm`` (64 MiB in a default container), where every
    later model load fails ("Unable to initialize shared memory key ... No space left on device").
    """
    return f"lmforge_triton_{secrets.token_hex(6)}_"


def remove_shm_regions(prefix: str | None) -> int:
    """Delete the ``/dev/shm`` regions named ``prefix*`` (a prefix from ``new_shm_prefix`` only; anything
    else is left alone). Call it once the server's process group is gone. Returns how many were removed."""
    if not prefix or not _SHM_PREFIX_RE.fullmatch(prefix) or not SHM_DIR.is_dir():
        return 0
    removed = 0
    for region in SHM_DIR.glob(prefix + "*"):
        with contextlib.suppress(OSError):
            region.unlink()
            removed += 1
    return removed


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_process(pid: int, grace_s: float, *, wait=None) -> int | None:
    """Send SIGINT to ``pid``; after ``grace_s`` without exit, SIGKILL its process group.

    Args:
        wait: ``Popen.wait`` when we are the parent (reaps and returns the status); otherwise the
            pid is polled until it disappears.

    Returns:
        The exit status when known (we are the parent), else ``None``.
    """
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        return None
    if wait is not None:
        try:
            return wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _kill_group(pid)
            return wait(timeout=10)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            return None
        time.sleep(0.1)
    _kill_group(pid)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists() and ") Z " in stat.read_text():  # a zombie has exited
        return False
    return True


def stop_from_pid_file(repo: str | Path, grace_s: float = 15.0) -> int:
    """Stop the server ``lmforge serve`` started on ``repo`` (its pid file); returns the pid.

    Raises:
        TritonError: no pid file, or its process is not a ``tritonserver`` (stale file removed).
    """
    pid_path = Path(repo).resolve() / PID_FILE_NAME
    if not pid_path.is_file():
        raise TritonError(f"{pid_path}: no pid file; no server started by `lmforge serve --repo {repo}` is running")
    pid = _read_pid(pid_path)
    if pid is None:
        pid_path.unlink(missing_ok=True)
        raise TritonError(f"{pid_path}: corrupt pid file (removed); stop the server by its pid")
    if not _is_tritonserver(pid):
        pid_path.unlink(missing_ok=True)
        raise TritonError(f"{pid_path}: process {pid} is not a running tritonserver (stale pid file removed)")
    try:
        shm_prefix = json.loads(pid_path.read_text()).get("shm_prefix")
    except (OSError, ValueError, AttributeError):
        shm_prefix = None
    stop_process(pid, grace_s)
    remove_shm_regions(shm_prefix)
    pid_path.unlink(missing_ok=True)
    return pid


def _read_pid(pid_path: Path) -> int | None:
    """The pid in an lmforge pid file, ``None`` when the file is unreadable or corrupt."""
    try:
        return int(json.loads(pid_path.read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _is_tritonserver(pid: int) -> bool:
    cmdline = Path(f"/proc/{pid}/cmdline")
    try:
        return _pid_alive(pid) and b"tritonserver" in cmdline.read_bytes()
    except OSError:
        return False
