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

``--peers`` also starts the baselines installed by ``make peers`` (``$LMFORGE_PEERS``, default
``/work/main/.peers``): ``vllm serve`` (CPU build, same checkpoint, ``--dtype``) and
``llama-server`` (one slot per user, ``-np`` = the largest user count, on ``--gguf`` or a GGUF
of the same dtype found in the peers directory). A peer that is not installed or does not start is skipped
with a note in the report.

``OUT/`` gets ``serving.json`` (per endpoint and user count: output tok/s, TTFT / ITL / E2E p50
and p99 in ms, goodput = output tok/s of the requests whose TTFT met ``--ttft-bound-ms``),
``serving.md`` (the same as a table), ``throughput_vs_users.png``, ``ttft_p99_vs_users.png``, and
each run's own load-test directory ``NAME/uU/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

from bench.loadtest import LoadTestConfig, LoadTestError, parse_duration, run_loadtest
from bench.report import read_samples
from deploy.triton import free_ports, stop_process
from engine.checkpoint.outputs import SERVING_REPORT, check_output_dir
from engine.checkpoint.store import resolve_checkpoint

DEFAULT_USERS = (1, 4, 16, 64)
DEFAULT_PEERS_DIR = "/work/main/.peers"
PEER_START_TIMEOUT_S = 600.0


@dataclasses.dataclass
class Endpoint:
    """One server under test."""

    name: str
    api: str  # "triton" or "openai"
    url: str
    model: str
    endpoint: str | None = None  # triton: generate_stream; openai: chat (default) or completions
    key: str | None = None

    @classmethod
    def parse(cls, spec: str) -> "Endpoint":
        """``name=N,api=A,url=U,model=M[,endpoint=E][,key=K]``.

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
    head = (
        "| endpoint | users | requests | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        f"| E2E p50 ms | E2E p99 ms | goodput tok/s (TTFT <= {bound_ms:g} ms) |"
    )
    lines = [head, "|" + "---|" * 11]
    fmt = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    for r in rows:
        lines.append(
            f"| {r['endpoint']} | {r['users']} | {r['requests']} (+{r['failed']} failed) | {fmt(r['output_tok_s'])} "
            f"| {fmt(r['ttft_p50_ms'], 0)} | {fmt(r['ttft_p99_ms'], 0)} | {fmt(r['itl_p50_ms'])} | "
            f"{fmt(r['itl_p99_ms'])} "
            f"| {fmt(r['e2e_p50_ms'], 0)} | {fmt(r['e2e_p99_ms'], 0)} | {fmt(r['goodput_tok_s'])} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> list[Path]:
    """``throughput_vs_users.png`` and ``ttft_p99_vs_users.png``, one line per endpoint."""
    # optional or heavy dependency: imported only on the path that needs it
    import matplotlib

    matplotlib.use("Agg")
    # optional or heavy dependency: imported only on the path that needs it
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


@dataclasses.dataclass
class Peer:
    endpoint: Endpoint
    process: subprocess.Popen
    log: Path


def _wait_health(url: str, process: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(1.0)
    return False


def start_peers(args, out: Path, notes: list[str]) -> list[Peer]:
    """Start ``vllm serve`` and ``llama-server`` from the peers directory; notes say what was skipped."""
    peers_dir = Path(os.environ.get("LMFORGE_PEERS", DEFAULT_PEERS_DIR))
    if not peers_dir.is_dir():
        notes.append(f"peers skipped: {peers_dir} does not exist (install them with `make peers`)")
        return []
    checkpoint = resolve_checkpoint(args.checkpoint)
    name = args.peer_model_name
    started: list[Peer] = []
    candidates = []
    vllm = next(
        (p for p in (peers_dir / "vllm" / "bin" / "vllm", peers_dir / "vllm-venv" / "bin" / "vllm") if p.is_file()),
        None,
    )
    if vllm is None:
        notes.append(f"vllm skipped: no vllm executable under {peers_dir}")
    else:
        port = free_ports(1)[0]
        candidates.append(
            (
                "vllm",
                [
                    str(vllm),
                    "serve",
                    str(checkpoint),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--dtype",
                    args.dtype,
                    "--max-model-len",
                    str(args.max_model_len),
                    "--served-model-name",
                    name,
                    "--max-num-seqs",
                    str(max(args.users)),
                ],
                port,
            )
        )
    server = next(
        (
            p
            for p in (
                peers_dir / "llama-server",
                peers_dir / "bin" / "llama-server",
                peers_dir / "llama.cpp" / "build" / "bin" / "llama-server",
            )
            if p.is_file()
        ),
        None,
    )
    want = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[args.dtype]
    gguf = Path(args.gguf) if args.gguf else next(iter(sorted(peers_dir.rglob(f"*{want}*.gguf"))), None)
    if server is None:
        notes.append(f"llama-server skipped: no llama-server binary under {peers_dir}")
    elif gguf is None:
        notes.append(
            f"llama-server skipped: no *{want}*.gguf under {peers_dir} and no --gguf (same dtype as the others)"
        )
    else:
        slots = max(args.users)
        port = free_ports(1)[0]
        candidates.append(
            (
                "llama-server",
                [
                    str(server),
                    "-m",
                    str(gguf),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "-np",
                    str(slots),
                    "-c",
                    str(slots * args.max_model_len),
                    "--alias",
                    name,
                    "-t",
                    str(os.cpu_count() or 1),
                ],
                port,
            )
        )
    for peer_name, command, port in candidates:
        log = out / f"{peer_name}.log"
        with log.open("w") as handle:
            process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        if _wait_health(url, process, PEER_START_TIMEOUT_S):
            started.append(Peer(Endpoint(peer_name, "openai", url, name, args.peer_endpoint), process, log))
        else:
            notes.append(
                f"{peer_name} skipped: it did not become healthy within {PEER_START_TIMEOUT_S:.0f} s; log {log}"
            )
            _stop(process)
    return started


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        stop_process(process.pid, 15.0, wait=process.wait)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="SPEC",
        help="name=N,api=triton|openai,url=http://127.0.0.1:PORT,model=M[,endpoint=E][,key=K] (repeat)",
    )
    parser.add_argument("--peers", action="store_true", help="also start vllm serve and llama-server from `make peers`")
    parser.add_argument(
        "--checkpoint", default="smollm2-135m", help="checkpoint the peers serve (default smollm2-135m)"
    )
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
    parser.add_argument("--run-time", default="30s", help="measured time per endpoint and user count (default 30s)")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (EOS ignored)")
    parser.add_argument("--prompts", default=None, help="JSONL of prompts (default: the held-out dialogs)")
    parser.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    parser.add_argument("--ttft-bound-ms", type=float, default=2000.0, help="TTFT objective for goodput (default 2000)")
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", default="reports/serving", help="report directory (default reports/serving)")


def run(args: argparse.Namespace) -> int:
    try:
        endpoints = [Endpoint.parse(spec) for spec in args.endpoint]
        run_time_s = parse_duration(args.run_time)
    except (ValueError, LoadTestError) as exc:
        print(f"error: {exc}")
        return 2
    if not endpoints and not args.peers:
        print("error: no endpoint to measure; pass --endpoint (and/or --peers)")
        return 2
    out = check_output_dir(args.out, kind=SERVING_REPORT, sources=tuple(p for p in [args.prompts] if p))
    out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    peers = start_peers(args, out, notes) if args.peers else []
    endpoints += [p.endpoint for p in peers]
    if not endpoints:
        print("error: no endpoint to measure; pass --endpoint (and/or --peers)")
        return 2
    rows: list[dict] = []
    try:
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
                    num_prompts=args.num_prompts,
                    max_tokens=args.max_tokens,
                    ignore_eos=True,
                    request_timeout_s=args.request_timeout_s,
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
                rows.append(row_from_summary(ep.name, users, summary, samples, args.ttft_bound_ms))
                r = rows[-1]
                print(
                    f"  {r['output_tok_s'] or 0:.1f} tok/s, TTFT p50 {r['ttft_p50_ms'] or 0:.0f} ms, p99 "
                    f"{r['ttft_p99_ms'] or 0:.0f} ms",
                    flush=True,
                )
    finally:
        for peer in peers:
            _stop(peer.process)
    report = {
        "endpoints": [dataclasses.asdict(e) | {"key": None} for e in endpoints],
        "users": args.users,
        "run_time_s": run_time_s,
        "max_tokens": args.max_tokens,
        "ttft_bound_ms": args.ttft_bound_ms,
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
