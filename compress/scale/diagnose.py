"""``lmforge diagnose RUN_DIR``: name the cause of a misbehaving training run from its metrics.

Reads ``RUN_DIR/metrics.jsonl`` (train records: step, loss, lr, grad_norm, data_wait_s,
compute_s, ...; val records: step, loss) and ``RUN_DIR/run.json`` (train_data, val_data, config)
as ``lmforge finetune`` / ``distill`` write them, and reports each finding with its evidence
(steps and values) and the remedy practitioners apply. Detectors are robust statistics over the
logged series (medians and median absolute deviations, so a single outlier does not hide
another); thresholds are module constants.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from compress.data.dedup import MinHashConfig, cross_duplicates
from engine.checkpoint.outputs import check_output_file, write_output_file
from engine.errors import UsageError
from engine.records import read_jsonl, read_records

SPIKE_WINDOW = 10  # preceding train steps a spike is compared with
SPIKE_MIN_HISTORY = 5
SPIKE_MAD_FACTOR = 6.0  # robust z-score (MAD scaled to sigma) above the rolling median
SPIKE_MIN_RELATIVE = 0.2  # and at least 20 % above it
OSCILLATION_SIGN_CHANGES = 0.6  # fraction of consecutive loss differences that flip sign
OSCILLATION_AMPLITUDE = 0.05  # median |loss - centred rolling median| relative to the loss
EXPLOSION_FACTOR = 10.0  # grad norm above this many times the median of earlier steps
VANISHING_RATIO = 1e-3  # late median grad norm below this fraction of the early median
DIVERGENCE_RISE = 0.05  # last val loss this fraction above the best, after >= 2 rises in a row
FLAT_VAL_DROP = 0.01  # val loss improved by less than 1 % of its first value ...
FLAT_TRAIN_DROP = 0.10  # ... while train loss fell by more than 10 %
WARMUP_HORIZON = 3.0  # instability within this many warm-up lengths blames the warm-up
DATA_WAIT_FRACTION = 0.2  # share of step time spent waiting for data
LEAK_JACCARD = 0.8  # MinHash Jaccard threshold for a near-duplicate across splits
LEAK_NUM_PERM = 128
MAX_RECORDS = 50_000  # records read per split for the overlap check


class RunDirError(UsageError):
    """RUN_DIR or its files are missing or corrupt; the message names the file and line."""


@dataclass
class Finding:
    """One diagnosed problem: what, the evidence from the logs, and what to do."""

    kind: str
    summary: str
    evidence: dict
    remedy: str


@dataclass
class RunLog:
    """Parsed RUN_DIR: train and val records in step order, and run.json."""

    train: list[dict]
    val: list[dict]
    run: dict = field(default_factory=dict)

    def series(self, key: str) -> list[tuple[int, float]]:
        """``(step, value)`` of train records that carry ``key`` (non-numeric values skipped)."""
        return [(r["step"], float(r[key])) for r in self.train if isinstance(r.get(key), (int, float))]


#: Fields of a metrics line that must be numbers when present (NaN / null allowed: a skipped step).
NUMERIC_FIELDS = ("loss", "lr", "grad_norm", "data_wait_s", "compute_s")


def _metrics_record(record: object, source: str, line: int) -> dict:
    """The ``Schema`` (``compress.data.records``) of a ``metrics.jsonl`` line."""
    if not isinstance(record, dict) or "step" not in record or record.get("split") not in ("train", "val"):
        raise RunDirError(f"{source}:{line}: expected an object with 'step' and 'split' of train/val")
    if not isinstance(record["step"], int) or isinstance(record["step"], bool) or record["step"] < 0:
        raise RunDirError(f"{source}:{line}: step={record['step']!r}; expected an integer >= 0")
    for key in NUMERIC_FIELDS:
        value = record.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise RunDirError(f"{source}:{line}: {key}={value!r}; expected a number (or null)")
    return record


def load_run(run_dir: str | Path) -> RunLog:
    """Read ``metrics.jsonl`` (required) and ``run.json`` (optional) from ``run_dir``.

    Raises:
        RunDirError: missing, empty or non-UTF-8 metrics file, or a line that is not a JSON
            object with an integer ``step`` and ``split`` (names path and line number).
    """
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise RunDirError(f"{metrics}: not found; pass the RUN_DIR that finetune/distill wrote")
    train, val = [], []
    for record in read_jsonl(metrics, _metrics_record, RunDirError):
        (train if record["split"] == "train" else val).append(record)
    if not train:
        raise RunDirError(
            f"{metrics}: no train records, nothing to diagnose; run (or resume) finetune/distill until it logs a step"
        )
    run = {}
    run_json = run_dir / "run.json"
    if run_json.is_file():
        try:
            run = json.loads(run_json.read_text())
        except json.JSONDecodeError as error:
            raise RunDirError(f"{run_json}: not JSON ({error.msg})") from error
    return RunLog(sorted(train, key=lambda r: r["step"]), sorted(val, key=lambda r: r["step"]), run)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


# ---------------------------------------------------------------------------------------------
# Detectors: each takes the RunLog and returns a list of findings (empty when healthy)
# ---------------------------------------------------------------------------------------------


def spike_steps(series: list[tuple[int, float]]) -> list[tuple[int, float, float]]:
    """``(step, value, rolling median)`` where a value jumps far above the preceding window."""
    spikes = []
    for i in range(SPIKE_MIN_HISTORY, len(series)):
        window = [v for _, v in series[max(0, i - SPIKE_WINDOW) : i] if math.isfinite(v)]
        if len(window) < SPIKE_MIN_HISTORY:
            continue
        med = _median(window)
        mad = 1.4826 * _median([abs(v - med) for v in window])
        step, value = series[i]
        if not math.isfinite(value) or (
            value - med > SPIKE_MAD_FACTOR * mad and value > med * (1 + SPIKE_MIN_RELATIVE)
        ):
            spikes.append((step, value, med))
    return spikes


def detect_loss_spikes(log: RunLog) -> list[Finding]:
    spikes = spike_steps(log.series("loss"))
    if not spikes:
        return []
    return [
        Finding(
            "loss_spikes",
            f"{len(spikes)} train loss spike(s)",
            {"spikes": [{"step": s, "loss": v, "preceding_median": round(m, 4)} for s, v, m in spikes[:20]]},
            "check that the data is shuffled (a spike at the same step each epoch points to bad records), "
            "lower the learning rate or raise the batch size, clip gradients (max_grad_norm 1.0)",
        )
    ]


def detect_oscillation(log: RunLog) -> list[Finding]:
    losses = [v for _, v in log.series("loss") if math.isfinite(v)]
    if len(losses) < 12:
        return []
    diffs = [b - a for a, b in zip(losses, losses[1:])]
    flips = sum(1 for a, b in zip(diffs, diffs[1:]) if a * b < 0) / (len(diffs) - 1)
    half = 3
    residuals = [
        abs(losses[i] - _median(losses[i - half : i + half + 1])) / abs(_median(losses[i - half : i + half + 1]) or 1)
        for i in range(half, len(losses) - half)
    ]
    amplitude = _median(residuals)
    if flips < OSCILLATION_SIGN_CHANGES or amplitude < OSCILLATION_AMPLITUDE:
        return []
    return [
        Finding(
            "loss_oscillation",
            "train loss oscillates instead of decreasing",
            {
                "sign_change_fraction": round(flips, 3),
                "median_relative_amplitude": round(amplitude, 4),
                "loss_first_last": [losses[0], losses[-1]],
            },
            "lower the learning rate (the optimiser overshoots), raise the batch size or gradient accumulation, "
            "check shuffling (alternating easy/hard batches), clip gradients",
        )
    ]


def detect_grad_norm(log: RunLog) -> list[Finding]:
    series = log.series("grad_norm")
    findings = []
    exploded = []
    for i, (step, value) in enumerate(series):
        earlier = [v for _, v in series[:i] if math.isfinite(v)]
        if not math.isfinite(value) or (
            len(earlier) >= SPIKE_MIN_HISTORY and value > EXPLOSION_FACTOR * _median(earlier)
        ):
            exploded.append({"step": step, "grad_norm": value, "median_before": _median(earlier) if earlier else None})
    if exploded:
        findings.append(
            Finding(
                "grad_norm_explosion",
                f"gradient norm exploded at {len(exploded)} step(s)",
                {"steps": exploded[:20]},
                "clip gradients (max_grad_norm 1.0), lower the learning rate, lengthen warm-up, use bf16 "
                "instead of fp16 "
                "(or a dynamic loss scale), look for bad records at those steps",
            )
        )
    finite = [v for _, v in series if math.isfinite(v)]
    if len(finite) >= 8:
        quarter = len(finite) // 4
        early, late = _median(finite[:quarter]), _median(finite[-quarter:])
        if early > 0 and late < VANISHING_RATIO * early:
            findings.append(
                Finding(
                    "grad_norm_vanishing",
                    "gradient norm vanished",
                    {"early_median": early, "late_median": late, "steps": [series[0][0], series[-1][0]]},
                    "check the learning rate schedule did not decay to zero, that parameters are not frozen by mistake "
                    "(param_change per group), that the loss mask is not empty; use residual-friendly init / norms",
                )
            )
    return findings


def detect_divergence(log: RunLog) -> list[Finding]:
    val = [(r["step"], float(r["loss"])) for r in log.val if isinstance(r.get("loss"), (int, float))]
    if len(val) < 3:
        return []
    best_step, best = min(val, key=lambda sv: sv[1])
    last_step, last = val[-1]
    rising = val[-1][1] > val[-2][1] > val[-3][1]
    train = log.series("loss")
    at_best = [v for s, v in train if s <= best_step]
    after = [v for s, v in train if s > best_step]
    if not (rising and last > best * (1 + DIVERGENCE_RISE) and at_best and after):
        return []
    train_at_best, train_last = _median(at_best[-3:]), _median(after[-3:])
    if train_last >= train_at_best:
        return []
    return [
        Finding(
            "train_val_divergence",
            "validation loss rises while train loss keeps falling (overfitting)",
            {
                "best_val": {"step": best_step, "loss": best},
                "last_val": {"step": last_step, "loss": last},
                "train_loss": {"at_best_val": round(train_at_best, 4), "last": round(train_last, 4)},
            },
            f"keep the checkpoint of step {best_step} (early stopping), add regularisation (weight decay, dropout, "
            "LoRA with a smaller rank), more or more varied data, fewer epochs",
        )
    ]


def _record_text(record: dict) -> str:
    if isinstance(record.get("text"), str):
        return record["text"]
    messages = record.get("messages") or []
    return "\n".join(
        m.get("content", "") for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)
    )


def read_texts(path: str | Path) -> list[str]:
    """Texts of a ``lmforge data`` JSONL split (``text`` or ``messages``), at most ``MAX_RECORDS``.

    Raises:
        RunDirError: missing file or a line that is not a record (``compress.data.records``; names path and line).
    """
    path = Path(path)
    if not path.is_file():
        raise RunDirError(f"{path}: data file named in run.json not found")
    return [_record_text(record) for record in read_records(path, RunDirError)[:MAX_RECORDS]]


def split_overlap(train_path: str | Path, val_path: str | Path) -> dict:
    """Fraction of val records with a near-duplicate in train: ``compress.data.dedup``'s definition
    (MinHash of character shingles, Jaccard >= ``LEAK_JACCARD``), the one ``lmforge data`` applies."""
    train, val = read_texts(train_path), read_texts(val_path)
    pairs = cross_duplicates(train, val, MinHashConfig(threshold=LEAK_JACCARD, num_perm=LEAK_NUM_PERM))
    leaked = sorted({j for _, j, _ in pairs})
    return {
        "train_records": len(train),
        "val_records": len(val),
        "val_with_near_duplicate_in_train": len(leaked),
        "overlap_fraction": round(len(leaked) / len(val), 4) if val else 0.0,
        "example_val_indices": leaked[:10],
    }


def detect_flat_val(log: RunLog) -> list[Finding]:
    val = [float(r["loss"]) for r in log.val if isinstance(r.get("loss"), (int, float))]
    train = [v for _, v in log.series("loss") if math.isfinite(v)]
    if len(val) < 3 or len(train) < 6:
        return []
    val_drop = (val[0] - min(val)) / abs(val[0])
    k = max(1, len(train) // 10)
    train_drop = (_median(train[:k]) - _median(train[-k:])) / abs(_median(train[:k]))
    if val_drop >= FLAT_VAL_DROP or train_drop <= FLAT_TRAIN_DROP:
        return []
    evidence = {
        "val_loss": {"first": val[0], "best": min(val), "evals": len(val)},
        "train_loss_drop_fraction": round(train_drop, 4),
    }
    paths = (log.run.get("train_data"), log.run.get("val_data"))
    if all(paths):
        try:
            evidence["split_overlap"] = split_overlap(*paths)
        except RunDirError as error:
            evidence["split_overlap"] = {"error": str(error)}
    else:
        evidence["split_overlap"] = {"error": "run.json names no train_data/val_data"}
    overlap = evidence["split_overlap"].get("overlap_fraction")
    if overlap is not None and overlap > 0.05:
        remedy = (
            f"{overlap:.0%} of validation records are near-duplicates of training records: the split leaks; "
            "re-split after cross-split deduplication (lmforge data) so validation measures generalisation"
        )
    else:
        remedy = (
            "no train/validation leakage found; check that validation uses the same format and loss mask as "
            "training (chat template, assistant-only loss), that it is from the task's distribution, and that "
            "the learning rate is not too low for the model to generalise"
        )
    return [Finding("val_flat", "validation loss flat from the start while train loss falls", evidence, remedy)]


def warmup_steps(log: RunLog) -> int:
    """Warm-up length in optimizer steps, from run.json's config or else the logged lr.

    ``config.warmup_steps`` if given; else ``round(warmup_ratio * max_steps)`` (at least 1 when
    the ratio is > 0), as ``lmforge finetune`` / ``distill`` schedule it; else the step where the
    logged lr first reaches its peak.
    """
    config = log.run.get("config") or {}
    if isinstance(config.get("warmup_steps"), int):
        return config["warmup_steps"]
    ratio, max_steps = config.get("warmup_ratio"), config.get("max_steps")
    if isinstance(ratio, (int, float)) and isinstance(max_steps, int):
        return max(1, round(ratio * max_steps)) if ratio > 0 else 0
    lrs = log.series("lr")
    if not lrs:
        return 0
    peak = max(v for _, v in lrs)
    if lrs[0][1] >= 0.999 * peak:
        return 0  # no warm-up: the first logged step already runs at the peak lr
    return next(s for s, v in lrs if v >= 0.999 * peak) - lrs[0][0] + 1


def detect_short_warmup(log: RunLog) -> list[Finding]:
    warmup = warmup_steps(log)
    first = log.train[0]["step"] if log.train else 0
    total = (log.train[-1]["step"] - first + 1) if log.train else 0
    horizon = first + max(WARMUP_HORIZON * warmup, 0.1 * total)
    unstable = sorted(
        {s for s, _, _ in spike_steps(log.series("loss")) if s <= horizon}
        | {f["step"] for f in _explosions(log) if f["step"] <= horizon}
    )
    if not unstable:
        return []
    suggested = max(2 * unstable[-1] - 2 * first, 2 * warmup, int(0.05 * total), 10)
    return [
        Finding(
            "warmup_too_short",
            f"instability within the first {int(horizon - first)} steps, warm-up is {warmup} steps",
            {"warmup_steps": warmup, "unstable_steps": unstable[:20], "total_steps": total},
            f"lengthen linear warm-up to about {suggested} steps (Adam's early second-moment estimates are noisy; "
            "5-10 % of training is common), or lower the peak learning rate",
        )
    ]


def _explosions(log: RunLog) -> list[dict]:
    found = [f for f in detect_grad_norm(log) if f.kind == "grad_norm_explosion"]
    return found[0].evidence["steps"] if found else []


def detect_data_bottleneck(log: RunLog) -> list[Finding]:
    rows = [
        (r["step"], float(r["data_wait_s"]), float(r["compute_s"]))
        for r in log.train
        if isinstance(r.get("data_wait_s"), (int, float)) and isinstance(r.get("compute_s"), (int, float))
    ]
    if not rows:
        return []
    wait, compute = sum(w for _, w, _ in rows), sum(c for _, _, c in rows)
    fraction = wait / (wait + compute) if wait + compute > 0 else 0.0
    if fraction <= DATA_WAIT_FRACTION:
        return []
    worst = sorted(rows, key=lambda r: -r[1])[:5]
    return [
        Finding(
            "data_loader_bottleneck",
            f"{fraction:.0%} of step time waits for data",
            {
                "data_wait_fraction": round(fraction, 4),
                "median_data_wait_s": round(_median([w for _, w, _ in rows]), 4),
                "median_compute_s": round(_median([c for _, _, c in rows]), 4),
                "slowest_steps": [
                    {"step": s, "data_wait_s": round(w, 4), "compute_s": round(c, 4)} for s, w, c in worst
                ],
            },
            "raise DataLoader num_workers, set pin_memory and prefetch_factor, pre-tokenize the data once instead of "
            "per step, keep the data on local disk; the accelerator idles while it waits",
        )
    ]


DETECTORS = (
    detect_loss_spikes,
    detect_oscillation,
    detect_grad_norm,
    detect_divergence,
    detect_flat_val,
    detect_short_warmup,
    detect_data_bottleneck,
)


def diagnose(run_dir: str | Path) -> list[Finding]:
    """All findings for ``run_dir``; empty for a healthy run.

    Raises:
        RunDirError: missing or corrupt metrics/run files.
    """
    log = load_run(run_dir)
    return [finding for detector in DETECTORS for finding in detector(log)]


def format_findings(findings: list[Finding]) -> str:
    if not findings:
        return "no problems found"
    blocks = []
    for f in findings:
        blocks.append(f"[{f.kind}] {f.summary}\n  evidence: {json.dumps(f.evidence)}\n  remedy: {f.remedy}")
    return "\n".join(blocks)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="RUN_DIR written by lmforge finetune / distill (metrics.jsonl, run.json)")
    parser.add_argument("--json", dest="json_out", help="also write the findings to this JSON file")


def run(args: argparse.Namespace) -> int:
    if args.json_out:
        check_output_file(args.json_out, flag="--json")
    findings = diagnose(args.run_dir)
    print(format_findings(findings))
    if args.json_out:
        write_output_file(args.json_out, json.dumps([asdict(f) for f in findings], indent=1), flag="--json")
    return 0
