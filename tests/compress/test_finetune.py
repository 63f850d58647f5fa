"""lmforge finetune on a tiny random Llama: schedule, clipping, resume, NaN stop, LoRA, DDP."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from compress.train.finetune import FinetuneConfig, FinetuneRecipe, run_recipe
from compress.train.loop import TrainConfig, TrainingError, clip_gradients, cosine_schedule
from compress.train.monitor import read_metrics
from engine.errors import UsageError

REPO = Path(__file__).resolve().parents[2]


def tiny_run_fields(model_dir, chat_data, run_dir) -> dict:
    """``TrainConfig`` fields of a six-step run on the tiny chat data (fine-tuning and distillation tests)."""
    return dict(
        model=str(model_dir),
        data=str(chat_data),
        run_dir=str(run_dir),
        max_steps=6,
        micro_batch_size=2,
        max_length=48,
        lr=3e-3,
        eval_every=0,
        progress=False,
    )


def _config(tiny_llama_dir, chat_data, run_dir, **overrides) -> FinetuneConfig:
    return FinetuneConfig(**{**tiny_run_fields(tiny_llama_dir, chat_data, run_dir), **overrides})


def test_warmup_cosine_schedule_values():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=1e-3)
    sched = cosine_schedule(opt, TrainConfig(max_steps=20, warmup_ratio=0.1, lr=1e-3))
    lrs = []
    for _ in range(21):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[0] == 0.0
    assert lrs[1] == pytest.approx(0.5e-3)
    assert lrs[2] == pytest.approx(1e-3)  # peak at the end of warmup (2 = 10% of 20 steps)
    assert lrs[11] == pytest.approx(0.5e-3)  # cosine midpoint
    assert lrs[20] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))  # monotone decay after warmup
    assert TrainConfig(max_steps=30).warmup_steps == 3


def test_clipping_bounds_the_gradient_norm(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    ids = torch.randint(0, 1000, (2, 16))
    (model(input_ids=ids, labels=ids).loss * 100).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    before = clip_gradients(params, 0.5)
    after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item()
    assert before > 0.5
    assert after == pytest.approx(0.5, rel=1e-4)
    assert clip_gradients(params, None) == pytest.approx(after, rel=1e-4)  # no clipping: unchanged


def test_without_a_terminal_progress_comes_as_lines(tiny_llama_dir, chat_data, tmp_path, monkeypatch, capsys):
    from compress.train import loop

    monkeypatch.setattr(loop, "PROGRESS_LINE_EVERY_S", 0.0)  # a line every step (one a minute by default)
    result, _ = FinetuneRecipe(_config(tiny_llama_dir, chat_data, tmp_path / "run", max_steps=3, progress=True)).run()
    assert result.status == "completed"
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("finetune: step")]
    assert [line.split(",")[0] for line in lines] == [f"finetune: step {k}/3 ({k / 3:.0%})" for k in (1, 2, 3)]
    assert "s left" in lines[0] and "s left" not in lines[-1]


def test_finetune_lowers_val_loss_and_resume_matches_uninterrupted(tiny_llama_dir, chat_data, tmp_path):
    """A 6-step run with accumulation vs the same run stopped after step 3 and resumed."""
    base = dict(grad_accum_steps=2, warmup_ratio=0.2, eval_every=3)
    full_cfg = _config(tiny_llama_dir, chat_data, tmp_path / "full", **base)
    result, final = FinetuneRecipe(full_cfg).run()
    assert result.status == "completed" and final == tmp_path / "full" / "final"
    full = read_metrics(tmp_path / "full")
    train = [r for r in full if r["split"] == "train"]
    val = [r for r in full if r["split"] == "val"]
    # The schedule moves once per optimizer step (2 micro-batches each): warmup 1 step, then cosine.
    peak = full_cfg.lr
    expected = [0.0] + [peak * 0.5 * (1 + math.cos(math.pi * (s - 1) / 5)) for s in range(1, 6)]
    assert [r["lr"] for r in train] == pytest.approx(expected)
    assert [r["step"] for r in val] == [0, 3, 6]
    assert val[-1]["loss"] < val[0]["loss"] - 0.1  # training lowers the validation loss
    for r in train:
        assert {"loss", "lr", "grad_norm", "tokens", "data_wait_s", "compute_s", "time_s", "param_change"} <= set(r)
        assert r["compute_s"] > 0 and r["data_wait_s"] >= 0
    assert set(train[-1]["param_change"]) == {"embed", "layers.0", "layers.1", "norm"}
    assert train[0]["param_change"]["layers.0"] == 0.0 and train[1]["param_change"]["layers.0"] > 0  # lr 0 at step 1
    assert train[-1]["tokens"] > train[0]["tokens"] > 0
    assert {p.name for p in (tmp_path / "full" / "plots").glob("*.png")} == {
        "loss.png",
        "grad_norm.png",
        "lr.png",
        "param_change.png",
    }
    manifest = json.loads((final / "lmforge.json").read_text())
    assert manifest["method"] == "finetune" and manifest["parent"] == str(tiny_llama_dir)
    assert manifest["config"]["grad_accum_steps"] == 2
    assert manifest["metrics"]["val_loss_before"] == pytest.approx(val[0]["loss"])
    assert manifest["metrics"]["val_loss_after"] == pytest.approx(val[-1]["loss"])
    assert (final / "chat_template.jinja").is_file() and (final / "model.safetensors").is_file()

    part = _config(tiny_llama_dir, chat_data, tmp_path / "part", stop_after=3, **base)
    result, final_part = FinetuneRecipe(part).run()
    assert result.status == "stopped" and final_part is None
    assert (tmp_path / "part" / "checkpoints" / "step_000003" / "trainer_state.json").is_file()
    result, _ = FinetuneRecipe(dataclasses.replace(part, stop_after=None, resume=True)).run()
    assert result.status == "completed"
    resumed = read_metrics(tmp_path / "part")
    # Same losses, gradient norms, LRs and validation losses, step by step (CPU runs are deterministic).
    key = lambda rs: [(r["step"], r["split"], r["loss"], r.get("grad_norm"), r.get("lr"), r.get("tokens")) for r in rs]  # noqa: E731
    assert key(resumed) == key(full)

    a, b = load_file(final / "model.safetensors"), load_file(tmp_path / "part" / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


class _NanAtStep4(FinetuneRecipe):
    """The real recipe whose loss turns NaN on the 4th optimizer step (a planted divergence)."""

    def compute_loss(self, model, batch):
        loss, parts = super().compute_loss(model, batch)
        return (loss * float("nan") if self.state.step >= 3 else loss), parts


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tiny_llama_dir, chat_data, tmp_path, capsys):
    cfg = _config(tiny_llama_dir, chat_data, tmp_path / "nan", save_every=2)
    assert run_recipe(_NanAtStep4, cfg) == 1
    err = capsys.readouterr().err
    assert "non-finite training loss at step 4" in err and "step_000002" in err
    assert sorted(p.name for p in (tmp_path / "nan" / "checkpoints").iterdir()) == ["step_000002"]
    assert not (tmp_path / "nan" / "final").exists()
    weights = torch.load(tmp_path / "nan" / "checkpoints" / "step_000002" / "model.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in weights.values())
    train = [r for r in read_metrics(tmp_path / "nan") if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and train[-1]["event"] == "nan"


def test_lora_with_gradient_checkpointing_is_merged_on_save(tiny_llama_dir, chat_data, tmp_path):
    cfg = _config(
        tiny_llama_dir,
        chat_data,
        tmp_path / "lora",
        lora=True,
        merge=True,
        max_steps=3,
        lr=1e-2,
        warmup_ratio=0.0,
        gradient_checkpointing=True,
    )
    result, final = FinetuneRecipe(cfg).run()
    assert result.status == "completed"
    train = [r for r in read_metrics(tmp_path / "lora") if r["split"] == "train"]
    assert set(train[-1]["param_change"]) == {"layers.0", "layers.1"}  # only the adapters train
    merged, base = load_file(final / "model.safetensors"), load_file(tiny_llama_dir / "model.safetensors")
    assert set(merged) == set(base)  # no adapter tensors left
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(merged["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"])
    AutoModelForCausalLM.from_pretrained(final)


def test_lora_keeps_the_adapter_in_the_peft_format_with_a_manifest_naming_its_base(tiny_llama_dir, chat_data, tmp_path):
    from peft import PeftModel

    from engine.checkpoint.store import ADAPTER_METHOD, CheckpointError, read_manifest, resolve_checkpoint

    cfg = _config(tiny_llama_dir, chat_data, tmp_path / "lora", lora=True, max_steps=2, lr=1e-2, warmup_ratio=0.0)
    recipe = FinetuneRecipe(cfg)
    result, final = recipe.run()
    assert result.status == "completed"
    assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
    assert not (final / "model.safetensors").exists()
    tensors = load_file(final / "adapter_model.safetensors")
    assert all(".lora_A." in k or ".lora_B." in k for k in tensors) and all(
        t.dtype == torch.float32 for t in tensors.values()
    )
    assert {k.split(".")[-3] for k in tensors} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (8, 64)
    manifest = read_manifest(final)
    assert manifest.method == ADAPTER_METHOD and manifest.parent == str(tiny_llama_dir.resolve())
    assert manifest.config["base"]["hidden_size"] == 64 and manifest.config["base"]["vocab_size"] == 49152
    assert manifest.config["lora_r"] == 8 and manifest.num_parameters == sum(t.numel() for t in tensors.values())
    # PEFT loads it on its base and gives the trained model's logits
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    peft_model = PeftModel.from_pretrained(base, final).eval()
    trained = recipe.export_model().eval()
    ids = torch.tensor([[5, 17, 300, 4000, 12]])
    with torch.no_grad():
        assert torch.allclose(peft_model(ids).logits, trained(ids).logits, atol=1e-5)
    with pytest.raises(CheckpointError, match="a LoRA adapter"):
        resolve_checkpoint(final)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("lora_r", 0, "--lora-r 0: must be >= 1"),
        ("lora_alpha", 0, "--lora-alpha 0: must be > 0"),
        ("lora_dropout", 2.0, r"--lora-dropout 2.0: must be in \[0, 1\)"),
        ("lora_target_modules", [], "--lora-target-modules is empty; name modules"),
        ("fsdp", True, "--lora with --fsdp is not supported; use DDP"),
    ],
)
def test_bad_lora_settings_are_usage_errors(tiny_llama_dir, chat_data, tmp_path, field, value, message):
    """Each bad LoRA flag is refused before the model loads, as a usage error (exit 2) naming the flag."""
    with pytest.raises(UsageError, match=message):
        _config(tiny_llama_dir, chat_data, tmp_path / "run", lora=True, **{field: value}).validate()
    assert not (tmp_path / "run").exists()


def test_merge_needs_lora(tiny_llama_dir, chat_data, tmp_path):
    with pytest.raises(ValueError, match="--merge without --lora"):
        FinetuneRecipe(_config(tiny_llama_dir, chat_data, tmp_path / "run", merge=True))


class _RunsCode:
    """Unpickling this runs ``Path(marker).touch()``: what a planted state file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("planted", ["optimizer.pt", "scheduler.pt", "rng_rank0.pt"])
def test_resume_never_unpickles_code(tiny_llama_dir, chat_data, tmp_path, planted):
    part = _config(tiny_llama_dir, chat_data, tmp_path / "run", max_steps=2, stop_after=1)
    assert FinetuneRecipe(part).run()[0].status == "stopped"
    state_file = tmp_path / "run" / "checkpoints" / "step_000001" / planted
    marker = tmp_path / "code-ran"
    torch.save({"state": _RunsCode(marker)}, state_file)
    with pytest.raises(
        TrainingError, match=f"{planted}: not a training-state file lmforge wrote.*run without --resume"
    ):
        FinetuneRecipe(dataclasses.replace(part, stop_after=None, resume=True)).run()
    assert not marker.exists()


def test_bad_settings_are_rejected(tiny_llama_dir, chat_data, tmp_path):
    with pytest.raises(ValueError, match="warmup_ratio=1.5"):
        _config(tiny_llama_dir, chat_data, tmp_path, warmup_ratio=1.5).validate()
    with pytest.raises(ValueError, match="precision='fp8'"):
        FinetuneRecipe(_config(tiny_llama_dir, chat_data, tmp_path, precision="fp8"))
    if not torch.cuda.is_available():
        with pytest.raises(TrainingError, match="precision=fp16 needs CUDA"):  # lmforge main: exit 1
            run_recipe(FinetuneRecipe, _config(tiny_llama_dir, chat_data, tmp_path / "fp16", precision="fp16"))
    with pytest.raises(TrainingError, match="no checkpoint to resume from"):
        FinetuneRecipe(_config(tiny_llama_dir, chat_data, tmp_path / "none", resume=True)).run()
    assert not (tmp_path / "none").exists()  # refused before run.json or anything else is written


def test_lora_command_prints_only_its_own_output(tiny_llama_dir, chat_data, tmp_path):
    """``lmforge finetune --lora`` imports peft (and with it bitsandbytes): no library warning reaches the terminal."""
    run_dir = tmp_path / "lora"
    cmd = [sys.executable, "-m", "lmforge_cli", "finetune", "--model", str(tiny_llama_dir), "--data", str(chat_data)]
    cmd += ["--run-dir", str(run_dir), "--lora", "--max-steps", "1", "--micro-batch-size", "2", "--max-length", "48"]
    cmd += ["--eval-every", "0"]  # no --no-progress: the bar stays off when stderr is not a terminal
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == ""
    assert proc.stdout.startswith("val loss ") and proc.stdout.rstrip().endswith(f"wrote {run_dir / 'final'}")
    assert len(proc.stdout.splitlines()) == 1


def test_ddp_two_cpu_processes(tiny_llama_dir, chat_data, tmp_path):
    """torchrun --nproc_per_node 2 (gloo): both ranks train, rank 0 writes metrics and the model."""
    run_dir = tmp_path / "ddp"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "lmforge_cli",
        "finetune",
        "--model",
        str(tiny_llama_dir),
        "--data",
        str(chat_data),
        "--run-dir",
        str(run_dir),
        "--max-steps",
        "2",
        "--micro-batch-size",
        "2",
        "--max-length",
        "48",
        "--device",
        "cpu",
        "--no-progress",
        "--save-every",
        "2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    train = [r for r in read_metrics(run_dir) if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    # tokens count both ranks' micro-batches: more than one rank's 2 rows could hold alone.
    assert train[0]["tokens"] > 2 * 48
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints" / "step_000002").glob("rng_rank*.pt")) == [
        "rng_rank0.pt",
        "rng_rank1.pt",
    ]


def test_precision_auto_trains_in_bf16_only_where_the_cpu_computes_it_natively(tiny_llama_dir, chat_data, tmp_path):
    """``precision="auto"`` (the default) resolves once the device is known: bf16 autocast on a CPU with
    AVX-512 BF16 or AMX, fp32 elsewhere (an AVX2-only CPU emulates bf16 matmuls many times slower)."""
    from engine.config import CPU_BF16_FLAGS, cpu_flags

    recipe = FinetuneRecipe(_config(tiny_llama_dir, chat_data, tmp_path, max_steps=1))
    assert recipe.config.precision == "auto"
    try:
        recipe.setup()
        native = bool(cpu_flags() & set(CPU_BF16_FLAGS))
        assert recipe.config.precision == ("bf16" if native else "fp32")
        assert (recipe.autocast().__class__ is torch.autocast) == native
    finally:
        recipe.close()


def test_the_peft_transformers_deprecation_warning_is_dropped_and_other_warnings_stay():
    """A later peft warns (``FutureWarning``) about the pinned transformers 4.57 at import: that one line is
    dropped once ``engine`` is imported; any other warning of the same class still reaches stderr."""
    code = (
        "import warnings, engine\n"
        "warnings.warn('Support for Transformers < 5.6 is deprecated in PEFT and will be removed', FutureWarning)\n"
        "warnings.warn('another library change', FutureWarning)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "another library change" in proc.stderr
    assert "PEFT" not in proc.stderr
