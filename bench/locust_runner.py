"""Run Locust headless as a library, in its own process (``python -m bench.locust_runner``).

``lmforge loadtest`` starts this module as a child process: Locust monkey-patches the standard
library with gevent at import, which must not happen inside a process that also trains or runs
torch (the demo), and a child can be bounded by a hard timeout. It drives
``locust.env.Environment`` with a ``LocalRunner``, writes Locust's CSVs (``PREFIX_stats.csv``,
``_stats_history.csv``, ``_failures.csv``, ``_exceptions.csv``) and one JSON line per request to
``--samples-out`` (flushed per line, so a crash keeps what was measured).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys

import gevent
from locust import events
from locust.env import Environment
from locust.log import setup_logging
from locust.stats import PERCENTILES_TO_REPORT, StatsCSV, StatsCSVFileWriter, stats_history

from bench.locustfile import LLMUser, add_options
from bench.shapes import StepLoadShape


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.locust_runner", description=__doc__)
    parser.add_argument("--host", required=True)
    parser.add_argument("--users", type=int, default=1)
    parser.add_argument("--spawn-rate", type=float, default=1.0)
    parser.add_argument("--run-time-s", type=float, required=True)
    parser.add_argument("--csv-prefix", required=True)
    parser.add_argument("--shape", choices=["constant", "steps"], default="constant")
    parser.add_argument("--shape-config", default="{}", help="JSON kwargs for StepLoadShape")
    parser.add_argument("--stop-timeout-s", type=float, default=10.0)
    add_options(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    options.headless = True  # the shape worker quits (not just stops) at its end
    setup_logging("WARNING")
    shape = StepLoadShape(**json.loads(options.shape_config)) if options.shape == "steps" else None
    env = Environment(
        user_classes=[LLMUser],
        shape_class=shape,
        events=events,
        host=options.host,
        parsed_options=options,
        stop_timeout=options.stop_timeout_s,
    )
    runner = env.create_local_runner()
    writer = StatsCSVFileWriter(env, PERCENTILES_TO_REPORT, options.csv_prefix, full_history=True)
    greenlets = [gevent.spawn(writer.stats_writer), gevent.spawn(stats_history, runner)]
    env.events.init.fire(environment=env, runner=runner, web_ui=None)
    if shape is not None:
        runner.start_shape()
    else:
        runner.start(options.users, spawn_rate=options.spawn_rate)
    gevent.spawn_later(options.run_time_s, runner.quit)
    runner.greenlet.join()
    env.events.quitting.fire(environment=env, reverse=True)
    for greenlet in greenlets:
        greenlet.kill(block=True)
    _write_final_csvs(env, writer, options.csv_prefix)
    if shape is not None:
        with open(options.csv_prefix + "_shape.json", "w", encoding="utf-8") as handle:
            json.dump({"steps": shape.steps, "stop_reason": shape.stop_reason}, handle, indent=2)
    return 0


def _write_final_csvs(env: Environment, writer: StatsCSVFileWriter, prefix: str) -> None:
    """Rewrite the summary CSVs once the run is over (the writer greenlet rewrites them every second)."""
    writer.stats_history_flush()
    writer.close_files()
    final = StatsCSV(env, PERCENTILES_TO_REPORT)
    for suffix, method in (
        ("_stats.csv", final.requests_csv),
        ("_failures.csv", final.failures_csv),
        ("_exceptions.csv", final.exceptions_csv),
    ):
        with open(prefix + suffix, "w", newline="", encoding="utf-8") as handle:
            method(csv.writer(handle))


if __name__ == "__main__":
    logging.getLogger("locust").setLevel(logging.WARNING)
    sys.exit(main())
