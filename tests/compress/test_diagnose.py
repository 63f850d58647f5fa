"""`lmforge diagnose` finds each pathology planted in a synthetic run log, and nothing in a healthy one."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from compress.scale.diagnose import RunDirError, diagnose, load_run, split_overlap, warmup_steps
from lmforge_cli import main

STEPS = 200
WARMUP = 10
PEAK_LR = 3e-4


def healthy_records(seed: int = 0) -> list[dict]:
    """A run that warms up for 10 steps, decays by cosine, and whose losses fall smoothly."""
    rng = random.Random(seed)
    records = []
    for step in range(1, STEPS + 1):
        if step <= WARMUP:
            lr = PEAK_LR * step / WARMUP
        else:
            lr = PEAK_LR * 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))
        records.append(
            {
                "step": step,
                "split": "train",
                "loss": 2.0 + 3.0 * math.exp(-step / 50) + rng.gauss(0, 0.01),
                "lr": lr,
                "grad_norm": (0.5 + 0.5 * math.exp(-step / 100)) * (1 + rng.gauss(0, 0.05)),
                "tokens": 4096 * step,
                "data_wait_s": 0.004 + rng.random() * 0.002,
                "compute_s": 0.1 + rng.random() * 0.01,
                "time_s": 0.11 * step,
                "param_change": {"attn": 1e-3, "mlp": 1e-3},
            }
        )
        if step % 20 == 0:
            records.append({"step": step, "split": "val", "loss": 2.2 + 3.0 * math.exp(-step / 50)})
    return records


def write_run(run_dir: Path, records: list[dict], run: dict | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "run.json").write_text(
        json.dumps(run or {"train_data": None, "val_data": None, "config": {"warmup_steps": WARMUP}})
    )
    return run_dir


def train(records):
    return {r["step"]: r for r in records if r["split"] == "train"}


def kinds(findings) -> set[str]:
    return {f.kind for f in findings}


def test_healthy_run_has_no_findings(tmp_path):
    assert diagnose(write_run(tmp_path / "run", healthy_records())) == []


def test_loss_spikes_found_with_steps(tmp_path):
    records = healthy_records()
    train(records)[120]["loss"] = 7.5
    train(records)[150]["loss"] = 6.0
    findings = diagnose(write_run(tmp_path / "run", records))
    assert kinds(findings) == {"loss_spikes"}
    assert [s["step"] for s in findings[0].evidence["spikes"]] == [120, 150]
    assert "clip gradients" in findings[0].remedy


def test_oscillation_found(tmp_path):
    records = healthy_records()
    for step, r in train(records).items():
        if step > 40:
            r["loss"] = 3.0 + (0.6 if step % 2 else -0.6)
    findings = diagnose(write_run(tmp_path / "run", records))
    assert "loss_oscillation" in kinds(findings)
    osc = next(f for f in findings if f.kind == "loss_oscillation")
    assert osc.evidence["sign_change_fraction"] > 0.7 and "lower the learning rate" in osc.remedy


def test_grad_norm_explosion_and_vanishing(tmp_path):
    records = healthy_records()
    train(records)[90]["grad_norm"] = 60.0
    train(records)[91]["grad_norm"] = float("nan")
    findings = diagnose(write_run(tmp_path / "a", records))
    assert kinds(findings) == {"grad_norm_explosion"}
    assert [s["step"] for s in findings[0].evidence["steps"]] == [90, 91]

    records = healthy_records()
    for step, r in train(records).items():
        r["grad_norm"] = math.exp(-step / 10)
    findings = diagnose(write_run(tmp_path / "b", records))
    assert kinds(findings) == {"grad_norm_vanishing"}
    assert findings[0].evidence["late_median"] < 1e-3 * findings[0].evidence["early_median"]


def test_train_val_divergence(tmp_path):
    records = healthy_records()
    val_at_100 = next(r["loss"] for r in records if r["split"] == "val" and r["step"] == 100)
    for r in records:
        if r["split"] == "val" and r["step"] > 100:
            r["loss"] = val_at_100 + 0.1 * (r["step"] - 100) / 20
    findings = diagnose(write_run(tmp_path / "run", records))
    assert kinds(findings) == {"train_val_divergence"}
    assert findings[0].evidence["best_val"]["step"] == 100 and findings[0].evidence["last_val"]["step"] == 200
    assert "step 100" in findings[0].remedy


def _write_split(path: Path, texts: list[str]) -> str:
    path.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": "ok " + t}]})
            + "\n"
            for t in texts
        )
    )
    return str(path)


@pytest.mark.parametrize("leaked", [True, False])
def test_flat_val_runs_the_overlap_check(tmp_path, leaked):
    rng = random.Random(1)
    words = [f"w{i}" for i in range(2000)]
    train_texts = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(200)]
    val_texts = train_texts[:40] if leaked else [" ".join(rng.choice(words) for _ in range(30)) for _ in range(40)]
    run = {
        "train_data": _write_split(tmp_path / "train.jsonl", train_texts),
        "val_data": _write_split(tmp_path / "val.jsonl", val_texts),
        "config": {"warmup_steps": WARMUP},
    }
    records = healthy_records()
    for r in records:
        if r["split"] == "val":
            r["loss"] = 4.0 + 0.001 * (r["step"] % 3)
    findings = diagnose(write_run(tmp_path / "run", records, run))
    assert kinds(findings) == {"val_flat"}
    overlap = findings[0].evidence["split_overlap"]
    assert overlap["val_records"] == 40
    if leaked:
        assert overlap["overlap_fraction"] == 1.0 and "leaks" in findings[0].remedy
    else:
        assert overlap["overlap_fraction"] == 0.0 and "no train/validation leakage" in findings[0].remedy


def test_split_overlap_counts_near_duplicates(tmp_path):
    base = [" ".join(f"t{i}_{j}" for j in range(100)) for i in range(50)]
    near = [b.replace("_99", "_x") for b in base[:10]]  # one word of 100 changed (Jaccard about 0.97)
    other = [" ".join(f"u{i}_{j}" for j in range(100)) for i in range(5)]
    result = split_overlap(_write_split(tmp_path / "a.jsonl", base), _write_split(tmp_path / "b.jsonl", near + other))
    assert result["val_with_near_duplicate_in_train"] == 10 and result["overlap_fraction"] == pytest.approx(
        10 / 15, abs=1e-4
    )


def test_short_warmup_blamed_for_early_instability(tmp_path):
    records = healthy_records()
    for step, r in train(records).items():
        r["lr"] = PEAK_LR if step > 2 else PEAK_LR * step / 2
    train(records)[7]["loss"] = 9.0
    train(records)[9]["grad_norm"] = 40.0
    run = {"train_data": None, "val_data": None, "config": {"warmup_steps": 2}}
    findings = diagnose(write_run(tmp_path / "run", records, run))
    assert {"warmup_too_short", "loss_spikes", "grad_norm_explosion"} <= kinds(findings)
    warm = next(f for f in findings if f.kind == "warmup_too_short")
    assert warm.evidence["unstable_steps"] == [7, 9] and warm.evidence["warmup_steps"] == 2


def test_data_loader_bottleneck(tmp_path):
    records = healthy_records()
    for r in train(records).values():
        r["data_wait_s"] = 0.15
    findings = diagnose(write_run(tmp_path / "run", records))
    assert kinds(findings) == {"data_loader_bottleneck"}
    assert findings[0].evidence["data_wait_fraction"] > 0.5 and "num_workers" in findings[0].remedy


def test_cli_reports_and_rejects_corrupt_logs(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", healthy_records())
    assert main(["diagnose", str(run_dir), "--json", str(tmp_path / "f.json")]) == 0
    assert "no problems found" in capsys.readouterr().out
    assert json.loads((tmp_path / "f.json").read_text()) == []
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write("{not json\n")
    assert main(["diagnose", str(run_dir)]) == 2
    assert f"metrics.jsonl:{len(healthy_records()) + 1}: not valid JSON" in capsys.readouterr().err
    with pytest.raises(RunDirError, match="not found"):
        diagnose(tmp_path / "missing")


def test_a_non_numeric_loss_is_reported_by_line(tmp_path, capsys):
    records = healthy_records()
    records[3] = {**records[3], "loss": "high"}
    run_dir = write_run(tmp_path / "run", records)
    assert main(["diagnose", str(run_dir)]) == 2
    assert "metrics.jsonl:4: loss='high'; expected a number (or null)" in capsys.readouterr().err


def test_warmup_length_from_finetune_config_or_lr(tmp_path):
    records = healthy_records()
    run = {"train_data": None, "val_data": None, "config": {"warmup_ratio": 0.05, "max_steps": 200}}
    assert warmup_steps(load_run(write_run(tmp_path / "a", records, run))) == 10
    assert warmup_steps(load_run(write_run(tmp_path / "b", records, {"config": {}}))) == WARMUP  # lr peaks at step 10
    constant = [dict(r, lr=PEAK_LR) if r["split"] == "train" else r for r in records]
    assert warmup_steps(load_run(write_run(tmp_path / "c", constant, {"config": {}}))) == 0
