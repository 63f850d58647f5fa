"""``lmforge deploy``: the CPU container image built, run and checked for real with podman.

    lmforge deploy image [--rebuild-base] [--mirror URL]          (what `make image` runs)
    lmforge deploy smoke [--repo DIR] [--run-time 30s] [--users 4] [--compare-host] [--out DIR]
    lmforge deploy kube  [--repo DIR]

``smoke`` exports the default checkpoint (SmolLM2-135M-Instruct, weights copied) when ``--repo``
is not given and computes the in-process engine's greedy answer to a chat. Then it runs the
image as a user would (its own command, the repository read-only at ``/models``, its ports
published on free ports of 127.0.0.1) and the image's OpenAI frontend beside it, waits for
``/v2/models/NAME/ready`` and checks, one printed line each:

* the image: non-root user, CPU torch and no CUDA wheel (``pip list``), the health check on the
  model's ready endpoint, ``/models`` a volume, its size;
* Triton ``generate`` and ``generate_stream``, and OpenAI chat (plain and streamed), answer with
  the engine's greedy text; the image's own health check passes;
* ``/metrics`` counts those requests and exports the queue-time counter the HPA reads;
* a Locust load (``bench.loadtest``, ``--run-time``) through the container; ``--compare-host``
  then runs the same load against ``lmforge serve``'s server on the host, for a ratio.

``kube`` plays the rendered ``deploy/k8s/cpu`` manifests with ``podman kube play``: the
PersistentVolumeClaim (a podman volume, filled with the repository) and the Deployment (its pod,
probes, resources, security context and volumes), waits for the model, sends a greedy request to
the pod and runs its liveness probe. What podman 4.3 cannot play (the Service, the
HorizontalPodAutoscaler, the ServiceMonitor, prometheus-adapter) is printed; the schema tests
(tests/test_deploy_render.py) check those.

The exit status is 1 when a check fails. Containers, pods and volumes are removed at the end,
also after a failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from transformers import AutoTokenizer

from bench.loadtest import LoadTestConfig, format_report, parse_duration, run_loadtest
from bench.protocol import parse_sse_line, request_payload
from deploy import container as ctr
from deploy.export import default_name, export
from deploy.render import COMMITTED, QUEUE_METRIC, SUCCESS_METRIC, DeployValues, model_ready_path, render_deploy
from deploy.triton import TritonServer, free_ports
from engine import LLM, SamplingParams
from engine.cli_options import add_option
from engine.errors import UsageError

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
MAX_TOKENS = 32
READY_TIMEOUT_S = 600.0
KUBE_DIR = "deploy/k8s/cpu"


@dataclasses.dataclass
class Checks:
    """Printed check lines; ``failed`` counts the failures."""

    failed: int = 0

    def __call__(self, ok: bool, line: str) -> bool:
        print(f"{'ok  ' if ok else 'FAIL'} {line}", flush=True)
        self.failed += not ok
        return ok


# ---------------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------------


def http(url: str, body: dict | None = None, timeout_s: float = 120.0) -> tuple[int, bytes]:
    """Status and body of a GET (or a JSON POST when ``body`` is given); status 0 when unreachable."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def wait_ready(url: str, timeout_s: float, alive=lambda: True) -> float | None:
    """Seconds until ``url`` answers 200; None when ``timeout_s`` passes or ``alive()`` turns False."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if http(url, timeout_s=3)[0] == 200:
            return time.monotonic() - start
        if not alive():
            return None
        time.sleep(0.5)
    return None


def triton_generate(base: str, model: str, prompt: str, *, stream: bool, timeout_s: float = 120.0) -> str:
    """The greedy text Triton's generate (or generate_stream, events joined) answers ``prompt`` with."""
    body = request_payload(prompt, {"max_tokens": MAX_TOKENS, "temperature": 0.0}, stream=stream)
    status, data = http(f"{base}/v2/models/{model}/{'generate_stream' if stream else 'generate'}", body, timeout_s)
    if status != 200:
        return f"<HTTP {status}: {data[:200]!r}>"
    if not stream:
        return json.loads(data)["text_output"]
    events = [parse_sse_line(line) for line in data.splitlines()]
    return "".join(e.get("text_output", "") for e in events if e)


def openai_chat(base: str, model: str, *, stream: bool) -> str:
    """The greedy text the OpenAI frontend answers ``CHAT`` with (streamed deltas joined)."""
    from openai import OpenAI  # the bench extra

    client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120.0, max_retries=0)
    reply = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0.0, stream=stream
    )
    if not stream:
        return reply.choices[0].message.content or ""
    return "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)


def metric_value(text: str, name: str, model: str) -> float | None:
    """The value of ``name{model="MODEL",...}`` in a Prometheus text page (None when absent)."""
    match = re.search(rf'^{name}{{[^}}]*model="{re.escape(model)}"[^}}]*}} (\S+)$', text, re.M)
    return float(match[1]) if match else None


# ---------------------------------------------------------------------------------------------
# The model and its expected answers
# ---------------------------------------------------------------------------------------------


def export_default(out: Path) -> tuple[Path, str]:
    """Export the default checkpoint into ``out/model_repository`` (weights copied, readable by all)."""
    repo = out / "model_repository"
    name = default_name("smollm2-135m")
    if not (repo / name / "1" / "model.json").is_file():
        export("smollm2-135m", repo, copy_weights=True)
    subprocess.run(["chmod", "-R", "a+rX", str(repo)], check=True)  # the image runs as a non-root user
    return repo, name


def llm_model(repo: Path, name: str | None) -> tuple[str, Path, dict]:
    """The LLM of ``repo`` (``name`` or its only one): name, checkpoint directory, EngineConfig fields.

    Raises:
        UsageError: no such model, or several and no ``name``.
    """
    infos = {p.parent.parent.name: p for p in repo.glob("*/1/model.json")}
    infos = {n: p for n, p in infos.items() if json.loads(p.read_text()).get("kind") == "llm"}
    if name is None and len(infos) != 1:
        raise UsageError(f"--repo {repo}: {len(infos)} LLM models ({', '.join(sorted(infos))})", fix="pass --model")
    name = name or next(iter(infos))
    if name not in infos:
        raise UsageError(f"--model {name}: not an LLM of {repo} ({', '.join(sorted(infos)) or 'none'})")
    info = json.loads(infos[name].read_text())
    checkpoint = Path(info["checkpoint"])
    checkpoint = checkpoint if checkpoint.is_absolute() else infos[name].parent / checkpoint
    if not str(checkpoint.resolve()).startswith(str(repo.resolve())):
        raise UsageError(
            f"{infos[name]}: its checkpoint {checkpoint} lies outside the repository, so the container cannot see it",
            fix=f"export with --copy-weights: lmforge export --model {info.get('source')} --repo {repo} --copy-weights",
        )
    return name, checkpoint, info["engine"]


def engine_answers(checkpoint: Path, engine: dict) -> dict[str, str]:
    """The in-process engine's greedy answers to ``CHAT``: from the rendered text (what Triton's
    generate gets) and from the template's token ids (what the OpenAI frontend sends)."""
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    llm = LLM(str(checkpoint), **engine)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    by_text, by_ids = llm.generate([text, {"prompt_token_ids": ids}], params)
    return {"prompt": text, "text": by_text.outputs[0].text, "ids": by_ids.outputs[0].text}


# ---------------------------------------------------------------------------------------------
# lmforge deploy image
# ---------------------------------------------------------------------------------------------


def cmd_image(args: argparse.Namespace) -> int:
    ctr.ensure_tools()
    base_s = ctr.build_base(ctr.BASE_IMAGE, mirror=args.mirror, rebuild=args.rebuild_base)
    image_s = ctr.build_image(args.image, base=ctr.BASE_IMAGE, context=Path(args.context))
    base = "cached" if base_s is None else f"{base_s:.0f} s"
    print(
        f"built {args.image}: base image {base}, image {image_s:.0f} s, {ctr.image_size_bytes(args.image) / 1e9:.2f} GB"
    )
    return 0


def check_image(image: str, check: Checks, model: str) -> None:
    """The image's own honesty: user, packages, health check, volume, size."""
    config = ctr.image_config(image)
    user = str(config.get("User") or "root")
    check(user.split(":")[0] not in ("", "0", "root"), f"image runs as a non-root user ({user})")
    packages = ctr.image_packages(image)
    cuda = sorted(n for n in packages if (n.startswith("nvidia-") and n != "nvidia-pytriton") or "cuda" in n)
    torch = packages.get("torch", "missing")
    check(torch.endswith("+cpu") and not cuda, f"CPU torch {torch}, CUDA wheels: {', '.join(cuda) or 'none'}")
    check("triton" not in packages, "the Triton compiler (CUDA kernels only) is left out")
    health = " ".join((config.get("Healthcheck") or {}).get("Test") or [])
    check(model_ready_path(model) in health, f"health check: {health or 'none'}")
    check("/models" in (config.get("Volumes") or {}), "the model repository is a volume (/models)")
    print(f"     image {image}: {ctr.image_size_bytes(image) / 1e9:.2f} GB")


# ---------------------------------------------------------------------------------------------
# lmforge deploy smoke
# ---------------------------------------------------------------------------------------------


def _loadtest(host: str, model: str, checkpoint: Path, args: argparse.Namespace, out: Path) -> dict:
    """One Locust run into ``out`` (the smoke test's own subdirectory: an earlier run's is replaced)."""
    shutil.rmtree(out, ignore_errors=True)

    config = LoadTestConfig(
        host=host,
        model=model,
        users=args.users,
        spawn_rate=args.users,
        run_time_s=args.run_time_s,
        chat_template=str(checkpoint),
        max_tokens=64,
    )
    summary = run_loadtest(config, out)
    print("\n".join("     " + line for line in format_report(summary).splitlines()))
    return summary


def _load_line(summary: dict) -> str:
    m = summary["metrics"]
    return (
        f"{m['successful']}/{m['requests']} requests ok, {m['output_throughput_tok_s']:.1f} output tok/s, "
        f"TTFT p50 {m['ttft_ms']['p50']:.0f} ms, p90 {m['ttft_ms']['p90']:.0f} ms"
    )


def smoke(args: argparse.Namespace, out: Path, check: Checks) -> None:
    repo, name = (Path(args.repo).resolve(), args.model) if args.repo else export_default(out)
    ctr.check_readable(repo)
    name, checkpoint, engine = llm_model(repo, name)
    check_image(args.image, check, name)
    start = time.monotonic()
    expected = engine_answers(checkpoint, engine)
    print(f"     in-process engine: greedy answer {expected['text']!r} ({time.monotonic() - start:.0f} s)")

    http_port, grpc_port, metrics_port, openai_port = free_ports(4)
    ports = {"http": http_port, "grpc": grpc_port, "metrics": metrics_port}
    triton, frontend = f"lmforge-smoke-{http_port}", f"lmforge-smoke-openai-{http_port}"
    base, openai_base = f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{openai_port}"
    summary = None
    try:
        ctr.run_triton(triton, args.image, repo, name, ports)
        ready_s = wait_ready(f"{base}{model_ready_path(name)}", READY_TIMEOUT_S, lambda: ctr.container_running(triton))
        if not check(ready_s is not None, f"tritonserver in the container: {name} ready in {ready_s or 0:.1f} s"):
            print(ctr.logs(triton))
            return
        check(*ctr.healthcheck(triton, "the image's health check (model ready endpoint)"))
        for stream in (False, True):
            got = triton_generate(base, name, expected["prompt"], stream=stream)
            kind = "generate_stream" if stream else "generate"
            check(got == expected["text"], f"Triton {kind}: {got!r} == the in-process engine's greedy answer")
        ctr.run_openai(frontend, args.image, repo, name, grpc_port, openai_port)
        openai_s = wait_ready(f"{openai_base}/health", 180, lambda: ctr.container_running(frontend))
        if check(openai_s is not None, f"OpenAI frontend in the container: ready in {openai_s or 0:.1f} s"):
            for stream in (False, True):
                got = openai_chat(openai_base, name, stream=stream)
                kind = "chat (stream)" if stream else "chat"
                check(got == expected["ids"], f"OpenAI {kind}: {got!r} == the in-process engine's greedy answer")
        else:
            print(ctr.logs(frontend))
        status, page = http(f"http://127.0.0.1:{metrics_port}/metrics")
        text = page.decode()
        served = metric_value(text, SUCCESS_METRIC, name)
        check(
            status == 200 and (served or 0) >= 4 and metric_value(text, QUEUE_METRIC, name) is not None,
            f"/metrics: {SUCCESS_METRIC}={served}, {QUEUE_METRIC} exported (HPA input)",
        )
        ctr.remove_container(frontend)
        summary = _loadtest(base, name, checkpoint, args, out / "loadtest-container")
        check(
            summary["metrics"]["successful"] > 0 and summary["metrics"]["failed"] == 0,
            f"Locust {args.run_time_s:g} s, {args.users} users through the container: {_load_line(summary)}",
        )
    finally:
        ctr.remove_container(frontend)
        ctr.remove_container(triton)
        print(f"     stopped and removed {triton}, {frontend}")
    if args.compare_host and summary is not None:
        compare_host(repo, name, checkpoint, expected["prompt"], args, out, summary)


def compare_host(
    repo: Path, name: str, checkpoint: Path, engine_prompt: str, args: argparse.Namespace, out: Path, container: dict
) -> None:
    """The same load against the host's tritonserver (``lmforge serve``'s), after the container stopped."""
    http_port, grpc_port, metrics_port = free_ports(3)
    base = f"http://127.0.0.1:{http_port}"
    with TritonServer(
        repo,
        http_port,
        grpc_port,
        metrics_port,
        models=[name],
        log_path=out / "host-triton.log",
        write_pid_file=False,
        startup_timeout_s=READY_TIMEOUT_S,
    ):
        # one request first, under the start-up deadline rather than the load test's request
        # timeout: a host whose C++ kernels are not built yet builds them on the first forward pass
        start = time.monotonic()
        first = triton_generate(base, name, engine_prompt, stream=False, timeout_s=READY_TIMEOUT_S)
        print(f"     host tritonserver: first answer {first!r} in {time.monotonic() - start:.1f} s")
        host = _loadtest(base, name, checkpoint, args, out / "loadtest-host")
    print(f"     host (lmforge serve): {_load_line(host)}")
    c, h = container["metrics"], host["metrics"]
    if h["output_throughput_tok_s"] and h["ttft_ms"]["p50"]:
        print(
            f"     container / host: output tok/s x{c['output_throughput_tok_s'] / h['output_throughput_tok_s']:.2f}, "
            f"TTFT p50 x{c['ttft_ms']['p50'] / h['ttft_ms']['p50']:.2f}"
        )


# ---------------------------------------------------------------------------------------------
# lmforge deploy kube
# ---------------------------------------------------------------------------------------------

#: Kinds the rendered manifests hold that podman kube play (4.3) does not run, and what checks them.
NOT_PLAYED = {
    "Service": "not a kind podman plays (no cluster network); the pod is reached at its own address (schema test)",
    "HorizontalPodAutoscaler": "needs a cluster's metrics API (schema test; its metric is checked on /metrics)",
    "ServiceMonitor": "a Prometheus Operator resource (its selector is checked against the pods' labels)",
    "prometheus-adapter values": "Helm values (the PromQL is checked against Triton's metric names)",
    "Locust Deployments and Service": "in-cluster load generators; the smoke test runs the same Locust from the host",
}


def kube(args: argparse.Namespace, out: Path, check: Checks) -> None:
    repo, name = (Path(args.repo).resolve(), args.model) if args.repo else export_default(out)
    ctr.check_readable(repo)
    name, checkpoint, engine = llm_model(repo, name)
    expected = engine_answers(checkpoint, engine)
    manifests = out / "k8s"
    target, values = COMMITTED[KUBE_DIR]
    # the committed files themselves unless another image or model is asked for
    overrides = {
        k: v for k, v in (("image", args.image), ("model_name", name)) if v != getattr(DeployValues(**values), k)
    }
    overrides = {} if overrides == {"image": ctr.IMAGE} else overrides  # the same image, named in full
    render_deploy(target, manifests, **{**values, **overrides})
    source = f"{KUBE_DIR} as rendered with {overrides}" if overrides else f"{KUBE_DIR} as committed"
    played = [manifests / "model-repository-pvc.yaml", manifests / "deployment.yaml"]
    try:
        result = ctr.kube_play(played, repo)
        print(
            f"     podman kube play {' '.join(p.name for p in played)} ({source}): pod {result.pod}, "
            f"volumes {', '.join(result.volumes)}"
        )
        ip = ctr.pod_address(result.pod)
        ready_s = wait_ready(
            f"http://{ip}:8000{model_ready_path(name)}",
            READY_TIMEOUT_S,
            lambda: ctr.container_running(result.container),
        )
        if not check(ready_s is not None, f"pod {result.pod}: {name} ready in {ready_s or 0:.1f} s at {ip}"):
            print(ctr.logs(result.container))
            return
        spec = ctr.container_spec(result.container)
        check(spec["user"] == "1000:1000" or spec["user"].startswith("1000"), f"runs as {spec['user']}")
        check(spec["healthcheck"] is not None, f"livenessProbe played as the health check: {spec['healthcheck']}")
        check(*ctr.healthcheck(result.container, "the liveness probe"))
        check(
            spec["cpus"] > 0 and spec["memory_bytes"] > 0,
            f"resources played: {spec['cpus']:g} CPUs, {spec['memory_bytes'] / 2**30:.0f} GiB memory limit",
        )
        got = triton_generate(f"http://{ip}:8000", name, expected["prompt"], stream=True)
        check(got == expected["text"], f"the pod answers {got!r} == the in-process engine's greedy answer")
        status, _ = http(f"http://{ip}:8002/metrics")
        check(status == 200, f"the pod's metrics port answers /metrics (HTTP {status})")
    finally:
        ctr.kube_down(played)
        print(f"     podman kube down: pod and volumes of {manifests.name}/ removed")
    for kind, how in NOT_PLAYED.items():
        print(f"     not played: {kind}: {how}")


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    image = sub.add_parser("image", help="build the CPU image with podman (base image once, cached)")
    image.add_argument("--mirror", help="Debian mirror for the base image (default: the one apt uses)")
    image.add_argument("--rebuild-base", action="store_true", help="make the base image again")
    image.add_argument("--context", default=".", help="the repository root (build context; default .)")
    for name, text in (
        ("smoke", "run the image: requests through Triton and the OpenAI frontend, /metrics, Locust"),
        ("kube", "play deploy/k8s/cpu's PVC and Deployment with podman kube play and check the pod"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--repo", help="Triton model repository to mount (default: export SmolLM2-135M into --out)")
        p.add_argument("--model", help="the LLM of --repo (default: its only one)")
        p.add_argument("--out", default=f"reports/container-{name}", help="working and report directory")
        if name == "smoke":
            add_option(p, "--run-time", "30s", "Locust run time")
            add_option(p, "--users", 4, "Locust users")
            p.add_argument("--compare-host", action="store_true", help="also load `lmforge serve` on the host")
    for p in sub.choices.values():
        p.add_argument("--image", default=ctr.IMAGE, help=f"image tag (default {ctr.IMAGE})")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "action", None) is None:
        print("choose an action: image, smoke, kube")
        return 2
    if args.action == "image":
        return cmd_image(args)
    if not ctr.have_podman():
        raise ctr.ContainerError("podman is not installed", fix="run `make image` first")
    if not ctr.image_exists(args.image):
        raise ctr.ContainerError(f"no image {args.image}", fix="build it with `make image`")
    if args.action == "smoke":
        args.run_time_s = parse_duration(args.run_time)
    sys.stdout.reconfigure(line_buffering=True)  # check lines and load reports in order, also in a log
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    check = Checks()
    (smoke if args.action == "smoke" else kube)(args, out, check)
    print(f"{'all checks passed' if not check.failed else f'{check.failed} check(s) failed'} ({args.action})")
    return 1 if check.failed else 0
