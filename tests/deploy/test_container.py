"""The container tooling without podman: the Debian mirror apt uses, the build command this host
gets, the Dockerfile's dependency filter run on the real pyproject.toml, the volumes podman kube
play needs, and the smoke test's request helpers against the real tritonserver.

The image itself is built and run by ``make image`` / ``make image-smoke`` (``.ci/run`` runs them
where podman is installed, docs/deploy-container.md).
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from bench.container_smoke import engine_answers, llm_model, metric_value, triton_generate
from deploy import container as ctr
from deploy.render import (
    IMAGE_EXTRAS,
    IMAGE_KERNEL_BUILD,
    IMAGE_SKIPPED_DEPENDENCIES,
    SUCCESS_METRIC,
    TORCH_VERSION,
    DeployValues,
    render_files,
)
from engine.errors import UsageError
from lmforge_cli import main
from tests.conftest import ENGINE_CONFIG

ROOT = Path(__file__).resolve().parents[2]

DEB822 = """\
Types: deb
# a snapshot of the archive
URIs: http://mirror.example.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.example.org/debian-security
Suites: bookworm-security
Components: main
"""


def _apt(tmp_path: Path, sources_list: str = "", **files: str) -> Path:
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    (apt / "sources.list").write_text(sources_list)
    for name, text in files.items():
        (apt / "sources.list.d" / name.replace("_", ".")).write_text(text)
    return apt


def test_debian_mirror_reads_deb822_and_one_line_sources(tmp_path):
    assert ctr.debian_mirror(_apt(tmp_path / "a", debian_sources=DEB822)) == "http://mirror.example.org/debian"
    one_line = (
        "# deb http://commented.example.org/debian bookworm main\n"
        "deb http://security.example.org/debian-security bookworm-security main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://ftp.example.net/debian/ bookworm main contrib\n"
    )
    assert ctr.debian_mirror(_apt(tmp_path / "b", one_line)) == "http://ftp.example.net/debian"
    disabled = "Enabled: no\n" + DEB822
    with pytest.raises(ctr.ContainerError, match="no Debian bookworm mirror.*--mirror"):
        ctr.debian_mirror(
            _apt(
                tmp_path / "c",
                "deb-src http://x.example.org/debian bookworm main\n",
                other_sources=disabled.split("\n\n")[0],
            )
        )


def test_debian_mirror_of_this_machine_serves_bookworm():
    assert re.fullmatch(r"https?://\S+", ctr.debian_mirror())


def test_build_plan_uses_the_hosts_pip_index_ca_bundle_and_torch_wheel(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    (wheels / f"torch-{TORCH_VERSION}+cpu-{tag}-{tag}-manylinux_2_28_x86_64.whl").write_bytes(b"")
    cert = tmp_path / "ca.crt"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    settings = {"index-url": ["https://pypi.example.org/simple"], "cert": [str(cert)], "find-links": [str(wheels)]}
    plan = ctr.build_plan("localhost/x:1", context=ROOT, settings=settings)
    command = " ".join(plan.command)
    assert plan.command[:4] == ["podman", "--runtime", "runc", "build"]
    for part in (
        "--format docker",
        "--network host",
        f"-f {ROOT / 'deploy/docker/Dockerfile.cpu'}",
        f"--build-arg BASE_IMAGE={ctr.BASE_IMAGE}",
        "--build-arg PIP_INDEX_URL=https://pypi.example.org/simple",
        f"-v {cert}:{ctr.BUILD_CA_BUNDLE}:ro --build-arg PIP_CERT={ctr.BUILD_CA_BUNDLE}",
        f"-v {wheels}:{ctr.BUILD_WHEELS}:ro --build-arg TORCH_FIND_LINKS={ctr.BUILD_WHEELS}",
        "--build-arg TORCH_INDEX_URL=https://pypi.example.org/simple",
    ):
        assert part in command, part
    assert plan.command[-3:] == ["-t", "localhost/x:1", str(ROOT)] and "wheel in" in plan.torch_source
    # nothing configured: the Dockerfile's public defaults (PyPI, PyTorch's CPU index)
    bare = ctr.build_plan(context=ROOT, settings={"find-links": [str(tmp_path / "missing")]})
    assert not any(a.startswith(("PIP_", "TORCH_")) for a in bare.command) and "CPU index" in bare.torch_source
    # a CUDA wheel of torch is no reason to mount a directory
    (wheels / f"torch-{TORCH_VERSION}+cpu-{tag}-{tag}-manylinux_2_28_x86_64.whl").rename(
        wheels / f"torch-{TORCH_VERSION}-{tag}-{tag}-manylinux_2_28_x86_64.whl"
    )
    assert ctr.torch_wheel_dir({"find-links": [str(wheels)]}) is None


def test_dockerfile_dependency_filter_on_the_real_pyproject(tmp_path):
    """The Dockerfile's own one-liner, run as the build runs it, on this pyproject.toml."""
    dockerfile = render_files("docker", DeployValues())["Dockerfile.cpu"]
    (line,) = [x for x in dockerfile.splitlines() if "tomllib" in x]
    command = line.strip().removeprefix("&& ").removesuffix(" \\")
    command = command.replace("/tmp/requirements.txt", str(tmp_path / "requirements.txt"))
    (tmp_path / "pyproject.toml").write_bytes((ROOT / "pyproject.toml").read_bytes())
    env = {
        "SKIP_DEPENDENCIES": " ".join(IMAGE_SKIPPED_DEPENDENCIES),
        "EXTRAS": " ".join(IMAGE_EXTRAS),
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
    }
    subprocess.run(["sh", "-c", command], cwd=tmp_path, env=env, check=True)
    kept = (tmp_path / "requirements.txt").read_text()
    names = {re.match(r"[A-Za-z0-9._-]+", r).group().lower() for r in kept.splitlines() if r}
    assert f"torch=={TORCH_VERSION}" in kept and "nvidia-pytriton==0.7.0" in kept and "locust==2.47.0" in kept
    assert names.isdisjoint(IMAGE_SKIPPED_DEPENDENCIES)
    assert "triton" not in names and "tritonclient" in names  # by name, not by prefix
    assert {"pytest", "ruff", "kubernetes-validate"}.isdisjoint(names)  # the dev extra stays out
    assert re.search(rf"^ARG SKIP_DEPENDENCIES=\"{' '.join(IMAGE_SKIPPED_DEPENDENCIES)}\"$", dockerfile, re.M)


def test_dockerfile_refuses_a_cuda_torch_and_runs_as_its_user():
    dockerfile = render_files("docker", DeployValues())["Dockerfile.cpu"]
    assert (
        "torch.version.cuda and" in dockerfile and "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in dockerfile
    )
    assert re.search(r"^USER 1000:1000$", dockerfile, re.M) and 'VOLUME ["/models"]' in dockerfile
    assert "COPY ${MODEL_REPOSITORY}" not in dockerfile  # the model is a volume, not baked in
    deployment = render_files("k8s", DeployValues(gpus=0))["deployment.yaml"]
    assert "runAsNonRoot: true" in deployment and "runAsUser: 1000" in deployment


def test_kernel_build_of_the_image_imports_what_exists():
    """The image's kernel build names modules and functions of this tree (a move breaks it here)."""
    for module, names in re.findall(r"from (\S+) import ([\w, ]+?);", IMAGE_KERNEL_BUILD):
        loaded = importlib.import_module(module)
        assert all(hasattr(loaded, n.strip()) for n in names.split(",")), (module, names)


def test_kube_volumes_of_the_rendered_cpu_manifests():
    files = [ROOT / "deploy/k8s/cpu/deployment.yaml", ROOT / "deploy/k8s/cpu/model-repository-pvc.yaml"]
    assert ctr.kube_volumes(files) == (["lmforge-triton-models"], ["shm"])


def test_check_readable_names_the_file_and_the_fix(tmp_path):
    repo = tmp_path / "repo"
    (repo / "m" / "1").mkdir(parents=True)
    for directory in (repo, repo / "m", repo / "m" / "1"):
        directory.chmod(0o755)
    secret = repo / "m" / "1" / "model.safetensors"
    secret.write_bytes(b"x")
    secret.chmod(0o600)  # what a copied checkpoint may keep
    with pytest.raises(UsageError, match=rf"{secret}: not readable .*mode 600.*chmod -R a\+rX {repo}"):
        ctr.check_readable(repo)
    secret.chmod(0o644)
    ctr.check_readable(repo)
    (repo / "m").chmod(0o700)
    with pytest.raises(UsageError, match=rf"{repo / 'm'}: not readable .*mode 700"):
        ctr.check_readable(repo)


def test_triton_command_is_the_images_own_for_its_model():
    assert ctr.triton_command("smollm2_135m") == []  # the image's CMD, as a user runs it
    command = ctr.triton_command("m")
    assert "--load-model=m" in command and "--model-repository=/models" in command


def test_llm_model_wants_weights_inside_the_repository(tmp_path):
    (tmp_path / "m" / "1").mkdir(parents=True)
    info = {"kind": "llm", "source": "smollm2-135m", "checkpoint": "/elsewhere/ckpt", "engine": {}}
    (tmp_path / "m" / "1" / "model.json").write_text(json.dumps(info))
    with pytest.raises(UsageError, match="outside the repository.*--copy-weights"):
        llm_model(tmp_path, None)
    (tmp_path / "m" / "1" / "model.json").write_text(json.dumps({**info, "checkpoint": "weights"}))
    assert llm_model(tmp_path, None) == ("m", tmp_path / "m" / "1" / "weights", {})
    with pytest.raises(UsageError, match="--model other: not an LLM"):
        llm_model(tmp_path, "other")


def test_deploy_command_without_podman_says_how(monkeypatch, capsys):
    monkeypatch.setattr(ctr, "have_podman", lambda: False)
    assert main(["deploy", "smoke"]) == 1
    assert "error: podman is not installed; run `make image` first" in capsys.readouterr().err
    assert main(["deploy"]) == 2


@pytest.mark.integration
def test_smoke_helpers_read_the_real_server_and_match_the_engine(server, tiny_llama_dir):
    """What `lmforge deploy smoke` compares, against the real tritonserver on the host."""
    expected = engine_answers(tiny_llama_dir, ENGINE_CONFIG)
    assert expected["text"] == expected["ids"] and expected["prompt"].endswith("assistant\n")
    for stream in (False, True):
        assert triton_generate(server.http_url, "llm", expected["prompt"], stream=stream) == expected["text"]
    with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
        served = metric_value(reply.read().decode(), SUCCESS_METRIC, "llm")
    assert served is not None and served >= 2
