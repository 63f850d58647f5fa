"""Build and run the lmforge CPU image with podman, on a machine with no image registry.

``make image`` (``lmforge deploy image``) builds ``deploy/docker/Dockerfile.cpu`` locally:

* the tools: ``podman``, ``runc`` and ``debootstrap`` from apt when missing, and
  ``/etc/containers/containers.conf`` holding ``default_ulimits = []`` when the file is missing
  (a VM that refuses ``setrlimit`` inside a container refuses podman's default ulimits). Podman
  runs with ``--runtime runc``: crun refuses a cgroup v1 host's mode there;
* the base image, once (cached by tag): Debian bookworm with Python 3.11 made from Debian's own
  packages, ``debootstrap --variant=minbase`` from the mirror apt is configured with, imported
  with ``podman import``. It stands in for ``python:3.11-slim-bookworm``, the public default;
* the image, ``podman build --network host`` (apt and pip in the build reach what the host
  reaches), with the host pip's index and CA bundle, and torch's CPU wheel from a directory of
  pip's ``find-links`` when one holds it (else PyTorch's CPU index, the Dockerfile default).

``run_triton`` / ``run_openai`` start the image's tritonserver and the OpenAI frontend on host
ports of 127.0.0.1; ``bench.container_smoke`` drives them and ``podman kube play``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from deploy.render import TORCH_VERSION, TRITON_PORTS, DeployValues, cpu_image
from engine.errors import LmforgeError, UsageError

#: The tag ``make image`` gives the CPU image (what ``deploy/k8s/cpu`` and compose name).
IMAGE = "localhost/" + cpu_image("lmforge-triton:0.1.0")
#: The local stand-in for ``python:3.11-slim-bookworm``.
BASE_IMAGE = "localhost/lmforge-base:bookworm"
DEBIAN_SUITE = "bookworm"
#: Packages the base image adds to minbase: what the Dockerfile's BASE_IMAGE must provide.
BASE_PACKAGES = ("python3", "python3-venv", "libpython3.11", "ca-certificates")
TOOLS = {"podman": "podman", "runc": "runc", "debootstrap": "debootstrap"}
CONTAINERS_CONF = Path("/etc/containers/containers.conf")
CONTAINERS_CONF_TEXT = "[containers]\n# this VM refuses setrlimit inside a container\ndefault_ulimits = []\n"
DOCKERFILE = "deploy/docker/Dockerfile.cpu"
#: Where the Dockerfile's venv keeps site-packages (the OpenAI frontend runs from it).
IMAGE_PYTHON = "/opt/lmforge/venv/bin/python"
#: The module of the OpenAI-compatible frontend (``python -m``), as ``lmforge serve`` starts it.
OPENAI_MODULE = "deploy.openai"
#: Inside the build, where a wheel directory and a CA bundle of the host are mounted.
BUILD_WHEELS = "/run/lmforge-wheels"
BUILD_CA_BUNDLE = "/run/lmforge-ca.crt"


class ContainerError(LmforgeError, RuntimeError):
    """Podman, the base image, the build or a container failed; the message says what to do."""


def podman(*args: str) -> list[str]:
    """A podman command line (``--runtime runc``, see the module doc)."""
    return ["podman", "--runtime", "runc", *args]


def run(command: list[str], *, timeout_s: float, what: str, capture: bool = True, **kwargs) -> str:
    """Run ``command``; its stdout. Raises ``ContainerError`` naming ``what`` with the output's tail."""
    try:
        done = subprocess.run(command, capture_output=capture, text=True, timeout=timeout_s, check=False, **kwargs)
    except FileNotFoundError as exc:
        raise ContainerError(f"{what}: {command[0]} is not installed", fix="run `make image` first") from exc
    except subprocess.TimeoutExpired as exc:
        raise ContainerError(f"{what}: no result within {timeout_s:.0f} s ({' '.join(command[:4])} ...)") from exc
    if done.returncode != 0:
        tail = ((done.stdout or "") + (done.stderr or ""))[-3000:]
        raise ContainerError(f"{what} failed (exit status {done.returncode}):\n{tail}")
    return done.stdout or ""


def have_podman() -> bool:
    return shutil.which("podman") is not None


# ---------------------------------------------------------------------------------------------
# Tools
# ---------------------------------------------------------------------------------------------


def ensure_tools(log=print) -> None:
    """Install the missing tools with apt and write ``containers.conf`` when it is missing.

    Raises:
        ContainerError: apt-get failed, or a tool is missing and this is not root.
    """
    missing = [pkg for binary, pkg in TOOLS.items() if shutil.which(binary) is None]
    if missing:
        if os.geteuid() != 0:
            raise ContainerError(f"{', '.join(missing)} not installed", fix=f"apt-get install -y {' '.join(missing)}")
        log(f"installing {' '.join(missing)} with apt-get")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        command = ["apt-get", "install", "-y", "-q", *missing]
        try:
            run(command, timeout_s=900, what="apt-get install", env=env)
        except ContainerError:  # stale package lists: refresh them once
            run(["apt-get", "update", "-q"], timeout_s=600, what="apt-get update", env=env)
            run(command, timeout_s=900, what="apt-get install", env=env)
    if not CONTAINERS_CONF.exists() and os.geteuid() == 0:
        CONTAINERS_CONF.parent.mkdir(parents=True, exist_ok=True)
        CONTAINERS_CONF.write_text(CONTAINERS_CONF_TEXT)
        log(f"wrote {CONTAINERS_CONF} (default_ulimits = [])")


# ---------------------------------------------------------------------------------------------
# Base image
# ---------------------------------------------------------------------------------------------


def _one_line_sources(text: str) -> list[tuple[list[str], str, list[str]]]:
    """``deb [opts] URI SUITE COMPONENT...`` lines: (types, uri, suites + components)."""
    entries = []
    for line in text.splitlines():
        line = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()
        if len(line) >= 3 and line[0] == "deb":
            entries.append((["deb"], line[1], line[2:]))
    return entries


def _deb822_sources(text: str) -> list[tuple[list[str], str, list[str]]]:
    """deb822 ``.sources`` stanzas: (types, uri, suites + components) per URI."""
    entries = []
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, value = line.split(":", 1)
            fields[key.strip().lower()] = value.strip()
        if fields.get("enabled", "yes").lower() == "no":
            continue
        words = fields.get("suites", "").split() + fields.get("components", "").split()
        entries += [(fields.get("types", "").split(), uri, words) for uri in fields.get("uris", "").split()]
    return entries


def debian_mirror(apt_dir: str | Path = "/etc/apt", suite: str = DEBIAN_SUITE) -> str:
    """The Debian mirror apt is configured with for ``suite`` (main), from ``sources.list(.d)``.

    Raises:
        ContainerError: no enabled ``deb`` source serves ``suite``'s main component.
    """
    apt = Path(apt_dir)
    files = [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*.list"))]
    entries = [e for f in files if f.is_file() for e in _one_line_sources(f.read_text())]
    entries += [e for f in sorted((apt / "sources.list.d").glob("*.sources")) for e in _deb822_sources(f.read_text())]
    for types, uri, words in entries:
        if "deb" in types and suite in words and "main" in words:
            return uri.rstrip("/")
    raise ContainerError(f"no Debian {suite} mirror in {apt}/sources.list or sources.list.d", fix="pass --mirror URL")


def image_exists(tag: str) -> bool:
    return subprocess.run(podman("image", "exists", tag), check=False).returncode == 0


def build_base(tag: str = BASE_IMAGE, *, mirror: str | None = None, rebuild: bool = False, log=print) -> float | None:
    """Make the base image with debootstrap (see the module doc); seconds taken, None when cached.

    Raises:
        ContainerError: debootstrap or the import failed.
    """
    if not rebuild and image_exists(tag):
        log(f"base image {tag}: cached")
        return None
    mirror = mirror or debian_mirror()
    start = time.monotonic()
    log(f"base image {tag}: debootstrap {DEBIAN_SUITE} from {mirror} ...")
    with tempfile.TemporaryDirectory(prefix="lmforge-base-", dir="/var/tmp") as tmp:
        root = Path(tmp) / "rootfs"
        run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                DEBIAN_SUITE,
                str(root),
                mirror,
            ],
            timeout_s=1800,
            what="debootstrap",
        )
        # what an image leaves out: downloaded packages, package lists, and /dev (the runtime
        # makes it; a /dev/shm directory in the image would lend its root-only mode to volumes)
        for pattern in ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*", "dev/*"):
            for path in root.glob(pattern):
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        try:
            run(
                podman("import", "--change", 'CMD ["/bin/bash"]', "-", tag),
                timeout_s=600,
                what="podman import",
                stdin=tar.stdout,
            )
        finally:
            tar.stdout.close()
            tar.wait()
    seconds = time.monotonic() - start
    log(f"base image {tag}: built in {seconds:.0f} s")
    return seconds


# ---------------------------------------------------------------------------------------------
# The lmforge image
# ---------------------------------------------------------------------------------------------


def pip_settings(python: str = sys.executable) -> dict[str, list[str]]:
    """This host's pip configuration (``pip config list`` and ``PIP_*``): option -> values."""
    settings: dict[str, list[str]] = {}
    try:
        text = subprocess.run(
            [python, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    for line in text.splitlines():
        match = re.fullmatch(r"[^.]*\.([a-z-]+)='(.*)'", line.strip())
        if match:
            settings.setdefault(match[1], []).extend(match[2].split())
    for option in ("index-url", "find-links", "cert"):
        value = os.environ.get("PIP_" + option.upper().replace("-", "_"))
        if value:
            settings[option] = value.split() + settings.get(option, [])
    return settings


def torch_wheel_dir(settings: dict[str, list[str]], version: str = TORCH_VERSION) -> Path | None:
    """A pip ``find-links`` directory holding torch ``version``'s CPU wheel for this Python, if any."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for link in settings.get("find-links", []):
        path = Path(link.removeprefix("file://"))
        if path.is_dir() and any(path.glob(f"torch-{version}+cpu-{tag}-{tag}-*linux*x86_64.whl")):
            return path
    return None


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """The ``podman build`` of the CPU image: its command and where torch comes from."""

    command: list[str]
    torch_source: str


def build_plan(
    tag: str = IMAGE, *, base: str = BASE_IMAGE, context: str | Path = ".", settings: dict[str, list[str]] | None = None
) -> BuildPlan:
    """The build command for this host (see the module doc).

    The Dockerfile's defaults are the public sources; only what this host's pip is configured
    with differs: its index, its CA bundle, and a local directory with torch's CPU wheel.
    """
    settings = pip_settings() if settings is None else settings
    context = Path(context)
    command = podman(
        "build",
        "--format",
        "docker",  # keeps HEALTHCHECK (the OCI format has none)
        "--network",
        "host",
        "-f",
        str(context / DOCKERFILE),
        "--ignorefile",
        str(context / (DOCKERFILE + ".dockerignore")),
        "--build-arg",
        f"BASE_IMAGE={base}",
    )
    index = (settings.get("index-url") or [None])[0]
    if index:
        command += ["--build-arg", f"PIP_INDEX_URL={index}"]
    cert = next((c for c in settings.get("cert", []) if Path(c).is_file()), None)
    if cert:
        command += ["-v", f"{cert}:{BUILD_CA_BUNDLE}:ro", "--build-arg", f"PIP_CERT={BUILD_CA_BUNDLE}"]
    wheels = torch_wheel_dir(settings)
    if wheels is not None:
        # the index serves torch's own dependencies; pip takes the +cpu wheel of the directory
        command += [
            "-v",
            f"{wheels}:{BUILD_WHEELS}:ro",
            "--build-arg",
            f"TORCH_FIND_LINKS={BUILD_WHEELS}",
            "--build-arg",
            f"TORCH_INDEX_URL={index or 'https://pypi.org/simple'}",
        ]
        source = f"torch {TORCH_VERSION}+cpu wheel in {wheels}"
    else:
        source = "PyTorch's CPU index (the Dockerfile default)"
    return BuildPlan(command + ["-t", tag, str(context)], source)


def build_image(tag: str = IMAGE, *, base: str = BASE_IMAGE, context: str | Path = ".", log=print) -> float:
    """Build the CPU image; seconds taken. The build's output goes to ``log`` line by line.

    Raises:
        ContainerError: the build failed (with its output's tail).
    """
    plan = build_plan(tag, base=base, context=context)
    log(f"image {tag}: podman build ({plan.torch_source}) ...")
    start = time.monotonic()
    tail: list[str] = []
    process = subprocess.Popen(plan.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        tail = (tail + [line.rstrip()])[-60:]
        if line.startswith(("[", "STEP", "C++ CPU kernels", "Successfully")) or "error" in line.lower():
            log("  " + line.rstrip()[:200])
    if process.wait() != 0:
        raise ContainerError(f"podman build failed (exit status {process.returncode}):\n" + "\n".join(tail))
    seconds = time.monotonic() - start
    log(f"image {tag}: built in {seconds:.0f} s, {image_size_bytes(tag) / 1e9:.2f} GB")
    return seconds


def image_size_bytes(tag: str) -> int:
    return int(run(podman("image", "inspect", "--format", "{{.Size}}", tag), timeout_s=60, what="podman image inspect"))


def image_packages(tag: str) -> dict[str, str]:
    """``pip list`` inside the image: distribution name -> version."""
    text = run(
        podman(
            "run",
            "--rm",
            "--network",
            "none",
            "--entrypoint",
            IMAGE_PYTHON,
            tag,
            "-m",
            "pip",
            "list",
            "--format",
            "json",
            "--disable-pip-version-check",
        ),
        timeout_s=120,
        what="pip list in the image",
    )
    return {p["name"].lower(): p["version"] for p in json.loads(text)}


def image_config(tag: str) -> dict:
    """The image's config (``User``, ``Volumes``, ``Entrypoint``...) with its ``Healthcheck``."""
    info = json.loads(run(podman("image", "inspect", tag), timeout_s=60, what="podman image inspect"))[0]
    return {
        **info.get("Config", {}),
        "Healthcheck": info.get("Healthcheck") or info.get("Config", {}).get("Healthcheck"),
    }


# ---------------------------------------------------------------------------------------------
# Containers
# ---------------------------------------------------------------------------------------------


def check_readable(repo: Path) -> None:
    """The image runs as a non-root user: every file of ``repo`` must be world-readable.

    Raises:
        UsageError: naming the first unreadable path and the fix.
    """
    for path in [repo, *repo.rglob("*")]:
        mode = path.stat().st_mode
        needed = 0o005 if path.is_dir() else 0o004
        if mode & needed != needed:
            raise UsageError(
                f"{path}: not readable by the image's non-root user (mode {mode & 0o777:o})",
                fix=f"chmod -R a+rX {repo}",
            )


def triton_command(model: str) -> list[str]:
    """tritonserver flags after the image's entry point: the image's default command (``CMD``) when
    ``model`` is the one it loads, else the same flags loading ``model``."""
    if model == DeployValues().model_name:
        return []
    return [
        "--model-repository=/models",
        "--model-control-mode=explicit",
        f"--load-model={model}",
        "--allow-metrics=true",
        "--allow-gpu-metrics=false",
    ]


def run_detached(name: str, repo: Path, *args: str) -> None:
    """``podman run -d --name NAME -v REPO:/models:ro ARGS...`` (``args``: more options, the image, its command)."""
    run(
        podman("run", "-d", "--name", name, "-v", f"{repo}:/models:ro", *args), timeout_s=120, what=f"podman run {name}"
    )


def run_triton(name: str, image: str, repo: Path, model: str, ports: dict[str, int]) -> None:
    """Start the image's tritonserver detached as container ``name``: ``repo`` read-only at /models,
    the image's ports (8000-8002, so its health check holds) published on ``ports`` of 127.0.0.1."""
    published = [f"-p=127.0.0.1:{ports[kind]}:{TRITON_PORTS[kind]}" for kind in ("http", "grpc", "metrics")]
    run_detached(name, repo, "--shm-size", "2g", *published, image, *triton_command(model))


def run_openai(name: str, image: str, repo: Path, model: str, grpc_port: int, port: int) -> None:
    """Start the image's OpenAI frontend detached as container ``name``, forwarding to Triton's gRPC."""
    run_detached(
        name,
        repo,
        "--network",
        "host",
        "--entrypoint",
        IMAGE_PYTHON,
        image,
        "-m",
        OPENAI_MODULE,
        "--repo",
        "/models",
        "--grpc-url",
        f"127.0.0.1:{grpc_port}",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--models",
        model,
    )


def container_running(name: str) -> bool:
    out = subprocess.run(
        podman("inspect", "--format", "{{.State.Running}}", name), capture_output=True, text=True, check=False
    )
    return out.stdout.strip() == "true"


def logs(name: str, lines: int = 40) -> str:
    out = subprocess.run(podman("logs", "--tail", str(lines), name), capture_output=True, text=True, check=False)
    return (out.stdout + out.stderr).strip()


def healthcheck(name: str, what: str) -> tuple[bool, str]:
    """Run container ``name``'s health check once (podman schedules them with systemd timers; a
    machine without systemd runs them only when asked): whether it passed, and a line saying so."""
    done = subprocess.run(podman("healthcheck", "run", name), capture_output=True, text=True, check=False, timeout=60)
    state = "healthy" if done.returncode == 0 else "unhealthy"
    said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip() not in ("", state)]
    return done.returncode == 0, f"{what}: {state}" + (f" ({said[-1].strip()})" if said else "")


def remove_container(name: str, grace_s: int = 30) -> None:
    """Stop (SIGTERM, then SIGKILL after ``grace_s``) and remove container ``name``; quiet when absent."""
    subprocess.run(podman("rm", "-f", "-t", str(grace_s), name), capture_output=True, check=False)


# ---------------------------------------------------------------------------------------------
# podman kube play
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KubePlay:
    """What ``kube_play`` started: the Deployment's pod and container, and the volumes made."""

    pod: str
    container: str
    volumes: list[str]


def _documents(files: list[Path]) -> list[dict]:
    return [d for f in files for d in yaml.safe_load_all(f.read_text()) if d]


def kube_volumes(files: list[Path]) -> tuple[list[str], list[str]]:
    """The claims (PersistentVolumeClaims and the pods' claimName) and the emptyDir volume names."""
    claims, empty_dirs = [], []
    for doc in _documents(files):
        if doc.get("kind") == "PersistentVolumeClaim":
            claims.append(doc["metadata"]["name"])
        pod = doc.get("spec", {}).get("template", {}).get("spec", {}) if doc.get("kind") == "Deployment" else {}
        for volume in pod.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                claims.append(volume["persistentVolumeClaim"]["claimName"])
            if "emptyDir" in volume:
                empty_dirs.append(volume["name"])
    return sorted(set(claims)), sorted(set(empty_dirs))


def kube_play(files: list[Path], repo: Path) -> KubePlay:
    """Play ``files`` (PVCs first) with the claims holding ``repo``; the Deployment's pod.

    Podman makes a claim a named volume and an emptyDir a named volume too: the claims are
    filled with ``repo`` (``podman volume import``), and the emptyDir volumes are made beforehand
    world-writable, as Kubernetes makes an emptyDir.

    Raises:
        ContainerError: a play or an import failed, or no pod came up.
    """
    kube_down(files)  # what an interrupted run left
    claims, empty_dirs = kube_volumes(files)
    for name in empty_dirs:
        run(podman("volume", "create", name), timeout_s=60, what=f"podman volume create {name}")
        mountpoint = run(
            podman("volume", "inspect", "--format", "{{.Mountpoint}}", name), timeout_s=60, what="podman volume inspect"
        ).strip()
        Path(mountpoint).chmod(0o1777)
    pod = container = ""
    for file in sorted(files, key=lambda f: "PersistentVolumeClaim" not in f.read_text()):
        played = run(podman("kube", "play", str(file)), timeout_s=300, what=f"podman kube play {file.name}")
        if "PersistentVolumeClaim" in file.read_text():
            for claim in claims:
                tar = subprocess.Popen(["tar", "-C", str(repo), "-c", "."], stdout=subprocess.PIPE)
                try:
                    run(
                        podman("volume", "import", claim, "-"),
                        timeout_s=600,
                        what=f"podman volume import {claim}",
                        stdin=tar.stdout,
                    )
                finally:
                    tar.stdout.close()
                    tar.wait()
        match = re.search(r"Pod:\s*\n(\w+)", played)
        if match:
            pod = match[1]
            info = json.loads(run(podman("pod", "inspect", pod), timeout_s=60, what="podman pod inspect"))
            info = info[0] if isinstance(info, list) else info
            container = next(c["Name"] for c in info["Containers"] if c["Id"] != info.get("InfraContainerID"))
            pod = info["Name"]
    if not pod:
        raise ContainerError(f"podman kube play {' '.join(f.name for f in files)}: no pod was started")
    return KubePlay(pod, container, claims + empty_dirs)


def kube_down(files: list[Path]) -> None:
    """Remove the pods and volumes ``kube_play`` made from ``files``; quiet for what is absent."""
    for file in files:
        subprocess.run(podman("kube", "down", str(file)), capture_output=True, check=False, timeout=120)
    claims, empty_dirs = kube_volumes(files)
    for name in claims + empty_dirs:
        subprocess.run(podman("volume", "rm", "-f", name), capture_output=True, check=False, timeout=120)


def pod_address(pod: str) -> str:
    """The pod's IP address on podman's bridge network (reachable from the host)."""
    info = json.loads(run(podman("pod", "inspect", pod), timeout_s=60, what="podman pod inspect"))
    info = info[0] if isinstance(info, list) else info
    networks = json.loads(
        run(
            podman("inspect", "--format", "{{json .NetworkSettings.Networks}}", info["InfraContainerID"]),
            timeout_s=60,
            what="podman inspect",
        )
    )
    return next(n["IPAddress"] for n in networks.values() if n.get("IPAddress"))


def container_spec(name: str) -> dict:
    """What podman made of a pod's container: user, health check, CPU and memory limits."""
    info = json.loads(run(podman("inspect", name), timeout_s=60, what="podman inspect"))[0]
    host = info["HostConfig"]
    cpus = (
        host.get("NanoCpus") / 1e9
        if host.get("NanoCpus")
        else host.get("CpuQuota", 0) / max(host.get("CpuPeriod") or 1, 1)
    )
    check = info["Config"].get("Healthcheck")
    return {
        "user": info["Config"].get("User") or "root",
        "healthcheck": " ".join(check["Test"]) if check else None,
        "cpus": cpus,
        "memory_bytes": host.get("Memory", 0),
    }
