"""``lmforge serve``: run the real Triton Inference Server on a model repository.

    lmforge serve --repo model_repository [--http-port 8000 --grpc-port 8001 --metrics-port 8002]
    lmforge serve --repo model_repository --openai-port 9000 [--host 0.0.0.0 --api-key KEY]
    lmforge serve --repo model_repository --stop

Starts the bundled ``tritonserver`` on 127.0.0.1 with explicit model control, loading every model of the
repository it can serve (``--models`` to choose, names separated by spaces or commas; models whose
weights were never exported are skipped, ``deploy.triton.unexported_reason``), waits until they are
ready, and stays in the foreground until Ctrl-C or SIGTERM (exit status 130) or ``lmforge serve --stop``
(SIGINT to the server, SIGKILL after ``--grace-s``). The server log goes to ``REPO/tritonserver.log``
(or ``--log``); the pid to ``REPO/tritonserver.pid``. A model that fails to load (or a ``--models`` name
the repository lacks) is reported with Triton's reason and the command exits 1; busy ports exit 1 at
once with the ports named. While serving, a model whose Python-backend stub died or whose engine died is
loaded again, and a server that crashed, or hung (its liveness endpoint silent for 10 s, or "terminate
called" in its log and then silence), is killed and started again (``deploy.triton.ModelSupervisor``);
each event is printed.

With ``--api-key`` (or ``$LMFORGE_API_KEY``) every Triton API but health (inference, model
control, metadata, statistics...) answers only requests with ``Authorization: Bearer KEY``, on
HTTP and gRPC (``deploy.triton.restricted_api_flags``); the health endpoints stay open for probes.

With ``--openai-port`` it also starts the OpenAI-compatible frontend (``python -m deploy.openai``,
its own process, bound to ``--host``, default 127.0.0.1) on the server's LLM and encoder models once
they are ready; it forwards to Triton over gRPC (so it outlives a supervised server restart on the
same ports) and stops before it, ending the requests in flight with a 503 (a started stream: an error
event and ``[DONE]``) (pid in ``REPO/openai_server.pid``, log in ``REPO/openai_server.log``).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from deploy.openai.models import llm_names
from deploy.openai.triton_client import STALL_TIMEOUT_S
from deploy.triton import (
    DEFAULT_PORTS,
    SUPERVISOR_LOAD_TIMEOUT_S,
    ModelSupervisor,
    TritonError,
    TritonServer,
    _asked_to_stop,
    _pid_alive,
    check_ports,
    lmforge_source_root,
    stop_from_pid_file,
    stop_process,
)
from engine.cli_options import add_option
from engine.errors import UsageError

OPENAI_PID_FILE = "openai_server.pid"
OPENAI_LOG_FILE = "openai_server.log"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_option(parser, "--repo", "model_repository", "Triton model repository")
    add_option(parser, "--http-port", DEFAULT_PORTS["http"], "HTTP port on 127.0.0.1")
    add_option(parser, "--grpc-port", DEFAULT_PORTS["grpc"], "gRPC port on 127.0.0.1")
    add_option(parser, "--metrics-port", DEFAULT_PORTS["metrics"], "Prometheus metrics port")
    parser.add_argument(
        "--models",
        nargs="+",
        help="models to load, separated by spaces or commas (default: every model this server can serve)",
    )
    parser.add_argument("--log", help="server log file (default REPO/tritonserver.log)")
    add_option(parser, "--startup-timeout-s", 600.0, "deadline for all models to be ready")
    add_option(parser, "--grace-s", 15.0, "seconds between SIGINT and SIGKILL when stopping")
    parser.add_argument("--stop", action="store_true", help="stop the server `lmforge serve` started on --repo")
    parser.add_argument(
        "--openai-port", type=int, help="also serve the OpenAI-compatible API on this port (default: off)"
    )
    add_option(parser, "--host", "127.0.0.1", "address the OpenAI API binds")
    parser.add_argument(
        "--stall-timeout-s",
        type=float,
        help="with --openai-port: a request that hears nothing from Triton (no token, no heartbeat) this long is "
        f"answered 503 (its model instance died; default: the frontend's, {STALL_TIMEOUT_S:g} s)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json"),
        help="with --openai-port: the format the models write tool calls in (default: the frontend's, hermes)",
    )
    parser.add_argument(
        "--api-key",
        help="require `Authorization: Bearer KEY` on the OpenAI API's /v1 routes and on every Triton API but health "
        "(inference, model control, metadata...) over HTTP and gRPC (or $LMFORGE_API_KEY)",
    )


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse, before anything starts, the flag values the server would only fail on later.

    Raises:
        UsageError: a negative ``--grace-s``, a ``--startup-timeout-s`` or ``--stall-timeout-s`` that is not
            positive, an ``--openai-port`` equal to a Triton port, a ``--host`` that is not an address of this
            machine, an empty ``--api-key`` (``--api-key "$KEY"`` with ``KEY`` unset would serve without one), or
            an OpenAI-frontend flag (``--stall-timeout-s``, ``--tool-call-parser``) without ``--openai-port``.
    """
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError(
            "--api-key is empty: the server would accept every client",
            fix='give the key (e.g. --api-key "$(openssl rand -hex 16)"), or leave the flag out to serve without one',
        )
    if args.grace_s < 0:
        raise UsageError(f"--grace-s {args.grace_s:g}: must be >= 0", fix="e.g. --grace-s 15")
    if args.startup_timeout_s <= 0:
        raise UsageError(
            f"--startup-timeout-s {args.startup_timeout_s:g}: must be > 0", fix="e.g. --startup-timeout-s 600"
        )
    if args.stall_timeout_s is not None and args.stall_timeout_s <= 0:
        raise UsageError(f"--stall-timeout-s {args.stall_timeout_s:g}: must be > 0", fix="e.g. --stall-timeout-s 5")
    if args.openai_port is None:
        for flag, value in (("--stall-timeout-s", args.stall_timeout_s), ("--tool-call-parser", args.tool_call_parser)):
            if value is not None:
                raise UsageError(
                    f"{flag} {value}: it sets the OpenAI API, which runs only with --openai-port",
                    fix=f"add --openai-port PORT, or leave {flag} out",
                )
        return
    for kind in ("http", "grpc", "metrics"):
        if getattr(args, f"{kind}_port") == args.openai_port:
            raise UsageError(
                f"--openai-port {args.openai_port}: also the --{kind}-port", fix="give each server a port of its own"
            )
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((args.host, 0))
        except OSError as exc:
            if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or isinstance(exc, socket.gaierror):
                raise UsageError(
                    f"--host {args.host}: not an address of this machine ({exc.strerror or exc})",
                    fix="use 127.0.0.1, 0.0.0.0 or one of this machine's addresses",
                ) from None


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    if args.stop:
        frontend_pid = stop_openai_from_pid_file(args.repo, grace_s=args.grace_s)
        if frontend_pid is not None:
            print(f"stopped the OpenAI API (pid {frontend_pid})")
        try:
            pid = stop_from_pid_file(args.repo, grace_s=args.grace_s)
        except TritonError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"stopped tritonserver (pid {pid})")
        return 0
    if args.openai_port is not None:
        try:
            check_ports({"openai": args.openai_port}, args.host if args.host not in ("0.0.0.0", "::") else "127.0.0.1")
        except TritonError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    try:
        server = TritonServer(
            args.repo,
            args.http_port,
            args.grpc_port,
            args.metrics_port,
            models=parse_model_names(args.models),
            log_path=args.log,
            startup_timeout_s=args.startup_timeout_s,
            grace_s=args.grace_s,
            api_key=args.api_key or os.environ.get("LMFORGE_API_KEY"),
        )
    except (TritonError, UsageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code  # 2 for a flag the user must change, 1 for a server that would not start
    # SIGTERM behaves like Ctrl-C: stop the server cleanly. SIGINT gets the same handler whatever this process
    # inherited (a parent that ignored or blocked SIGINT, as a non-interactive shell's `&` does, would otherwise
    # leave Python without its Ctrl-C handler and `serve` deaf to it).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    signal.signal(signal.SIGINT, _raise_keyboard_interrupt)
    start = time.monotonic()
    try:
        server.start()
    except KeyboardInterrupt:
        print("interrupted; server stopped")
        return 130
    except TritonError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    frontend = supervisor = None
    try:  # Ctrl-C (or SIGTERM) from here on: the frontend ends its streams first, then Triton stops
        for name, reason in server.skipped.items():
            print(f"skipped {name}: {reason}")
        print(f"ready in {time.monotonic() - start:.1f} s: {', '.join(server.models)}")
        print(f"  HTTP    {server.http_url}")
        for example in endpoint_examples(server):
            print(f"          e.g. POST {example}")
        print(f"  gRPC    {server.grpc_url}")
        print(f"  metrics {server.metrics_url}")
        print(f"  log     {server.log_path}")
        if args.openai_port is not None:
            try:
                frontend = start_openai(args, server)
            except TritonError as exc:
                server.stop()
                print(f"error: {exc}", file=sys.stderr)
                return 1
            print(f"  OpenAI  http://{args.host}:{args.openai_port}/v1   (log {Path(args.repo) / OPENAI_LOG_FILE})")
        print("Ctrl-C or `lmforge serve --repo {} --stop` to stop".format(args.repo), flush=True)
        supervisor = _supervise(server, args)
        while not supervisor.finished.wait(1.0):  # reloads broken models, restarts a crashed or hung server
            pass
        status = supervisor.exit_status
    except KeyboardInterrupt:
        if supervisor is not None:
            supervisor.stop()
        stop_openai(frontend, args)
        server.stop()
        print("server stopped")
        return 130
    supervisor.stop()
    stop_openai(frontend, args)
    server.stop()
    if status == 0 or _asked_to_stop(server.log_tail(200)):  # `--stop` (SIGINT; Triton may exit 1 on it)
        print("server stopped")
        return 0
    print(f"server exited (status {status}); log {server.log_path}:\n{server.log_tail()}")
    return 1


def parse_model_names(values: list[str] | None) -> list[str] | None:
    """``--models`` values -> model names: each value may hold several, separated by commas
    (``--models smollm2,minilm`` as ``--models smollm2 minilm``); repeats dropped.

    Raises:
        UsageError: a value with no name in it (``--models ,``).
    """
    if values is None:
        return None
    names = [name.strip() for value in values for name in value.split(",") if name.strip()]
    if not names:
        raise UsageError(f"--models {' '.join(values)!r}: no model name", fix="e.g. --models smollm2_135m,minilm")
    return list(dict.fromkeys(names))


def endpoint_examples(server: TritonServer) -> list[str]:
    """Example request URLs for the startup message: an LLM's ``generate`` and an encoder's ``infer``."""
    llms = llm_names(server.repo, server.models)
    encoders = llm_names(server.repo, server.models, kind="encoder")
    examples = [f"{server.http_url}/v2/models/{llms[0]}/generate"] if llms else []
    examples += [f"{server.http_url}/v2/models/{encoders[0]}/infer"] if encoders else []
    return examples or [f"{server.http_url}/v2/models/{server.models[0]}/infer"]


def _supervise(server: TritonServer, args: argparse.Namespace) -> ModelSupervisor:
    """Start the ``ModelSupervisor`` that prints its events; a reload takes about as long as the first load, so
    ``--startup-timeout-s`` bounds it too (``SUPERVISOR_LOAD_TIMEOUT_S`` at most)."""
    load_timeout_s = min(args.startup_timeout_s, SUPERVISOR_LOAD_TIMEOUT_S)
    return ModelSupervisor(server, report=lambda line: print(line, flush=True), load_timeout_s=load_timeout_s).start()


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def start_openai(args: argparse.Namespace, server: TritonServer, timeout_s: float = 120.0) -> subprocess.Popen:
    """Start ``deploy.openai`` on the server's LLM (and encoder) models; returns once ``/health`` answers 200.

    Raises:
        TritonError: no LLM model is loaded, or the frontend exited or did not get ready in time.
    """
    repo = Path(args.repo).resolve()
    names = llm_names(repo, server.models)
    if not names:
        raise TritonError(f"--openai-port: none of the loaded models ({', '.join(server.models)}) is an LLM")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(lmforge_source_root()), env.get("PYTHONPATH")]))
    api_key = args.api_key or env.get("LMFORGE_API_KEY")
    if api_key:
        env["LMFORGE_API_KEY"] = api_key  # not on the command line, where `ps` shows it
    command = [
        sys.executable,
        "-m",
        "deploy.openai",
        "--repo",
        str(repo),
        "--grpc-url",
        server.grpc_url,
        "--host",
        args.host,
        "--port",
        str(args.openai_port),
        "--models",
        *names,
        *llm_names(repo, server.models, kind="encoder"),  # /v1/embeddings
    ]
    if getattr(args, "tool_call_parser", None):
        command += ["--tool-call-parser", args.tool_call_parser]
    if getattr(args, "stall_timeout_s", None):
        command += ["--stall-timeout-s", str(args.stall_timeout_s)]
    log = open(repo / OPENAI_LOG_FILE, "w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    (repo / OPENAI_PID_FILE).write_text(json.dumps({"pid": process.pid, "port": args.openai_port}))
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                (repo / OPENAI_PID_FILE).unlink(missing_ok=True)
                raise TritonError(
                    f"the OpenAI API exited (status {process.returncode}); log "
                    f"{repo / OPENAI_LOG_FILE}:\n{(repo / OPENAI_LOG_FILE).read_text()[-2000:]}"
                )
            try:
                with urllib.request.urlopen(f"http://{host}:{args.openai_port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return process
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
    except KeyboardInterrupt:  # its own session: Ctrl-C does not reach it
        stop_openai(process, args)
        raise
    stop_openai(process, args)
    raise TritonError(f"the OpenAI API was not ready within {timeout_s:.0f} s; log {repo / OPENAI_LOG_FILE}")


def stop_openai(process: subprocess.Popen | None, args: argparse.Namespace) -> None:
    if process is None:
        return
    stop_process(process.pid, args.grace_s, wait=process.wait)
    (Path(args.repo).resolve() / OPENAI_PID_FILE).unlink(missing_ok=True)


def stop_openai_from_pid_file(repo: str | Path, grace_s: float) -> int | None:
    """Stop the OpenAI frontend ``lmforge serve --openai-port`` started on ``repo``; its pid, or None if none runs."""
    pid_path = Path(repo).resolve() / OPENAI_PID_FILE
    try:
        pid = int(json.loads(pid_path.read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        ours = _pid_alive(pid) and b"deploy.openai" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        ours = False
    pid_path.unlink(missing_ok=True)
    if not ours:
        return None
    stop_process(pid, grace_s)
    return pid
