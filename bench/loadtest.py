"""``lmforge loadtest``: Locust against a model on Triton, with exact percentiles and a report.

Checks the target first (host on 127.0.0.1, server ready, model ready, at least one user), runs
Locust headless in a child process (:mod:`bench.locust_runner`) bounded by a hard timeout, reads
back one raw sample per request and writes ``OUT/``:

* ``summary.json``: the configuration, the metrics of :func:`bench.metrics.summarize`, latency by
  concurrency, per-step figures and the goodput for ``--shape steps``, and the server's state;
* Locust's CSVs (``locust_stats.csv``, ``locust_stats_history.csv``, ``locust_failures.csv``,
  ``locust_exceptions.csv``) and ``samples.jsonl`` (the raw samples);
* PNG plots: TTFT and E2E CDFs, output tok/s over time, concurrency vs latency.

``--api openai`` sends the same load to an OpenAI-compatible server (``/v1/chat/completions``
or ``/v1/completions``, streamed): ours (``lmforge serve --openai-port``), ``vllm serve`` or
``llama-server``.

A server that stops answering mid-run ends the run early; the report keeps what was measured
and says so (``server.unreachable_during_run``), and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.harness import repo_root, run_process, url_ready
from bench.metrics import LoadStep, goodput, latency_by_concurrency, step_summaries, summarize
from bench.prompts import PromptError, load_prompts, render_chat, with_system_prompt
from bench.protocol import OPENAI_PATHS, openai_payload, request_payload
from bench.report import PLOT_FILES, format_table, plot_report, read_samples
from engine.checkpoint.outputs import LOADTEST_REPORT, check_output_dir
from engine.cli_options import add_config_option, add_option, config_fields
from engine.errors import LmforgeError, UsageError

LOCUST_PREFIX = "locust"
CHECK_TIMEOUT_S = 3.0
MAX_RUN_TIME_S = 6 * 3600.0
CHILD_GRACE_S = 60.0
PROMPTS_FILE = "prompts.jsonl"


class LoadTestError(LmforgeError, RuntimeError):
    """A load test that cannot start (bad input, server or model not there) or could not run."""


class LoadTestConfigError(LoadTestError, UsageError):
    """A ``LoadTestConfig`` field the user must change (exit status 2); still a ``LoadTestError``."""


@dataclass
class LoadTestConfig:
    """One load test. Durations in seconds; sampling fields as ``SamplingParams``.

    ``chat_template`` (a checkpoint) renders each prompt, after the optional system prompt, with
    that tokenizer's chat template before sending. ``shape="steps"`` raises users from ``users`` by ``step_users``
    every ``step_s`` seconds
    until TTFT p90 exceeds ``ttft_p90_bound_ms`` (or ``max_users`` / ``run_time_s`` is reached).
    ``warmup_requests`` non-streaming requests (``None``: one per user, sent together) go first
    and are not measured (GenAI-Perf's ``--warmup-request-count``): the first forward passes of
    a fresh engine, and of each new batch size, are slower.
    """

    host: str
    model: str
    users: int = 2
    spawn_rate: float = 2.0
    run_time_s: float = 60.0
    endpoint: str = "generate_stream"
    prompts: str | None = None
    num_prompts: int | None = None
    system_prompt: str | None = None
    chat_template: str | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = False
    seed: int = 0
    request_timeout_s: float = 120.0
    shape: str = "constant"
    step_users: int = 2
    step_s: float = 10.0
    max_users: int = 32
    ttft_p90_bound_ms: float = 1000.0
    warmup_requests: int | None = None
    api: str = "triton"  # or "openai": /v1/chat/completions (endpoint "chat") or /v1/completions
    api_key: str | None = None
    bad_share: float = 0.0
    disconnect_share: float = 0.0
    keep_going: bool = False
    lora_names: list[str] = field(default_factory=list)  # request i runs with adapter i mod N
    response_format: dict | None = None  # api "openai": every request's response_format (structured output)
    record_text: bool = False  # keep each request's output text in samples.jsonl

    def __post_init__(self) -> None:
        if self.api == "openai" and self.endpoint == "generate_stream":
            self.endpoint = "chat"  # the OpenAI API's default endpoint

    @property
    def system_message(self) -> bool:
        """Whether the system prompt goes as a system message (OpenAI chat, no ``chat_template``)
        rather than in front of every prompt."""
        return bool(self.system_prompt) and self.api == "openai" and self.endpoint == "chat" and not self.chat_template

    def validate(self) -> None:
        """Raises :class:`LoadTestError` naming the bad field and the fix."""
        checks = [
            (self.users >= 1, f"users={self.users}; at least 1 user is needed (--users)"),
            (self.spawn_rate > 0, f"spawn_rate={self.spawn_rate}; it must be > 0 (--spawn-rate)"),
            (
                0 < self.run_time_s <= MAX_RUN_TIME_S,
                f"run_time_s={self.run_time_s}; it must be in (0, {MAX_RUN_TIME_S:.0f}] (--run-time)",
            ),
            (self.max_tokens >= 1, f"max_tokens={self.max_tokens}; it must be >= 1 (--max-tokens)"),
            (self.request_timeout_s > 0, f"request_timeout_s={self.request_timeout_s}; it must be > 0"),
            (
                self.warmup_requests is None or self.warmup_requests >= 0,
                f"warmup_requests={self.warmup_requests}; it must be >= 0 (--warmup-requests)",
            ),
            (self.api in ("triton", "openai"), f"api={self.api!r}; use triton or openai (--api)"),
            (
                self.endpoint in (("chat", "completions") if self.api == "openai" else ("generate_stream", "generate")),
                f"endpoint={self.endpoint!r}; use "
                f"{'chat or completions' if self.api == 'openai' else 'generate_stream or generate'} with "
                f"--api {self.api}",
            ),
            (
                not (self.api == "openai" and self.endpoint == "chat" and self.chat_template),
                "--chat-template with --api openai --endpoint chat: the server applies its own template; drop it",
            ),
            (self.shape in ("constant", "steps"), f"shape={self.shape!r}; use constant or steps (--shape)"),
            (bool(self.model), "model is empty; pass the Triton model name (--model)"),
            (
                self.response_format is None or self.api == "openai",
                "--response-format (response_format) is an OpenAI API field; add --api openai or drop it",
            ),
        ]
        if self.shape == "steps":
            checks += [
                (
                    self.step_users >= 1 and self.step_s > 0,
                    f"step_users={self.step_users}, step_s={self.step_s}; both must be positive",
                ),
                (self.max_users >= self.users, f"max_users={self.max_users} < users={self.users}; raise --max-users"),
                (self.ttft_p90_bound_ms > 0, f"ttft_p90_bound_ms={self.ttft_p90_bound_ms}; it must be > 0"),
            ]
        for ok, message in checks:
            if not ok:
                raise LoadTestConfigError(message)
        check_host(self.host)


def parse_duration(text: str) -> float:
    """Seconds from ``"60"``, ``"60s"``, ``"2m"``, ``"1h"`` or ``"1m30s"`` (Locust's ``--run-time`` style).

    Raises:
        LoadTestError: anything else.
    """
    text = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", text)
    if not text or parts is None:
        raise LoadTestConfigError(f"run time {text!r} is not a duration; write e.g. 60s, 2m or 1m30s")
    hours, minutes, seconds = (float(p) if p else 0.0 for p in parts.groups())
    return hours * 3600 + minutes * 60 + seconds


def check_host(host: str) -> str:
    """The host URL without a trailing slash; only ``http://127.0.0.1:PORT`` is accepted.

    Raises:
        LoadTestError: another scheme or address, or no port.
    """
    parsed = urllib.parse.urlparse(host)
    try:
        port = parsed.port
    except ValueError as exc:  # not a number, or out of 0-65535
        raise LoadTestConfigError(f"host {host!r}: the port is not a number in 1-65535") from exc
    if parsed.scheme != "http" or parsed.hostname != "127.0.0.1" or not port:
        raise LoadTestConfigError(f"host {host!r}: load is only sent to http://127.0.0.1:PORT (the server's HTTP port)")
    return f"http://127.0.0.1:{parsed.port}"


def _get(url: str, timeout_s: float = CHECK_TIMEOUT_S, headers: dict | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def server_ready(host: str, api: str = "triton") -> bool:
    """Whether ``/v2/health/ready`` (``/health`` for the OpenAI API) answers 200 within a few seconds."""
    return url_ready(f"{host}/health" if api == "openai" else f"{host}/v2/health/ready", CHECK_TIMEOUT_S)


def preflight(config: LoadTestConfig) -> None:
    """Check everything before any load is sent.

    Raises:
        LoadTestError: invalid settings, prompts that cannot be read, a server that does not
            answer, or a model that is not ready (with the models the server has).
    """
    config.validate()
    host = check_host(config.host)
    try:
        load_prompts(config.prompts, limit=config.num_prompts)
    except PromptError as exc:
        raise LoadTestError(str(exc)) from exc
    if config.api == "openai":
        _preflight_openai(config, host)
        return
    try:
        status, _ = _get(f"{host}/v2/health/ready")
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise LoadTestError(
            f"cannot reach a Triton server at {host} ({reason}); start one with "
            "`lmforge serve --repo model_repository` or fix --host"
        ) from exc
    model_url = f"{host}/v2/models/{urllib.parse.quote(config.model)}/ready"
    model_status, body = _get(model_url, headers=_auth_headers(config))
    if model_status in (401, 403):
        raise LoadTestError(f"GET {model_url}: {_http_error(config, model_status, body)}")
    if status != 200 and model_status != 200:
        raise LoadTestError(f"the server at {host} is not ready (/v2/health/ready: HTTP {status})")
    if model_status != 200:  # (the server may be "not ready" only because another model failed to load)
        raise LoadTestError(
            f"model {config.model!r} is not ready on {host}; models there: {_models(host, config)}; fix --model"
        )


def _auth_headers(config: LoadTestConfig) -> dict:
    """``Authorization: Bearer KEY`` (``--api-key``): what our OpenAI frontend, ``vllm serve`` and a Triton
    served with ``lmforge serve --api-key`` (its restricted APIs) check; empty without a key."""
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


def _http_error(config: LoadTestConfig, code: int, body: bytes) -> str:
    """The text of an HTTP error answer; a 401 or 403 says how to pass the API key the server wants."""
    text = f"HTTP {code}: {body[:300]!r}"
    if code in (401, 403):
        fix = "check --api-key (the key the server was started with)" if config.api_key else "pass --api-key KEY"
        text += f"; the server wants an API key: {fix}"
    return text


def _preflight_openai(config: LoadTestConfig, host: str) -> None:
    """``GET /health`` answers 200 and ``GET /v1/models`` lists ``config.model``."""
    try:
        status, _ = _get(f"{host}/health")
    except (urllib.error.URLError, OSError) as exc:
        raise LoadTestError(
            f"cannot reach an OpenAI-compatible server at {host} ({getattr(exc, 'reason', exc)}); "
            "start one (`lmforge serve --openai-port PORT`, `vllm serve`, `llama-server`) or fix --host"
        ) from exc
    if status != 200:
        raise LoadTestError(f"the server at {host} is not ready (/health: HTTP {status})")
    request = urllib.request.Request(f"{host}/v1/models", headers=_auth_headers(config))
    try:
        with urllib.request.urlopen(request, timeout=CHECK_TIMEOUT_S) as response:
            ids = [m.get("id") for m in json.loads(response.read()).get("data", [])]
    except urllib.error.HTTPError as exc:
        raise LoadTestError(f"GET {host}/v1/models: {_http_error(config, exc.code, exc.read())}") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise LoadTestError(f"GET {host}/v1/models failed ({exc})") from exc
    if config.model not in ids:
        raise LoadTestError(
            f"model {config.model!r} is not served at {host}; models there: "
            f"{', '.join(map(str, ids)) or 'none'}; fix --model"
        )
    missing = [name for name in config.lora_names if name not in ids]
    if missing:
        raise LoadTestError(
            f"LoRA adapter(s) {missing} are not served at {host}; models there: {', '.join(map(str, ids))}; load "
            "them (POST /v1/load_lora_adapter) or fix --lora-names"
        )


def _models(host: str, config: LoadTestConfig) -> str:
    """Names and states from the repository index, for error messages."""
    try:
        request = urllib.request.Request(
            f"{host}/v2/repository/index", data=b"{}", method="POST", headers=_auth_headers(config)
        )
        with urllib.request.urlopen(request, timeout=CHECK_TIMEOUT_S) as response:
            index = json.loads(response.read())
        return ", ".join(f"{m.get('name')} ({m.get('state', 'unknown')})" for m in index) or "none"
    except (urllib.error.URLError, OSError, ValueError):
        return "unknown (repository index not available)"


def resolve_prompts(config: LoadTestConfig) -> list[str]:
    """The prompts of the run, resolved once (source, limit, system prompt, chat template).

    Raises:
        LoadTestError: the prompts or the chat template cannot be read.
    """
    try:
        prompts = load_prompts(config.prompts, limit=config.num_prompts)
        if config.chat_template is not None:
            prompts = render_chat(prompts, config.chat_template, config.system_prompt)
        elif not config.system_message:
            prompts = with_system_prompt(prompts, config.system_prompt)
    except PromptError as exc:
        raise LoadTestError(str(exc)) from exc
    return prompts


def write_prompts(prompts: list[str], path: Path) -> None:
    """Write ``prompts`` to ``path`` as JSONL ``{"prompt"}`` records: all the load generator reads."""
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts), encoding="utf-8")


def warm_up(config: LoadTestConfig, prompts: list[str]) -> None:
    """Send ``config.warmup_requests`` unmeasured requests to ``/generate``, up to ``users`` at once.

    Concurrent, like the run, so the engine has already seen the batch sizes of the run (the
    first forward pass at a new shape is slow on CPU).

    Raises:
        LoadTestError: a warm-up request failed (the server's error is in the message), so a
            model that cannot answer is reported before the run.
    """
    count = config.users if config.warmup_requests is None else config.warmup_requests
    if count == 0:
        return
    count = max(count, len(config.lora_names))  # every adapter answers once (an unknown one fails here)
    with ThreadPoolExecutor(max_workers=max(1, min(config.users, count))) as pool:
        errors = [e for e in pool.map(lambda i: _warm_up_one(config, prompts[i % len(prompts)], i), range(count)) if e]
    if errors:
        raise LoadTestError(f"warm-up request to {config.model} failed: {errors[0]}")


def _warm_up_one(config: LoadTestConfig, prompt: str, index: int = 0) -> str | None:
    """One blocking ``/generate`` request (adapter ``index`` mod N of ``lora_names``); the error text, or ``None``."""
    sampling = {"max_tokens": config.max_tokens, "temperature": config.temperature, "top_p": config.top_p}
    if config.response_format is not None:
        sampling["response_format"] = config.response_format
    lora = config.lora_names[index % len(config.lora_names)] if config.lora_names else None
    if lora is not None and config.api != "openai":
        sampling["lora_name"] = lora
    if config.api == "openai":
        url = f"{check_host(config.host)}{OPENAI_PATHS[config.endpoint]}"
        body = json.dumps(
            openai_payload(
                prompt,
                sampling,
                model=lora or config.model,
                endpoint=config.endpoint,
                stream=False,
                system=config.system_prompt if config.system_message else None,
            )
        ).encode()
    else:
        url = f"{check_host(config.host)}/v2/models/{urllib.parse.quote(config.model)}/generate"
        body = json.dumps(request_payload(prompt, sampling, stream=False)).encode()
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json", **_auth_headers(config)}
    )
    try:
        with urllib.request.urlopen(request, timeout=config.request_timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        return _http_error(config, exc.code, exc.read())
    except (urllib.error.URLError, OSError) as exc:
        return str(exc)
    return None


def _child_command(config: LoadTestConfig, out_dir: Path) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "bench.locust_runner",
        "--host",
        check_host(config.host),
        "--users",
        str(config.users),
        "--spawn-rate",
        str(config.spawn_rate),
        "--run-time-s",
        str(config.run_time_s),
        "--csv-prefix",
        str(out_dir / LOCUST_PREFIX),
        "--shape",
        config.shape,
        "--model",
        config.model,
        "--endpoint",
        config.endpoint,
        "--max-tokens",
        str(config.max_tokens),
        "--temperature",
        str(config.temperature),
        "--top-p",
        str(config.top_p),
        "--seed",
        str(config.seed),
        "--request-timeout-s",
        str(config.request_timeout_s),
        "--samples-out",
        str(out_dir / "samples.jsonl"),
    ]
    command += ["--prompts", str(out_dir / PROMPTS_FILE)]  # resolved by the parent (write_prompts)
    if config.system_message:
        command += ["--system-prompt", config.system_prompt]
    command += ["--api", config.api]
    if config.api_key:
        command += ["--api-key", config.api_key]
    if config.ignore_eos:
        command.append("--ignore-eos")
    if config.bad_share or config.disconnect_share:
        command += ["--bad-share", str(config.bad_share), "--disconnect-share", str(config.disconnect_share)]
    if config.keep_going:
        command.append("--keep-going")
    if config.lora_names:
        command += ["--lora-names", ",".join(config.lora_names)]
    if config.response_format is not None:
        command += ["--response-format", json.dumps(config.response_format)]
    if config.record_text:
        command.append("--record-text")
    if config.shape == "steps":
        command += [
            "--shape-config",
            json.dumps(
                {
                    "start_users": config.users,
                    "step_users": config.step_users,
                    "step_s": config.step_s,
                    "max_users": config.max_users,
                    "ttft_p90_bound_ms": config.ttft_p90_bound_ms,
                    "spawn_rate": config.spawn_rate,
                }
            ),
        ]
    return command


def run_loadtest(config: LoadTestConfig, out_dir: str | Path, *, log=print) -> dict:
    """Run one load test and write its report directory; returns the summary (``summary.json``).

    Nothing is written before the checks and the warm-up pass, so a refused run leaves no files.

    Raises:
        LoadTestError: from :func:`preflight` (nothing was sent) or :func:`warm_up`, or the load
            generator could not start at all.
        OutputDirError: ``out_dir`` is unsafe to write (``engine.checkpoint.outputs.check_output_dir``).
    """
    # absolute: the load generator runs in another working directory
    out = check_output_dir(out_dir, kind=LOADTEST_REPORT, sources=(config.prompts,) if config.prompts else ())
    preflight(config)
    prompts = resolve_prompts(config)
    warm_up(config, prompts)
    out.mkdir(parents=True, exist_ok=True)
    write_prompts(prompts, out / PROMPTS_FILE)
    (out / "samples.jsonl").unlink(missing_ok=True)
    log(
        f"load test: {config.users} users ({config.shape}) on {config.model} at {config.host}, "
        f"{config.run_time_s:g} s ..."
    )
    started = time.time()
    child_log = out / "locust.log"
    timeout_s = config.run_time_s + config.request_timeout_s + CHILD_GRACE_S
    note = None
    with child_log.open("w", encoding="utf-8") as handle:
        child = run_process(
            _child_command(config, out), timeout_s, cwd=repo_root(), stdout=handle, stderr=subprocess.STDOUT
        )
    if child.timed_out:
        note = f"the load generator did not finish within {timeout_s:.0f} s and was killed; see {child_log}"
    elif child.returncode != 0:
        note = f"the load generator exited with status {child.returncode}; see {child_log}"
    samples, records = read_samples(out / "samples.jsonl")
    if not samples and note is not None:
        raise LoadTestError(f"no requests were measured: {note}")
    summary = build_summary(config, samples, records, out, started=started, note=note)
    plot_report(samples, out, title=config.model)
    (out / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    return summary


def build_summary(
    config: LoadTestConfig, samples, records: list[dict], out: Path, *, started: float, note: str | None
) -> dict:
    """The content of ``summary.json`` (see the module docstring)."""
    unreachable = next((r["error"] for r in records if r["kind"] == "server_unreachable"), None)
    summary = {
        "config": asdict(config),
        "started_at_s": started,
        "metrics": summarize(samples),
        "by_concurrency": latency_by_concurrency(samples),
        "server": {
            "unreachable_during_run": unreachable,
            "ready_after_run": server_ready(check_host(config.host), config.api),
        },
        "notes": [n for n in (note,) if n],
        "files": sorted([p.name for p in out.glob(f"{LOCUST_PREFIX}_*.csv")] + ["samples.jsonl", *PLOT_FILES]),
    }
    if unreachable or not summary["server"]["ready_after_run"]:
        summary["notes"].append(
            "the server stopped answering during the run; the figures cover what was measured before"
        )
    if config.shape == "steps":
        summary.update(_steps_summary(config, samples, records, out))
    return summary


def _steps_summary(config: LoadTestConfig, samples, records: list[dict], out: Path) -> dict:
    """Steps from the shape's own file (written at the end of the run), else from the samples
    file's step records (a load generator that was killed)."""
    run_end = max([s.end_s for s in samples], default=time.time())
    shape_file = out / f"{LOCUST_PREFIX}_shape.json"
    if shape_file.is_file():
        shape = json.loads(shape_file.read_text(encoding="utf-8"))
        starts, stop = shape["steps"], shape.get("stop_reason")
    else:
        starts = [r for r in records if r["kind"] == "step"]
        stop = next((r.get("reason") for r in records if r["kind"] == "shape_stop"), None)
    steps = [
        LoadStep(
            r["users"], r["start_s"], r.get("end_s") or (starts[i + 1]["start_s"] if i + 1 < len(starts) else run_end)
        )
        for i, r in enumerate(starts)
    ]
    rows = step_summaries(samples, steps, config.ttft_p90_bound_ms)
    return {
        "steps": rows,
        "goodput": goodput(rows),
        "ttft_p90_bound_ms": config.ttft_p90_bound_ms,
        "stop_reason": stop or "run time reached",
    }


def format_report(summary: dict) -> str:
    """The table, step results and notes as printed at the end of ``lmforge loadtest``."""
    lines = [format_table(summary["metrics"])]
    if "steps" in summary:
        lines.append(f"  steps (TTFT p90 bound {summary['ttft_p90_bound_ms']:g} ms):")
        for row in summary["steps"]:
            p90 = "-" if row["ttft_p90_ms"] is None else f"{row['ttft_p90_ms']:.0f}"
            tok_s = "-" if row["output_throughput_tok_s"] is None else f"{row['output_throughput_tok_s']:.1f}"
            lines.append(
                f"    {row['users']:>3} users: {tok_s} tok/s, TTFT p90 {p90} ms, "
                f"{'meets' if row['meets_slo'] else 'misses'} the bound"
            )
        best = summary["goodput"]
        lines.append(
            f"  goodput: {best['output_throughput_tok_s']:.1f} tok/s at {best['users']} users"
            if best
            else "  goodput: no step met the bound"
        )
        lines.append(f"  stopped: {summary['stop_reason']}")
    for name, count in summary["metrics"]["errors"].items():
        lines.append(f"  error x{count}: {name}")
    lines += [f"  note: {n}" for n in summary["notes"]]
    return "\n".join(lines)


def add_request_options(parser) -> None:
    """The options that shape every request: prompts and ``SamplingParams`` fields, defaults from
    :class:`LoadTestConfig`. ``parser`` is an ``argparse.ArgumentParser`` or one of its groups:
    ``lmforge loadtest`` takes them and passes them on to the locustfile, which takes them too."""
    d = LoadTestConfig(host="", model="")
    add_config_option(parser, d, "prompts", "JSONL of prompts (default: the held-out chatterbot dialogs)")
    add_config_option(parser, d, "num_prompts", "use only the first N prompts", type=int)
    add_config_option(
        parser,
        d,
        "system_prompt",
        "shared prefix put before every prompt (prefix reuse); openai chat: a system message",
    )
    add_config_option(parser, d, "max_tokens", "SamplingParams.max_tokens (default %(default)s)")
    add_config_option(parser, d, "temperature", "SamplingParams.temperature (0 = greedy)")
    add_config_option(parser, d, "top_p", "SamplingParams.top_p")
    add_config_option(parser, d, "ignore_eos", "always generate max_tokens (fixed output length)", action="store_true")
    add_config_option(parser, d, "seed", "prompt order and sampling seed")
    add_config_option(parser, d, "request_timeout_s", "read timeout per request")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = LoadTestConfig(host="", model="")
    parser.add_argument("--host", required=True, help="server HTTP endpoint, http://127.0.0.1:PORT")
    parser.add_argument("--model", required=True, help="the model name (Triton's, or the OpenAI server's)")
    add_config_option(
        parser,
        d,
        "api",
        "triton: generate extension; openai: /v1/chat/completions or /v1/completions (ours, vllm serve, llama-server)",
        choices=["triton", "openai"],
    )
    add_config_option(
        parser, d, "api_key", "send `Authorization: Bearer KEY` (a server started with --api-key; Triton or OpenAI API)"
    )
    add_config_option(parser, d, "users", "concurrent users (start users for --shape steps)")
    add_config_option(parser, d, "spawn_rate", "users started per second")
    parser.add_argument("--run-time", default="60s", help="duration, e.g. 60s, 2m (an upper bound for --shape steps)")
    add_config_option(
        parser,
        d,
        "shape",
        "steps: add users until TTFT p90 passes --ttft-p90-bound-ms, report goodput",
        choices=["constant", "steps"],
    )
    add_config_option(parser, d, "step_users", "users added per step")
    parser.add_argument("--step-time", default="10s", help="duration of each step")
    add_config_option(parser, d, "max_users", "stop stepping at this many users")
    add_config_option(parser, d, "ttft_p90_bound_ms", "latency objective for goodput")
    parser.add_argument(
        "--endpoint",
        choices=["generate_stream", "generate", "chat", "completions"],
        default=None,
        help="triton: generate_stream (default) or generate; openai: chat (default) or completions",
    )
    add_request_options(parser)
    add_config_option(
        parser,
        d,
        "chat_template",
        "render prompts with this checkpoint's chat template (instruct models)",
        metavar="CKPT",
    )
    add_config_option(
        parser,
        d,
        "warmup_requests",
        "unmeasured requests sent first, up to --users at once (default: one per user)",
        type=int,
    )
    parser.add_argument(
        "--lora-names",
        default=None,
        help="comma-separated LoRA adapters the requests are spread over: request i runs with the (i mod N)-th "
        "(openai: as the model field; triton: sampling_parameters lora_name)",
    )
    parser.add_argument(
        "--response-format",
        default=None,
        metavar="JSON|@FILE",
        help="--api openai: every request's response_format (structured output), as JSON or @file.json",
    )
    add_option(parser, "--out", "reports/loadtest", "report directory")


#: The OpenAI ``response_format`` types ``--response-format`` accepts.
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def parse_response_format(text: str | None) -> dict | None:
    """The OpenAI ``response_format`` object of ``--response-format``: inline JSON, or ``@PATH`` of a JSON file.

    Raises:
        LoadTestConfigError: a missing file, text that is not JSON, or JSON that is not an object
            with a ``type``.
    """
    if text is None:
        return None
    source = "--response-format"
    if text.startswith("@"):
        path = Path(text[1:])
        source = f"--response-format file {path}"
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise LoadTestConfigError(f"{source}: cannot read it ({exc.strerror}); pass an existing JSON file") from exc
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LoadTestConfigError(
            f"{source} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); pass an object such "
            'as \'{"type": "json_object"}\' or @file.json'
        ) from exc
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMAT_TYPES:
        raise LoadTestConfigError(
            f'{source} must be a JSON object with a "type" (text, json_object or json_schema), '
            f"got {json.dumps(value)[:80]}"
        )
    if value["type"] == "json_schema" and not isinstance(value.get("json_schema"), dict):
        raise LoadTestConfigError(
            f'{source}: type "json_schema" needs a "json_schema" object (its "name" and "schema"), as OpenAI\'s '
            'API takes it: {"type": "json_schema", "json_schema": {"name": "x", "schema": {...}}}'
        )
    return value


def config_from_args(args: argparse.Namespace) -> LoadTestConfig:
    """Raises :class:`LoadTestError` for a run time that is not a duration or a bad ``--response-format``."""
    return LoadTestConfig(
        **config_fields(
            LoadTestConfig,
            args,
            run_time_s=parse_duration(args.run_time),
            endpoint=args.endpoint or ("chat" if args.api == "openai" else "generate_stream"),
            step_s=parse_duration(args.step_time),
            lora_names=[n.strip() for n in (args.lora_names or "").split(",") if n.strip()],
            response_format=parse_response_format(args.response_format),
        )
    )


def run(args: argparse.Namespace) -> int:
    summary = run_loadtest(config_from_args(args), args.out)
    print(format_report(summary))
    print(f"report: {Path(args.out).resolve()}")
    server_lost = summary["server"]["unreachable_during_run"] or not summary["server"]["ready_after_run"]
    return 1 if server_lost or summary["metrics"]["successful"] == 0 else 0
