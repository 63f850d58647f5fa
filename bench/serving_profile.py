"""``lmforge bench serving-profile``: where a streamed token's CPU goes on the served path.

    lmforge bench serving-profile [--api openai|triton] [--streams 16 64] [--requests-per-stream 3]
                                  [--dtype bfloat16] [--py-spy] [--out reports/serving-profile]

Exports the checkpoint into a temporary repository, starts ``tritonserver`` and (for
``--api openai``) the OpenAI frontend, and sends the shared-system-prompt chat load
(:func:`chat_load`: a ~150-token system prompt shared by every request and a distinct ~100-token
user turn, ``--max-tokens`` greedy tokens with EOS ignored) from ``--streams`` concurrent
closed-loop streams of an asyncio client in this process. Over the measured window it reads the
CPU time (``/proc/PID/stat`` user + system) of every process on the path: ``tritonserver``, the
model's Python-backend stub (split by thread: the engine's step thread, the torch compute
threads, the event loop that sends responses, the rest), the frontend and the client itself,
and reports CPU-seconds per 1,000 streamed tokens next to tok/s, TTFT p99 and ITL p50. CPU
seconds per token are far less sensitive than wall time to other processes sharing the cores.

Messages per token are counted at each hop: the engine makes one output per request per step
(one per token without speculative decoding), the model's responses (``lmforge_responses_total``:
one Triton IPC round trip and one gRPC or HTTP message each), and server-sent events at the
client.

``--py-spy`` runs each level a second time with ``py-spy record`` (``--idle --native``) on the
stub and the frontend and splits their samples into stages (model forward, scheduling,
sampling, detokenization, sending responses, waiting for the GIL, gRPC, SSE encoding...), so
the clean run's CPU figures are not biased by the profiler.

``OUT/`` gets ``profile.json`` and ``profile.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.metrics import RequestSample, summarize
from bench.workload import system_prompt, user_turns
from deploy.serve import start_openai, stop_openai
from deploy.triton import TritonServer, free_ports
from engine.cli_options import add_option

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
USER_TURN_TOKENS = 100
#: py-spy sampling rate (Hz) of the profiled pass.
PY_SPY_RATE_HZ = 97


# --------------------------------------------------------------------------------------------
# The load
# --------------------------------------------------------------------------------------------


def chat_load(tokenizer, num_requests: int, user_tokens: int = USER_TURN_TOKENS) -> list[list[dict]]:
    """``num_requests`` chat conversations: the shared system prompt + a distinct user turn of
    about ``user_tokens`` tokens (:func:`bench.workload.user_turns`)."""
    return [
        [{"role": "system", "content": system_prompt(0)}, {"role": "user", "content": turn}]
        for turn in user_turns(tokenizer, num_requests, user_tokens)
    ]


def render(tokenizer, conversation: list[dict]) -> str:
    return tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)


# --------------------------------------------------------------------------------------------
# CPU time from /proc
# --------------------------------------------------------------------------------------------


def _stat_fields(path: str) -> tuple[str, list[str]]:
    text = Path(path).read_text()
    close = text.rindex(")")
    return text[text.index("(") + 1 : close], text[close + 2 :].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), in seconds."""
    _, rest = _stat_fields(f"/proc/{pid}/stat")
    return (int(rest[11]) + int(rest[12])) / CLOCK_TICKS


def thread_cpu_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """Per thread of ``pid``: ``tid -> (comm, user + system seconds)``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm, rest = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue
        out[int(tid)] = (comm, (int(rest[11]) + int(rest[12])) / CLOCK_TICKS)
    return out


def python_thread_names(pid: int) -> dict[int, str]:
    """``os thread id -> Python thread name`` of a Python process (``py-spy dump``); {} without py-spy."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    try:
        dump = subprocess.run(
            [py_spy, "dump", "--json", "--pid", str(pid)], capture_output=True, text=True, timeout=60, check=True
        )
        return {int(t["os_thread_id"]): t.get("thread_name") or "?" for t in json.loads(dump.stdout)}
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError):
        return {}


#: Python thread names of the model stub -> the role shown in the profile.
STUB_THREAD_ROLES = {
    "lmforge-engine": "engine step thread (Python)",
    "lmforge-engine-loop": "response loop thread",
    "lmforge-stats": "stats thread",
    "MainThread": "stub main thread (Triton IPC)",
}


@dataclass
class CpuSnapshot:
    processes: dict[str, float]
    stub_threads: dict[int, tuple[str, float]]


class CpuMeter:
    """CPU seconds of the served path's processes between two snapshots."""

    def __init__(self, pids: dict[str, int | None], stub_pid: int | None) -> None:
        self.pids = {k: v for k, v in pids.items() if v is not None}
        self.stub_pid = stub_pid
        self.thread_names = python_thread_names(stub_pid) if stub_pid else {}

    def snapshot(self) -> CpuSnapshot:
        processes = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        processes["client (this process)"] = sum(os.times()[:2])
        threads = thread_cpu_seconds(self.stub_pid) if self.stub_pid else {}
        return CpuSnapshot(processes, threads)

    def delta(self, before: CpuSnapshot, after: CpuSnapshot) -> tuple[dict[str, float], dict[str, float]]:
        """``(per process seconds, per stub thread role seconds)``; threads without a Python name
        are the torch compute pool (OpenMP) and Triton's own stub threads."""
        processes = {k: after.processes[k] - before.processes.get(k, 0.0) for k in after.processes}
        roles: dict[str, float] = collections.defaultdict(float)
        for tid, (comm, seconds) in after.stub_threads.items():
            spent = seconds - before.stub_threads.get(tid, (comm, 0.0))[1]
            name = self.thread_names.get(tid)
            role = STUB_THREAD_ROLES.get(name, f"python thread {name}") if name else "native threads (torch compute)"
            roles[role] += spent
        return processes, dict(roles)


# --------------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------------


@dataclass
class StreamCount:
    events: int = 0
    text_events: int = 0
    cached_tokens: int | None = None
    texts: list[str] = field(default_factory=list)


async def _stream_events(session, url: str, body: dict, sample: RequestSample, count: StreamCount):
    """Yield the JSON events of one streamed POST; an HTTP or in-stream error goes to ``sample.error``."""
    async with session.post(url, json=body) as response:
        if response.status != 200:
            sample.error = f"HTTP {response.status}: {(await response.text())[:200]}"
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            count.events += 1
            if "error" in event:
                sample.error = str(event["error"])[:200]
                continue
            yield event


async def _openai_request(session, url: str, model: str, conversation: list[dict], max_tokens: int, count):
    body = {
        "model": model,
        "messages": conversation,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start_wall, start = time.time(), time.perf_counter()
    sample = RequestSample(start_s=start_wall, e2e_s=0.0, endpoint="chat")
    times = []
    async for event in _stream_events(session, url, body, sample, count):
        for choice in event.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text:
                count.text_events += 1
                times.append(time.perf_counter())
            if choice.get("finish_reason"):
                sample.finish_reason = choice["finish_reason"]
        usage = event.get("usage")
        if usage:
            sample.input_tokens = usage.get("prompt_tokens")
            sample.output_tokens = usage.get("completion_tokens") or 0
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                count.cached_tokens = (count.cached_tokens or 0) + details["cached_tokens"]
    return _finish(sample, start, times)


async def _triton_request(session, url: str, prompt: str, max_tokens: int, count):
    params = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
    body = {"text_input": prompt, "stream": True, "sampling_parameters": json.dumps(params)}
    start_wall, start = time.time(), time.perf_counter()
    sample = RequestSample(start_s=start_wall, e2e_s=0.0, endpoint="generate_stream")
    times = []
    async for event in _stream_events(session, url, body, sample, count):
        if event.get("text_output"):
            count.text_events += 1
            times.append(time.perf_counter())
        sample.output_tokens = event.get("num_output_tokens", sample.output_tokens)
        sample.input_tokens = event.get("num_input_tokens", sample.input_tokens)
        if event.get("num_cached_tokens") is not None and event.get("finish_reason"):
            count.cached_tokens = (count.cached_tokens or 0) + int(event["num_cached_tokens"])
        if event.get("finish_reason"):
            sample.finish_reason = event["finish_reason"]
    return _finish(sample, start, times)


def _finish(sample: RequestSample, start: float, times: list[float]) -> RequestSample:
    sample.e2e_s = time.perf_counter() - start
    if times:
        sample.ttft_s = times[0] - start
        sample.itl_s = [b - a for a, b in zip(times, times[1:])]
    if sample.error is None and sample.finish_reason is None:
        sample.error = "stream ended without a finish_reason"
    return sample


async def run_streams(
    target: dict, conversations: list, prompts: list[str], streams: int, per_stream: int, max_tokens, first: int = 0
):
    """``streams`` closed-loop streams, ``per_stream`` requests each, on the prompts from index ``first`` on;
    returns (samples, counts, wall s)."""
    # optional or heavy dependency: imported only on the path that needs it
    import aiohttp

    count = StreamCount()
    connector = aiohttp.TCPConnector(limit=streams)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as session:

        async def stream(s: int) -> list[RequestSample]:
            out = []
            for r in range(per_stream):
                i = (first + s * per_stream + r) % len(conversations)
                if target["api"] == "openai":
                    out.append(
                        await _openai_request(
                            session, target["url"], target["model"], conversations[i], max_tokens, count
                        )
                    )
                else:
                    out.append(await _triton_request(session, target["url"], prompts[i], max_tokens, count))
            return out

        start = time.perf_counter()
        results = await asyncio.gather(*(stream(s) for s in range(streams)))
        wall = time.perf_counter() - start
    return [s for r in results for s in r], count, wall


# --------------------------------------------------------------------------------------------
# py-spy stages
# --------------------------------------------------------------------------------------------

#: (stage, regex on one frame "function (file)") checked from the leaf up; the first hit names the
#: sample's stage. Order matters: the innermost recognisable frame wins.
STAGE_RULES: list[tuple[str, str]] = [
    ("model forward", r"\.execute \(engine/model_runner|\.forward \(engine/|engine/attention|engine/cpu_ops"),
    ("sampling", r"engine/sampler"),
    ("detokenization", r"engine/detokenizer"),
    ("scheduling + KV blocks", r"engine/scheduler|engine/block_manager"),
    ("engine outputs (RequestOutput, hand-over)", r"_group_outputs|\._output \(engine/llm_engine|_deliver|_put_all"),
    ("engine step (other)", r"\.step \(engine/llm_engine|_process_tokens|_process_token"),
    ("response tensors + send", r"_output_tensors|_send_output|_send_error|\._close \(deploy"),
    ("cancel polling", r"_watch_cancel|CancelWatch|is_cancelled"),
    ("metrics / stats", r"update_stats|_publish_stats|\._set \(deploy"),
    ("gRPC receive", r"grpc|_piece|as_numpy|tritonclient|protobuf|\._pump \(deploy|drain"),
    ("SSE / JSON encode", r"\.chunk \(deploy|\.render \(deploy|\.sse \(deploy|coalesce|json/encoder|orjson|dumps"),
    ("HTTP server (uvicorn/starlette)", r"uvicorn|starlette|h11|httptools|fastapi|anyio"),
    ("request parse + tokenize", r"model_validate|pydantic|make_plan|apply_chat_template|tokeniz|jinja"),
    ("asyncio event loop", r"asyncio|base_events|selectors|uvloop|_run_once|task_step"),
]
#: A sample whose leaf is one of these waits is not running: waiting for the GIL, for Triton (a
#: response or cancel-poll round trip: the stub waits on an interprocess condition), or idle.
GIL_WAIT = r"take_gil|gil_scoped_acquire|PyEval_RestoreThread|PyEval_AcquireThread|PyGILState_Ensure"
BLOCKING = (
    r"pthread_cond_|epoll_p?wait|\bselect \(|\bpoll \(|nanosleep|futex|sem_wait|__lll_lock_wait|PyThread_acquire_lock"
)
TRITON_WAIT = {
    "_send_output": "waiting for Triton: response send",
    "_send_error": "waiting for Triton: response send",
    "_watch_cancel": "waiting for Triton: cancel poll",
    "CancelWatch": "waiting for Triton: cancel poll",
}


def classify(stack: str) -> str:
    """The stage of one sampled stack (``;``-joined frames, root first)."""
    frames = stack.split(";")
    leaf = ";".join(frames[-4:])
    if re.search(GIL_WAIT, stack):
        return "waiting for the GIL"
    if re.search(BLOCKING, leaf):
        python = [f for f in frames if ".py:" in f]
        caller = python[-1] if python else ""
        for name, stage in TRITON_WAIT.items():
            if name in caller:
                return stage
        return "idle (blocked: no work)"
    for frame in reversed(frames):
        for stage, pattern in STAGE_RULES:
            if re.search(pattern, frame):
                return stage
    return "other (native)"


def stage_shares(raw_path: Path) -> dict[str, dict[str, int]]:
    """py-spy ``--format raw`` (collapsed stacks, ``--threads``, ``--idle``) -> ``{thread: {stage: samples}}``."""
    shares: dict[str, dict[str, int]] = collections.defaultdict(lambda: collections.defaultdict(int))
    for line in raw_path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        thread, _, frames = stack.partition(";")
        shares[thread][classify(frames)] += int(count)
    return {t: dict(s) for t, s in shares.items()}


def start_py_spy(pid: int, out: Path, duration_s: int) -> subprocess.Popen:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    command = [py_spy, "record", "--pid", str(pid), "--rate", str(PY_SPY_RATE_HZ), "--format", "raw"]
    command += ["--threads", "--idle", "--native", "--duration", str(duration_s), "-o", str(out)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


class GaugeSampler:
    """Samples the engine's ``lmforge_num_requests_running`` / ``_waiting`` gauges on a thread
    (every ``interval_s``): the mean batch the engine ran while the load was on."""

    def __init__(self, metrics_url: str, interval_s: float = 0.5) -> None:
        self.metrics_url, self.interval_s = metrics_url, interval_s
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "GaugeSampler":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=10)

    def _run(self) -> None:
        while not self.stop.wait(self.interval_s):
            try:
                with urllib.request.urlopen(self.metrics_url, timeout=5) as reply:
                    text = reply.read().decode()
            except OSError:
                continue
            values = {}
            for name in ("running", "waiting"):
                found = re.findall(rf"^lmforge_num_requests_{name}\{{[^}}]*\}} ([0-9.eE+-]+)$", text, re.M)
                values[name] = sum(float(v) for v in found)
            self.samples.append((values["running"], values["waiting"]))

    def summary(self) -> dict:
        if not self.samples:
            return {}
        running = [r for r, _ in self.samples]
        return {
            "mean_running": sum(running) / len(running),
            "mean_waiting": sum(w for _, w in self.samples) / len(self.samples),
            "share_of_time_idle": sum(1 for r in running if r == 0) / len(running),
        }


def lmforge_counters(metrics_url: str) -> dict[str, float]:
    """The ``lmforge_*_total`` counters of the model (summed over labels)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=10) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = collections.defaultdict(float)
    for name, value in re.findall(r"^(lmforge_\w+_total)\{[^}]*\} ([0-9.eE+-]+)$", text, re.M):
        out[name] += float(value)
    return dict(out)


# --------------------------------------------------------------------------------------------
# The in-process engine on the same prompts (a child process, so its CPU time is its own)
# --------------------------------------------------------------------------------------------


def prompts_needed(streams: list[int], per_stream: int, passes: int = 1) -> int:
    """Prompts for a warm-up request per stream and ``passes`` x ``per_stream`` measured ones at each stream count,
    none sent twice (a repeated prompt would be served from the prefix cache)."""
    return sum(s * (1 + per_stream * passes) for s in streams)


async def _engine_streams(
    engine, prompts: list[list[int]], streams: int, per_stream: int, max_tokens: int, first: int = 0
):
    # torch-heavy: imported on use, so importing this module stays light
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    counter = iter(range(10**9))

    async def one(ids: list[int]) -> RequestSample:
        sample = RequestSample(start_s=time.time(), e2e_s=0.0, endpoint="in-process")
        start, times, last = time.perf_counter(), [], None
        async for out in engine.generate({"prompt_token_ids": ids}, params, f"p{next(counter)}"):
            times.append(time.perf_counter())
            last = out
        sample.output_tokens = len(last.outputs[0].token_ids)
        sample.finish_reason = last.outputs[0].finish_reason
        return _finish(sample, start, times)

    async def stream(s: int) -> list[RequestSample]:
        return [await one(prompts[(first + s * per_stream + r) % len(prompts)]) for r in range(per_stream)]

    start = time.perf_counter()
    results = await asyncio.gather(*(stream(s) for s in range(streams)))
    return [x for r in results for x in r], time.perf_counter() - start


def in_process_child(spec_path: str) -> int:
    """``--in-process-child SPEC``: run the levels of SPEC (JSON) on an in-process ``AsyncLLMEngine``
    and print one JSON line per level (tok/s, TTFT p99, ITL p50, this process's CPU seconds per 1k tokens)."""
    # torch-heavy: imported on use, so importing this module stays light
    from engine import AsyncLLMEngine, EngineConfig

    spec = json.loads(Path(spec_path).read_text())
    first = 0  # each run on prompts no earlier run sent: a repeat would find its whole prompt in the prefix cache

    def run(streams: int, per_stream: int):
        nonlocal first
        start, first = first, first + streams * per_stream
        return asyncio.run(_engine_streams(engine, spec["prompts"], streams, per_stream, spec["max_tokens"], start))

    with AsyncLLMEngine(EngineConfig(model=spec["checkpoint"], **spec["engine"])) as engine:
        for streams in spec["streams"]:
            run(streams, 1)  # warm-up at this batch size
            cpu = sum(os.times()[:2])
            samples, wall = run(streams, spec["requests_per_stream"])
            cpu = sum(os.times()[:2]) - cpu
            summary = summarize(samples, duration_s=wall)
            tokens = summary["total_output_tokens"] or 1
            level = {
                "streams": streams,
                "output_tok_s": summary["output_throughput_tok_s"],
                "ttft_p99_ms": summary["ttft_ms"]["p99"],
                "itl_p50_ms": summary["itl_ms"]["p50"],
                "cpu_s_per_1k_tokens": 1000.0 * cpu / tokens,
            }
            print("LEVEL " + json.dumps(level), flush=True)
    return 0


def in_process_levels(args, checkpoint: str, engine: dict, prompt_ids: list[list[int]]) -> dict[int, dict]:
    """The in-process engine's figures per stream count (run in a child process)."""
    with tempfile.TemporaryDirectory(prefix="lmforge-serving-profile-engine-") as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(
            json.dumps(
                {
                    "checkpoint": checkpoint,
                    "engine": engine,
                    "streams": args.streams,
                    "requests_per_stream": args.requests_per_stream,
                    "max_tokens": args.max_tokens,
                    "prompts": prompt_ids,
                }
            )
        )
        repo_root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo_root, os.environ.get("PYTHONPATH")]))}
        child = subprocess.run(
            [sys.executable, "-m", "bench.serving_profile", "--in-process-child", str(spec)],
            capture_output=True,
            text=True,
            env=env,
            timeout=7200,
            check=False,
        )
    levels = {}
    for line in child.stdout.splitlines():
        if line.startswith("LEVEL "):
            level = json.loads(line[6:])
            levels[level["streams"]] = level
    if child.returncode != 0:
        print(f"note: the in-process run failed (status {child.returncode}): {child.stderr[-1500:]}")
    return levels


# --------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------


def profile(args) -> dict:
    # torch-heavy: imported on use, so importing this module stays light
    from transformers import AutoTokenizer

    from deploy.export import export
    from engine.checkpoint.store import resolve_checkpoint

    checkpoint = str(resolve_checkpoint(args.checkpoint))
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    passes = 2 if args.py_spy else 1
    most = prompts_needed(args.streams, args.requests_per_stream, passes)
    conversations = chat_load(tokenizer, most)
    prompts = [render(tokenizer, c) for c in conversations]
    engine = {"dtype": args.dtype, "max_num_seqs": max(args.streams), "max_model_len": args.max_model_len}
    report = {"api": args.api, "checkpoint": checkpoint, "engine": engine, "levels": []}
    if args.in_process:
        ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        report["in_process"] = in_process_levels(args, checkpoint, engine, ids)
        for level in report["in_process"].values():
            print(f"in process: {format_in_process(level)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="lmforge-serving-profile-") as tmp:
        export(checkpoint, Path(tmp), name="llm", engine=engine, kind="llm")
        http, grpc, metrics = free_ports(3)
        with TritonServer(
            tmp, http, grpc, metrics, models=["llm"], write_pid_file=False, startup_timeout_s=900
        ) as server:
            frontend = None
            if args.api == "openai":
                port = free_ports(1)[0]
                ns = argparse.Namespace(repo=tmp, host="127.0.0.1", openai_port=port, api_key=None, grace_s=10.0)
                frontend = start_openai(ns, server)
                target = {"api": "openai", "url": f"http://127.0.0.1:{port}/v1/chat/completions", "model": "llm"}
            else:
                target = {"api": "triton", "url": f"{server.http_url}/v2/models/llm/generate_stream"}
            try:
                stub = server.stub_pids("llm")[0]
                meter = CpuMeter(
                    {"tritonserver": server.process.pid, "model stub": stub, "frontend": frontend and frontend.pid},
                    stub,
                )
                first = 0
                for streams in args.streams:
                    level = _level(args, target, server, meter, conversations, prompts, streams, tmp, first)
                    first += prompts_needed([streams], args.requests_per_stream, passes)
                    reference = report.get("in_process", {}).get(streams)
                    if reference and reference["output_tok_s"] and level["output_tok_s"]:
                        level["served_over_in_process_tok_s"] = level["output_tok_s"] / reference["output_tok_s"]
                    report["levels"].append(level)
                    print(format_level(level), flush=True)
            finally:
                if frontend is not None:
                    stop_openai(frontend, argparse.Namespace(repo=tmp, grace_s=10.0))
    return report


def _level(args, target, server, meter: CpuMeter, conversations, prompts, streams: int, tmp: str, first: int) -> dict:
    """One stream count on the prompts from index ``first`` on (``prompts_needed([streams], ...)`` of them)."""
    run = lambda per_stream, at: asyncio.run(  # noqa: E731
        run_streams(target, conversations, prompts, streams, per_stream, args.max_tokens, at)
    )
    run(1, first)  # warm-up at this batch size (not measured)
    counters_before, before = lmforge_counters(server.metrics_url), meter.snapshot()
    with GaugeSampler(server.metrics_url) as gauges:
        samples, count, wall = run(args.requests_per_stream, first + streams)
    after, counters_after = meter.snapshot(), lmforge_counters(server.metrics_url)
    processes, stub_threads = meter.delta(before, after)
    summary = summarize(samples, duration_s=wall)
    tokens = summary["total_output_tokens"] or 1
    per_k = lambda seconds: 1000.0 * seconds / tokens  # noqa: E731
    counters = {k: counters_after.get(k, 0.0) - counters_before.get(k, 0.0) for k in counters_after}
    level = {
        "streams": streams,
        "requests": summary["successful"],
        "failed": summary["failed"],
        "errors": summary["errors"],
        "output_tokens": summary["total_output_tokens"],
        "output_tok_s": summary["output_throughput_tok_s"],
        "ttft_p99_ms": summary["ttft_ms"]["p99"],
        "itl_p50_ms": summary["itl_ms"]["p50"],
        "cpu_s_per_1k_tokens": {k: per_k(v) for k, v in processes.items()},
        "cpu_s_per_1k_tokens_total": per_k(sum(processes.values())),
        "stub_threads_cpu_s_per_1k_tokens": {k: per_k(v) for k, v in sorted(stub_threads.items())},
        "messages_per_token": {
            "engine request-steps (outputs made)": 1.0,
            "model responses (Triton IPC + gRPC/HTTP)": counters.get("lmforge_responses_total", 0.0) / tokens or None,
            "SSE events at the client": count.events / tokens,
        },
        "engine_steps": counters.get("lmforge_engine_steps_total"),
        "engine_batch": gauges.summary(),
        "cached_tokens_reported": count.cached_tokens,
    }
    if args.py_spy:
        again = lambda: run(args.requests_per_stream, first + streams * (1 + args.requests_per_stream))  # noqa: E731
        level["py_spy_stages"] = _py_spy_pass(args, again, server, meter, streams, tmp)
    return level


def _py_spy_pass(args, run_again, server, meter: CpuMeter, streams: int, tmp: str) -> dict:
    """The same load again under ``py-spy record`` on the stub and the frontend: samples per stage."""
    duration = max(5, int(args.py_spy_seconds))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    recorders = {}
    for name in ("model stub", "frontend"):
        pid = meter.pids.get(name)
        if pid:
            path = Path(args.out) / f"py-spy-{name.replace(' ', '-')}-{streams}.txt"
            recorders[name] = (start_py_spy(pid, path, duration), path)
    run_again()
    stages = {}
    for name, (process, path) in recorders.items():
        try:
            process.wait(timeout=duration + 120)
        except subprocess.TimeoutExpired:
            process.kill()
        stages[name] = stage_shares(path) if path.is_file() else {}
    return stages


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def format_in_process(level: dict) -> str:
    fmt = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    return (
        f"{level['streams']} streams: {fmt(level['output_tok_s'])} tok/s, TTFT p99 {fmt(level['ttft_p99_ms'], 0)} ms, "
        f"ITL p50 {fmt(level['itl_p50_ms'])} ms, CPU {fmt(level['cpu_s_per_1k_tokens'], 2)} s per 1k tokens"
    )


def format_level(level: dict) -> str:
    fmt = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = [
        f"{level['streams']} streams: {level['requests']} requests (+{level['failed']} failed), "
        f"{fmt(level['output_tok_s'])} tok/s, TTFT p99 {fmt(level['ttft_p99_ms'], 0)} ms, ITL p50 "
        f"{fmt(level['itl_p50_ms'])} ms, CPU {fmt(level['cpu_s_per_1k_tokens_total'], 2)} s per 1k tokens"
        + (
            f", served / in-process {level['served_over_in_process_tok_s']:.2f}"
            if level.get("served_over_in_process_tok_s")
            else ""
        ),
        "  CPU s / 1k tokens: " + ", ".join(f"{k} {fmt(v, 2)}" for k, v in level["cpu_s_per_1k_tokens"].items()),
        "  stub threads: "
        + ", ".join(f"{k} {fmt(v, 2)}" for k, v in level["stub_threads_cpu_s_per_1k_tokens"].items()),
        "  messages per token: " + ", ".join(f"{k} {fmt(v, 2)}" for k, v in level["messages_per_token"].items()),
        "  engine batch: " + ", ".join(f"{k} {fmt(v, 2)}" for k, v in (level.get("engine_batch") or {}).items()),
    ]
    for process, threads in (level.get("py_spy_stages") or {}).items():
        for thread, stages in threads.items():
            total = sum(stages.values()) or 1
            top = sorted(stages.items(), key=lambda kv: -kv[1])[:9]
            lines.append(f"  py-spy {process} {thread}: " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in top))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api", choices=["openai", "triton"], default="openai", help="served path (default openai)")
    add_option(parser, "--checkpoint", "smollm2-135m", "causal LM checkpoint")
    add_option(parser, "--dtype", "bfloat16", "EngineConfig.dtype")
    parser.add_argument("--streams", type=int, nargs="+", default=[16, 64], help="concurrent streams (default 16 64)")
    add_option(parser, "--requests-per-stream", 3, "measured requests per stream")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (EOS ignored)")
    add_option(parser, "--max-model-len", 512, "EngineConfig.max_model_len")
    parser.add_argument("--py-spy", action="store_true", help="also profile each level with py-spy (a second pass)")
    add_option(parser, "--py-spy-seconds", 20.0, "py-spy record duration")
    parser.add_argument(
        "--in-process", action="store_true", help="also run the in-process engine on the same prompts (a child process)"
    )
    parser.add_argument("--out", default="reports/serving-profile", help="report directory")
    parser.add_argument("--in-process-child", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.in_process_child:
        return in_process_child(args.in_process_child)
    if min(args.streams) < 1 or args.requests_per_stream < 1 or args.max_tokens < 2:
        print("error: --streams and --requests-per-stream must be >= 1, --max-tokens >= 2")
        return 2
    report = profile(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "profile.md").write_text("\n\n".join(format_level(level) for level in report["levels"]) + "\n")
    print(f"report: {out.resolve()}")
    return 0 if all(level["failed"] == 0 for level in report["levels"]) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serving_profile", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
