"""``lmforge demo`` (``make demo``): the whole job on one checkpoint, on this machine's CPU.

Stages, each printed with its progress and time:

1. load the checkpoint (default: the embedded SmolLM2-135M-Instruct; ``--smoke``: a tiny random
   Llama);
2. prepare the dialog data (``compress.data.prepare``: chatterbot-corpus English, or ``--data``);
3. fine-tune a few dozen steps (``compress.train.finetune``, fp32 on CPU, one 96-token row a step): the
   teacher of every later comparison;
4. distil the fine-tuned teacher into a shallower student (``compress.train.distill``: least important
   layers dropped, healed by logit KD on the dialogs plus the teacher's own engine-generated
   replies; ``--full`` spends the longer budget);
5. INT8-quantize the teacher and the student (``compress.quantize.methods``, ``--int8-method``);
6. evaluate fp32, bf16, INT8, student and student+INT8 against the fine-tuned teacher
   (``compress.evaluate.quality``: teacher-forced perplexity, KL, same top-1 on the held-out split, size);
7. export them into a Triton model repository (``deploy.export``; bf16 = the fp32 checkpoint run
   by an engine in bf16), plus the fp32 model with ``max_num_seqs=1`` (batching off) unless
   ``--no-batching-compare``;
8. serve them on the real Triton server (``deploy.triton.TritonServer``, 127.0.0.1, free ports);
9. load-test each with Locust for a fixed time (``bench.loadtest``), and the whole stack (student +
   INT8, continuous batching, prefix caching) at ``--stack-users``, then stop the server;
   then the plain baseline: transformers ``generate``, fp32, one request at a time, in process;
10. report: one table (size, perplexity, KL, same top-1, output tok/s, TTFT p50/p99 per model;
   batching on vs off at ``--batching-users``; whole stack vs HF ``generate``), one PNG
   (``quality_vs_speed.png``: KL to the teacher vs served output tok/s, one point per model) and
   ``OUT/report.json`` with every stage's figures, next to each load test's report directory.

A stage that fails stops the demo with that stage's error; the server is stopped on every path
out of stage 7.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.compression import bf16_copy
from bench.harness import write_json
from bench.loadtest import LoadTestConfig, run_loadtest
from compress.data.prepare import DEFAULT_INPUT, DataConfig, prepare
from compress.evaluate import quality as evaluation
from compress.quantize.methods import quantize as quantize_checkpoint
from compress.train.distill import FULL_BUDGET, DistillConfig, DistillRecipe
from compress.train.finetune import FinetuneConfig, FinetuneRecipe
from deploy.export import export as export_model
from deploy.triton import TritonServer, free_ports
from engine.checkpoint.outputs import DEMO, check_output_dir
from engine.checkpoint.store import DEFAULT_MODEL, make_tiny_llama, resolve_checkpoint
from engine.cli_options import add_config_option, config_fields
from engine.errors import LmforgeError, UsageError
from engine.records import read_records
from engine.tables import fmt, table_lines

SMOKE_MODEL = "tiny-random"
#: The ``DemoConfig`` budgets of ``--smoke``: every stage runs, on a few records and steps.
SMOKE_BUDGET = {
    "finetune_steps": 2,
    "distill_steps": 2,
    "student_layers": "0",
    "generate_records": 4,
    "micro_batch_size": 2,
    "max_length": 64,
    "eval_records": 8,
    "loadtest_s": 4.0,
    "users": 2,
    "max_tokens": 8,
    "num_prompts": 16,
    "batching_compare": False,
    "stack_users": 2,
    "baseline_requests": 2,
}


class DemoStageError(LmforgeError, RuntimeError):
    """A stage failed; ``stage`` names it and the cause is chained."""

    def __init__(self, stage: str, cause: BaseException) -> None:
        self.stage = stage
        super().__init__(f"stage '{stage}' failed: {type(cause).__name__}: {cause}")


@dataclasses.dataclass
class DemoConfig:
    """Budgets and inputs of one demo run (``--smoke`` shrinks all of them)."""

    model: str = DEFAULT_MODEL
    data: list[str] | None = None
    out: str = "reports/demo"
    finetune_steps: int = 24
    distill_steps: int = 84  # compress.train.distill.DistillConfig's defaults
    student_layers: str = "drop:7"
    generate_records: int = 400
    int8_method: str = "w8a8"
    full: bool = False
    micro_batch_size: int = 1
    max_length: int = 96
    precision: str = "fp32"
    eval_records: int | None = 32
    loadtest_s: float = 20.0
    users: int = 4
    max_tokens: int = 32
    num_prompts: int | None = None
    batching_compare: bool = True
    batching_users: int = 16
    stack_users: int = 64
    baseline_requests: int = 4
    threads: int | None = None
    smoke: bool = False

    @classmethod
    def smoke_config(cls, out: str, model: str | None = None, data: list[str] | None = None) -> "DemoConfig":
        """Tiny budgets; ``model`` ``None`` builds a tiny random Llama, else that checkpoint is used."""
        return cls(model=model or SMOKE_MODEL, data=data, out=out, **SMOKE_BUDGET, smoke=True)

    def validate(self) -> None:
        """Raises ``UsageError`` (a ``ValueError``) naming the bad field."""
        if self.threads is not None and self.threads < 1:
            raise UsageError(f"threads={self.threads}: must be >= 1 (--threads)")
        if self.int8_method not in ("int8-weight-only", "w8a8"):
            raise UsageError(f"int8_method={self.int8_method!r}: use int8-weight-only or w8a8 (--int8-method)")
        for name in (
            "finetune_steps",
            "distill_steps",
            "micro_batch_size",
            "max_length",
            "users",
            "max_tokens",
            "batching_users",
            "stack_users",
            "baseline_requests",
        ):
            if getattr(self, name) < 1:
                raise UsageError(f"{name}={getattr(self, name)}: must be >= 1 (--{name.replace('_', '-')})")
        if self.loadtest_s <= 0:
            raise UsageError(f"loadtest_s={self.loadtest_s}: must be > 0 (--loadtest-s)")
        for item in self.data or []:  # checked before any stage runs, so nothing is trained on a typo
            if not item.startswith("chatterbot:") and not Path(item).exists():
                raise UsageError(f"--data {item}: not found; pass chatterbot:LANG, a .yml, .jsonl or text file")


@dataclasses.dataclass
class StageRecord:
    """One line of the demo's progress and of ``report.json``'s ``stages``."""

    name: str
    status: str  # "done", "skipped", "failed"
    seconds: float
    detail: str = ""


class Demo:
    """Runs the stages in order, records them, and builds the final report."""

    def __init__(self, config: DemoConfig, log: Callable[[str], None] = print) -> None:
        self.config = config
        self.out = Path(config.out).resolve()
        self.log = log
        self.stages: list[StageRecord] = []
        self.results: dict[str, Any] = {}
        self.threads = cpu_threads(config.threads)
        self.started = time.perf_counter()

    # -- stage bookkeeping ------------------------------------------------------------------

    def stage(self, name: str, fn: Callable[[], Any], *, needs: tuple[str, ...] = ()) -> Any:
        """Run one stage; ``None`` when skipped. Raises :class:`DemoStageError`."""
        number = len(self.stages) + 1
        missing = [n for n in needs if self.results.get(n) is None]
        if missing:
            self._record(StageRecord(name, "skipped", 0.0, f"needs {', '.join(missing)}"), number)
            return None
        self.log(f"[{number}] {name} ...")
        t = time.perf_counter()
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001  (any failure stops the demo, named by stage)
            self._record(StageRecord(name, "failed", time.perf_counter() - t, f"{type(exc).__name__}: {exc}"), number)
            raise DemoStageError(name, exc) from exc
        self.results[name] = value
        self._record(StageRecord(name, "done", time.perf_counter() - t, _describe(value)), number)
        self.write_report()  # after every stage: a demo stopped from outside keeps what it measured
        return value

    def _record(self, record: StageRecord, number: int) -> None:
        self.stages.append(record)
        detail = f": {record.detail}" if record.detail else ""
        self.log(f"[{number}] {record.name}: {record.status} ({record.seconds:.1f} s){detail}")

    # -- the job ----------------------------------------------------------------------------

    def run(self) -> dict:
        """All stages, then ``report.json``; returns the report.

        Raises:
            DemoStageError: a stage failed. OutputDirError: ``out`` is unsafe to write into.
        """
        inputs = [p for p in [self.config.model, *(self.config.data or [])] if Path(p).exists()]
        self.out = check_output_dir(self.out, kind=DEMO, sources=tuple(inputs))
        self.out.mkdir(parents=True, exist_ok=True)

        torch.set_num_threads(self.threads)
        self.log(
            f"using {self.threads} CPU thread(s) per process (load average {os.getloadavg()[0]:.1f} on "
            f"{os.cpu_count()} cores)"
        )
        self.stage("load", self.load)
        self.stage("data", self.prepare_data)
        self.stage("fine-tune", self.finetune, needs=("load", "data"))
        self.stage("distill", self.distill, needs=("load", "data"))
        self.stage("quantize", self.quantize, needs=("load",))
        self.stage("evaluate", self.evaluate, needs=("load",))
        self.stage("export", self.export, needs=("load",))
        self.stage("serve + load test", self.serve_and_load, needs=("export",))
        self.stage("baseline: HF generate", self.hf_baseline, needs=("load",))
        return self.write_report()

    def tuned(self) -> Path:
        """The fp32 checkpoint the later stages use: the fine-tuned one, else the loaded one."""
        return self.results.get("fine-tune") or self.results["load"]

    def load(self) -> Path:
        if self.config.model == SMOKE_MODEL:
            return make_tiny_llama(self.out / "tiny-random", seed=0)
        return resolve_checkpoint(self.config.model)

    def prepare_data(self) -> Path:
        inputs = self.config.data or [DEFAULT_INPUT]
        out = self.out / "data"
        prepare(DataConfig(inputs=inputs), out, verbose=False)
        return out

    def finetune(self) -> Path:
        c = self.config
        config = FinetuneConfig(
            model=str(self.results["load"]),
            data=str(self.results["data"]),
            run_dir=str(self.out / "finetune"),
            max_steps=c.finetune_steps,
            micro_batch_size=c.micro_batch_size,
            max_length=c.max_length,
            eval_every=0,
            max_val_batches=4,
            precision=c.precision,
            device="cpu",
            progress=True,  # a bar on a terminal, else a line a minute
        )
        result, final = FinetuneRecipe(config).run()
        if result.status != "completed" or final is None:
            raise RuntimeError(f"fine-tuning ended with status {result.status}: {result.message}")
        return Path(final)

    def distill(self) -> Path:
        c = self.config
        overrides = dict(FULL_BUDGET) if c.full else {}
        config = DistillConfig(
            **{
                "model": str(self.tuned()),
                "data": str(self.results["data"]),
                "run_dir": str(self.out / "distill"),
                "max_steps": c.distill_steps,
                "student_layers": c.student_layers,
                "generate_records": c.generate_records,
                "eval_every": 0,
                "max_val_batches": 4,
                "device": "cpu",
                "progress": True,
                **(
                    {"micro_batch_size": 2, "max_length": 64, "generate_tokens": 8, "calibration_records": 4}
                    if c.smoke
                    else {}
                ),
                **overrides,
            }
        )
        result, final = DistillRecipe(config).run()
        if result.status != "completed" or final is None:
            raise RuntimeError(f"distillation ended with status {result.status}: {result.message}")
        return Path(final)

    def quantize(self) -> dict[str, Path]:
        """INT8 (``--int8-method``) of the teacher (``int8``) and of the student (``student_int8``)."""
        method = self.config.int8_method
        out = {"int8": Path(quantize_checkpoint(self.tuned(), self.out / f"int8-{method}", method=method))}
        if self.results.get("distill"):
            out["student_int8"] = Path(
                quantize_checkpoint(self.results["distill"], self.out / f"student-{method}", method=method)
            )
        return out

    def models(self) -> dict[str, Path]:
        """Label -> checkpoint of every model compared (bf16 shares the fp32 checkpoint)."""
        models = {"fp32": self.tuned()}
        quantized = self.results.get("quantize") or {}
        if quantized.get("int8"):
            models["int8"] = quantized["int8"]
        if self.results.get("distill"):
            models["student"] = self.results["distill"]
        if quantized.get("student_int8"):
            models["student_int8"] = quantized["student_int8"]
        return models

    def evaluate(self) -> dict:
        models = self.models()
        models = {"fp32": models["fp32"], "bf16": bf16_copy(models["fp32"], self.out / "bf16"), **models}
        return evaluate_models(evaluation, models, self.results.get("data"), self.config, self.log)

    def export(self) -> dict[str, str]:
        repo = self.out / "model_repository"
        names = self.models()
        names = {"fp32": names["fp32"], "bf16": names["fp32"], **names}
        engines = {k: {"num_threads": self.threads} for k in names}
        engines["bf16"]["dtype"] = "bfloat16"
        for key in ("int8", "student_int8"):
            if key in engines:
                engines[key]["dtype"] = "bfloat16"  # INT8 weights, bf16 activations
        if self.config.batching_compare:
            names["fp32_batching_off"] = self.tuned()
            engines["fp32_batching_off"] = {"num_threads": self.threads, "max_num_seqs": 1}
        for key, checkpoint in names.items():
            export_model(checkpoint, repo, name=f"demo_{key}", kind="llm", engine=engines[key])
        return {key: f"demo_{key}" for key in names}

    def serve_and_load(self) -> dict:
        models = self.results["export"]
        http, grpc, metrics = free_ports(3)
        repo = self.out / "model_repository"
        runs: dict[str, dict] = {}
        prompts = self._prompt_file()
        self.log(f"      starting Triton on 127.0.0.1:{http} with {', '.join(models.values())}")
        with TritonServer(
            repo,
            http_port=http,
            grpc_port=grpc,
            metrics_port=metrics,
            models=list(models.values()),
            log_path=self.out / "tritonserver.log",
        ) as server:
            stack = whole_stack_model(models)
            for key, name in models.items():
                users = self.config.batching_users if key == "fp32_batching_off" else self.config.users
                plan = [(key, users)]
                if key == "fp32" and self.config.batching_compare:
                    plan.append(("fp32_batching_on", self.config.batching_users))
                if key == stack:
                    plan.append((WHOLE_STACK, self.config.stack_users))
                for label, u in plan:
                    config = LoadTestConfig(
                        host=server.http_url,
                        model=name,
                        users=u,
                        spawn_rate=float(u),
                        run_time_s=self.config.loadtest_s,
                        max_tokens=self.config.max_tokens,
                        prompts=prompts,
                        num_prompts=self.config.num_prompts,
                        ignore_eos=True,
                        chat_template=str(self.tuned()),
                        warmup_requests=1 if key == "fp32_batching_off" else None,
                    )
                    summary = run_loadtest(config, self.out / "loadtest" / label, log=lambda m: self.log("      " + m))
                    runs[label] = summary
                    self.log("      " + _one_line(label, summary))
        self.log("      Triton stopped")
        return runs

    def hf_baseline(self) -> dict:
        """The plain start: the loaded fp32 checkpoint, transformers ``generate``, one request at a time.

        Same held-out chat prompts and output length as the load tests (greedy, EOS ignored).
        Returns ``{"requests", "output_tokens", "wall_s", "output_tok_s"}``.
        """
        path = self.results["load"]
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        questions = _baseline_questions(self._prompt_file(), self.config.baseline_requests)
        tokens, start = 0, time.perf_counter()
        for question in questions:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt"
            )
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=self.config.max_tokens,
                    min_new_tokens=self.config.max_tokens,
                    pad_token_id=tokenizer.eos_token_id,
                )
            tokens += out.shape[1] - ids.shape[1]
        wall_s = time.perf_counter() - start
        return {"requests": len(questions), "output_tokens": tokens, "wall_s": wall_s, "output_tok_s": tokens / wall_s}

    def _prompt_file(self) -> str | None:
        data = self.results.get("data")
        return str(Path(data) / "val.jsonl") if data and (Path(data) / "val.jsonl").is_file() else None

    # -- report -----------------------------------------------------------------------------

    def write_report(self) -> dict:
        rows = comparison_rows(self.results)
        report = {
            "wall_s": time.perf_counter() - self.started,
            "config": dataclasses.asdict(self.config),
            "stages": [dataclasses.asdict(s) for s in self.stages],
            "checkpoints": {k: str(v) for k, v in self.models().items()} if self.results.get("load") else {},
            "comparison": rows,
            "batching": batching_rows(self.results),
            "baseline": stack_vs_baseline(self.results),
            "evaluation": self.results.get("evaluate"),
            "loadtest_dirs": sorted(str(p) for p in (self.out / "loadtest").glob("*") if p.is_dir()),
        }
        if rows:
            report["plot"] = plot_quality_vs_speed(rows, self.out / "quality_vs_speed.png")
        write_json(self.out / "report.json", report)
        return report


def cpu_threads(requested: int | None) -> int:
    """Threads for torch in the demo and in each served engine.

    ``None`` picks: all cores when the machine is otherwise idle, one when it is already busier
    than its cores (load average >= cores). Two OpenMP threads that keep losing their core to
    other processes wait on each other at every parallel region; measured on a shared 2-core
    machine, one thread ran SmolLM2's forward+backward 10-15x faster than two.

    Raises:
        ValueError: ``requested < 1``.
    """
    cores = os.cpu_count() or 1
    if requested is not None:
        if requested < 1:
            raise ValueError(f"threads={requested}: must be >= 1 (--threads)")
        return requested
    return 1 if os.getloadavg()[0] >= cores else cores


def evaluate_models(
    evaluate, models: dict[str, Path], data: Path | None, config: DemoConfig, log: Callable[[str], None] = print
) -> dict:
    """Perplexity, KL and same top-1 on the held-out split, greedy agreement and size of each model.

    Uses ``compress.evaluate.quality.evaluate`` (the first model is the agreement reference) and prints
    its table. Returns ``{label: metrics}`` with the labels of ``models``.
    """
    records, name = None, None
    if data is not None and (Path(data) / "val.jsonl").is_file():
        records, name = evaluate.read_records(Path(data) / "val.jsonl"), f"{data}/val.jsonl"
    eval_config = evaluate.EvalConfig(
        max_records=config.eval_records,
        agreement_tokens=config.max_tokens,
        latency_tokens=config.max_tokens,
        measure_latency=False,  # the demo's speed is the served load test, not an in-process decode timing
    )
    results = evaluate.evaluate(
        list(models.values()), records=records, data_name=name, config=eval_config, log=lambda m: log("      " + m)
    )
    log("      " + evaluate.format_table(results).replace("\n", "\n      "))
    by_path = {str(resolve_checkpoint(path)): label for label, path in models.items()}
    return {by_path[path]: metrics for path, metrics in results.items()}


def _baseline_questions(val_file: str | None, count: int) -> list[str]:
    """First user turns of the held-out records (a fixed question when there is no data)."""
    questions: list[str] = []
    if val_file:
        for record in read_records(val_file):
            user = next((m["content"] for m in record.get("messages", []) if m.get("role") == "user"), None)
            if user:
                questions.append(user)
            if len(questions) == count:
                break
    return questions or ["What is the capital of France?"] * count


#: Label of the whole-stack load test: the most compressed model at ``stack_users`` users.
WHOLE_STACK = "whole_stack"


def whole_stack_model(models: dict[str, str]) -> str:
    """The model of the whole-stack run: student + INT8 when the demo made it, else the next most compressed."""
    return next(key for key in ("student_int8", "student", "int8", "fp32") if key in models)


def stack_vs_baseline(results: dict) -> dict | None:
    """The whole-stack run's output tok/s (else the best served run) over the in-process HF baseline's tok/s."""
    baseline = results.get("baseline: HF generate")
    runs = results.get("serve + load test") or {}
    served = {
        label: s["metrics"]["output_throughput_tok_s"]
        for label, s in runs.items()
        if s["metrics"].get("output_throughput_tok_s")
    }
    if not baseline or not served:
        return None
    best = WHOLE_STACK if WHOLE_STACK in served else max(served, key=served.get)
    return {
        "hf_generate_tok_s": baseline["output_tok_s"],
        "best_served": best,
        "best_served_users": runs[best]["config"]["users"],
        "best_served_tok_s": served[best],
        "factor": served[best] / baseline["output_tok_s"],
    }


def _describe(value: Any) -> str:
    if isinstance(value, Path | str):
        return str(value)
    if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
        return ", ".join(value.values())
    return ""


def _one_line(label: str, summary: dict) -> str:
    m = summary["metrics"]
    tok_s = m["output_throughput_tok_s"]
    ttft = m["ttft_ms"]["p50"]
    return (
        f"{label}: {m['successful']} ok / {m['failed']} failed, "
        f"{'-' if tok_s is None else f'{tok_s:.1f}'} tok/s, TTFT p50 {'-' if ttft is None else f'{ttft:.0f}'} ms"
    )


#: Models of the comparison, in table order.
MODEL_ORDER = ("fp32", "bf16", "int8", "student", "student_int8")


def comparison_rows(results: dict) -> list[dict]:
    """One row per model: size (MiB), quality vs the teacher, served output tok/s, TTFT p50/p99 (ms).

    Missing figures are ``None``. Quality: teacher-forced perplexity, mean KL(teacher || model)
    and same top-1 on the held-out split (``compress.evaluate.quality``).
    """
    rows = []
    runs = results.get("serve + load test") or {}
    evaluation = results.get("evaluate") or {}
    for key in MODEL_ORDER:
        ev = evaluation.get(key) or {}
        metrics = (runs.get(key) or {}).get("metrics") or {}
        if not ev and not metrics:
            continue
        rows.append(
            {
                "model": key,
                "size_mib": ev["size_bytes"] / 2**20 if ev.get("size_bytes") else None,
                "perplexity": ev.get("perplexity"),
                "kl_mean": ev.get("kl_mean"),
                "same_top1": ev.get("same_top1"),
                "output_tok_s": metrics.get("output_throughput_tok_s"),
                "ttft_p50_ms": (metrics.get("ttft_ms") or {}).get("p50"),
                "ttft_p99_ms": (metrics.get("ttft_ms") or {}).get("p99"),
                "failed": metrics.get("failed"),
            }
        )
    return rows


def plot_quality_vs_speed(rows: list[dict], path: Path) -> str | None:
    """``quality_vs_speed.png``: KL(teacher || model) against served output tok/s, one labelled point per model."""
    points = [r for r in rows if r.get("output_tok_s") and r.get("kl_mean") is not None]
    if not points:
        return None
    import matplotlib  # optional dependency: imported only when there is a plot to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, r in enumerate(sorted(points, key=lambda r: r["output_tok_s"])):
        ax.scatter(r["output_tok_s"], r["kl_mean"], s=40)
        ax.annotate(
            f"{r['model']} (ppl {r['perplexity']:.2f})",
            (r["output_tok_s"], r["kl_mean"]),
            textcoords="offset points",
            xytext=(0, 7 if i % 2 == 0 else -13),  # centred on the point; neighbours alternate above / below
            ha="center",
            fontsize=8,
        )
    ax.margins(x=0.15, y=0.15)  # room for the labels of the outermost points
    ax.set_xlabel("served output tok/s (Triton, Locust)")
    ax.set_ylabel("mean KL(teacher || model), nats")
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_title("quality vs speed (held-out dialogs, vs the fine-tuned teacher)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def batching_rows(results: dict) -> dict | None:
    """Continuous batching on vs off (``max_num_seqs=1``) at the same users; ``None`` if not measured."""
    runs = results.get("serve + load test") or {}
    on, off = runs.get("fp32_batching_on"), runs.get("fp32_batching_off")
    if not on or not off:
        return None
    row = {}
    for label, summary in (("on", on), ("off", off)):
        m = summary["metrics"]
        row[label] = {
            "users": summary["config"]["users"],
            "output_tok_s": m["output_throughput_tok_s"],
            "ttft_p50_ms": m["ttft_ms"]["p50"],
            "ttft_p99_ms": m["ttft_ms"]["p99"],
            "failed": m["failed"],
        }
    if row["on"]["output_tok_s"] and row["off"]["output_tok_s"]:
        row["throughput_ratio"] = row["on"]["output_tok_s"] / row["off"]["output_tok_s"]
    return row


def format_final_table(report: dict) -> str:
    """The one table of the demo: fp32 vs INT8, then batching on vs off."""
    columns = [
        ("model", "<13"),
        ("size MiB", ">9"),
        ("perplexity", ">11"),
        ("KL mean", ">8"),
        ("top-1", ">6"),
        ("tok/s", ">8"),
        ("TTFT p50 ms", ">12"),
        ("TTFT p99 ms", ">12"),
    ]
    cells = [
        [
            r["model"],
            fmt(r["size_mib"]),
            fmt(r["perplexity"], ".2f"),
            fmt(r["kl_mean"], ".4f"),
            fmt(r["same_top1"], ".1%"),
            fmt(r["output_tok_s"]),
            fmt(r["ttft_p50_ms"], ".0f"),
            fmt(r["ttft_p99_ms"], ".0f"),
        ]
        for r in report["comparison"]
    ]
    lines = table_lines(columns, cells, indent="  ", rule=False)
    b = report.get("batching")
    if b:
        lines.append(
            f"  batching at {b['on']['users']} users: on {fmt(b['on']['output_tok_s'])} tok/s "
            f"(TTFT p50 {fmt(b['on']['ttft_p50_ms'], '.0f')} ms) vs off (max_num_seqs=1) "
            f"{fmt(b['off']['output_tok_s'])} tok/s (TTFT p50 {fmt(b['off']['ttft_p50_ms'], '.0f')} ms): "
            f"x{fmt(b.get('throughput_ratio'), '.2f')}"
        )
    base = report.get("baseline")
    if base:
        lines.append(
            f"  whole stack vs HF generate fp32 one request at a time (in process): "
            f"{fmt(base['best_served_tok_s'])} tok/s ({base['best_served']}, {base.get('best_served_users')} users) "
            f"vs {fmt(base['hf_generate_tok_s'])} tok/s: "
            f"x{fmt(base['factor'], '.2f')}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    add_config_option(parser, d, "model", "checkpoint: name, .gguf file or directory (default smollm2-135m)")
    parser.add_argument(
        "--data",
        action="append",
        default=None,
        help="data input for compress.data.prepare (chatterbot:LANG, .yml, .jsonl, .txt); repeatable",
    )
    add_config_option(parser, d, "out", "report directory (default reports/demo)")
    add_config_option(parser, d, "finetune_steps", "optimizer steps of the fine-tune")
    add_config_option(parser, d, "distill_steps", "optimizer steps of the distillation (default %(default)s)")
    add_config_option(parser, d, "student_layers", "student of the distillation (default %(default)s)")
    add_config_option(
        parser, d, "generate_records", "teacher replies generated with the engine as KD data (default %(default)s)"
    )
    add_config_option(
        parser, d, "int8_method", "INT8 method (default %(default)s)", choices=("int8-weight-only", "w8a8")
    )
    parser.add_argument(
        "--full", action="store_true", help="the longer distillation budget (compress.train.distill.FULL_BUDGET)"
    )
    add_config_option(parser, d, "micro_batch_size")
    add_config_option(parser, d, "max_length", "tokens per training row")
    add_config_option(
        parser,
        d,
        "precision",
        "fine-tune precision (fp32 default: CPUs without bf16 units emulate it slowly)",
        choices=("fp32", "bf16"),
    )
    add_config_option(parser, d, "eval_records", "held-out records scored for perplexity")
    add_config_option(parser, d, "loadtest_s", "seconds of load per model")
    add_config_option(parser, d, "users", "Locust users per fp32/INT8 load test")
    add_config_option(parser, d, "max_tokens", "output tokens per request")
    add_config_option(parser, d, "batching_users", "users of the batching on/off comparison")
    add_config_option(
        parser,
        d,
        "stack_users",
        "users of the whole-stack run (student + INT8, batching, prefix caching; default %(default)s)",
    )
    add_config_option(parser, d, "baseline_requests", "prompts for the HF generate (one at a time) baseline")
    parser.add_argument("--no-batching-compare", action="store_true", help="skip the max_num_seqs=1 comparison")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per process (default: all cores if the machine is idle, else 1)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny budgets and (unless --model is given) a tiny random model: an end-to-end check",
    )


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    fields = config_fields(DemoConfig, args, batching_compare=not args.no_batching_compare)
    if args.smoke:  # the smoke budgets, then every flag the user set (``--threads 1``, ``--finetune-steps 3``...)
        config = DemoConfig.smoke_config(
            args.out if args.out != DemoConfig.out else "reports/demo-smoke",
            model=None if args.model == DEFAULT_MODEL else args.model,
            data=args.data,
        )
        defaults = DemoConfig()
        given = {
            name: value
            for name, value in fields.items()
            if name not in ("out", "model", "data") and value != getattr(defaults, name)
        }
        return dataclasses.replace(config, **given)
    return DemoConfig(**fields)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    config.validate()
    demo = Demo(config)
    try:
        report = demo.run()
    except DemoStageError as exc:
        demo.write_report()
        print(f"demo stopped: {exc}", file=sys.stderr)
        return 1
    print(format_final_table(report))
    unavailable = [s["name"] for s in report["stages"] if s["status"] != "done"]
    if unavailable:
        print(f"not run: {', '.join(unavailable)} (see above)")
    print(f"demo finished in {report['wall_s']:.0f} s; report: {demo.out / 'report.json'}")
    return 0
