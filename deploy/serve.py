"""``lmforge serve``: run the real Triton Inference Server on a model repository.

    lmforge serve --repo model_repository [--http-port 8000 --grpc-port 8001 --metrics-port 8002]
    lmforge serve --repo model_repository --stop

Starts the bundled ``tritonserver`` on 127.0.0.1 with explicit model control, loading every
model of the repository it can serve (``--models`` to choose), waits until they are ready, and
stays in the foreground until Ctrl-C, SIGTERM or ``lmforge serve --stop`` (SIGINT to the
server, SIGKILL after ``--grace-s``). The server log goes to ``REPO/tritonserver.log`` (or
``--log``); the pid to ``REPO/tritonserver.pid``. A model that fails to load (or a ``--models``
name the repository lacks) is reported with Triton's reason and the command exits 1; busy ports
exit 1 at once with the ports named. While serving, a model whose Python-backend stub died or
whose engine died is loaded again, and a server that crashed is started again
(``deploy.triton.ModelSupervisor``); each event is printed.
"""

from __future__ import annotations

import argparse
import signal
import time

from deploy.triton import DEFAULT_PORTS, ModelSupervisor, TritonError, TritonServer, stop_from_pid_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repo", default="model_repository", help="Triton model repository (default model_repository)")
    parser.add_argument("--http-port", type=int, default=DEFAULT_PORTS["http"], help="HTTP port on 127.0.0.1 (default 8000)")
    parser.add_argument("--grpc-port", type=int, default=DEFAULT_PORTS["grpc"], help="gRPC port on 127.0.0.1 (default 8001)")
    parser.add_argument("--metrics-port", type=int, default=DEFAULT_PORTS["metrics"], help="Prometheus metrics port (default 8002)")
    parser.add_argument("--models", nargs="+", help="models to load (default: every model this server can serve)")
    parser.add_argument("--log", help="server log file (default REPO/tritonserver.log)")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0, help="deadline for all models to be ready (default 600)")
    parser.add_argument("--grace-s", type=float, default=15.0, help="seconds between SIGINT and SIGKILL when stopping (default 15)")
    parser.add_argument("--stop", action="store_true", help="stop the server `lmforge serve` started on --repo")


def run(args: argparse.Namespace) -> int:
    if args.stop:
        try:
            pid = stop_from_pid_file(args.repo, grace_s=args.grace_s)
        except TritonError as exc:
            print(f"error: {exc}")
            return 1
        print(f"stopped tritonserver (pid {pid})")
        return 0
    try:
        server = TritonServer(
            args.repo, args.http_port, args.grpc_port, args.metrics_port,
            models=args.models, log_path=args.log, startup_timeout_s=args.startup_timeout_s, grace_s=args.grace_s,
        )
    except TritonError as exc:
        print(f"error: {exc}")
        return 1
    # SIGTERM behaves like Ctrl-C: stop the server cleanly.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    start = time.monotonic()
    try:
        server.start()
    except KeyboardInterrupt:
        print("interrupted; server stopped")
        return 130
    except TritonError as exc:
        print(f"error: {exc}")
        return 1
    for name, reason in server.skipped.items():
        print(f"skipped {name}: {reason}")
    print(f"ready in {time.monotonic() - start:.1f} s: {', '.join(server.models)}")
    print(f"  HTTP    {server.http_url}   (e.g. POST {server.http_url}/v2/models/{server.models[0]}/generate)")
    print(f"  gRPC    {server.grpc_url}")
    print(f"  metrics {server.metrics_url}")
    print(f"  log     {server.log_path}")
    print("Ctrl-C or `lmforge serve --repo {} --stop` to stop".format(args.repo), flush=True)
    supervisor = ModelSupervisor(server, report=lambda line: print(line, flush=True)).start()
    try:
        while not supervisor.finished.wait(1.0):  # reloads broken models, restarts a crashed server
            pass
        status = supervisor.exit_status
    except KeyboardInterrupt:
        supervisor.stop()
        status = server.stop()
        print(f"server stopped (exit status {status})")
        return 0
    supervisor.stop()
    server.stop()
    if status == 0 or "Signal (2) received" in server.log_tail(200):  # `--stop` or a SIGINT
        print(f"server stopped (exit status {status})")
        return 0
    print(f"server exited (status {status}); log {server.log_path}:\n{server.log_tail()}")
    return 1



def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
