"""lmforge distill: student construction, the KD loss, and a short run on a tiny teacher."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from compress.data import DataConfig, prepare
from compress.distill import DistillConfig, DistillRecipe, build_student, distillation_loss, select_layers
from compress.monitor import read_metrics


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    """A random 4-layer GQA Llama teacher with the SmolLM2 tokenizer."""
    from compress.checkpoints import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("teacher"), seed=1, num_hidden_layers=4)


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("distill-data")
    prepare(DataConfig(), out, verbose=False)
    for name, keep in (("train.jsonl", 48), ("val.jsonl", 8)):
        lines = (out / name).read_text().splitlines()[:keep]
        (out / name).write_text("\n".join(lines) + "\n")
    return out


def test_select_layers():
    assert select_layers("every-other", 30) == list(range(0, 30, 2))
    assert select_layers("0,3,5", 6) == [0, 3, 5]
    for bad in ("3,1", "0,0", "0,9", "a,b"):
        with pytest.raises(ValueError, match="student_layers"):
            select_layers(bad, 6)


def test_student_copies_every_other_teacher_layer(teacher_dir):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir)
    student, layer_map = build_student(teacher, [0, 2])
    assert layer_map == [0, 2] and student.config.num_hidden_layers == 2 and student.config.model_type == "llama"
    t, s = teacher.state_dict(), student.state_dict()
    assert torch.equal(s["model.layers.1.self_attn.q_proj.weight"], t["model.layers.2.self_attn.q_proj.weight"])
    assert torch.equal(s["model.embed_tokens.weight"], t["model.embed_tokens.weight"])
    n_student = sum(p.numel() for p in student.model.layers.parameters())
    assert n_student * 2 == sum(p.numel() for p in teacher.model.layers.parameters())
    fresh, fresh_map = build_student(teacher, None, {"num_hidden_layers": 2, "intermediate_size": 64})
    assert fresh.config.intermediate_size == 64 and fresh_map == [0, 3]


def test_distillation_loss_terms():
    torch.manual_seed(0)
    logits_t = torch.randn(2, 5, 11)
    logits_s = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0
    hidden = torch.randn(2, 5, 8)
    kw = dict(alpha=1.0, beta=0.0, gamma=0.0, temperature=2.0)
    same, parts = distillation_loss(logits_t, logits_t, labels, mask, **kw)
    assert same.item() == pytest.approx(0.0, abs=1e-6)
    loss, parts = distillation_loss(logits_s, logits_t, labels, mask, **kw)
    m = mask.bool()
    expected = F.kl_div(F.log_softmax(logits_s[m] / 2, -1), F.log_softmax(logits_t[m] / 2, -1), log_target=True, reduction="batchmean") * 4
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    ce_only, parts = distillation_loss(logits_s, logits_t, labels, mask, alpha=0.0, beta=1.0, gamma=0.0, temperature=2.0)
    assert ce_only.item() == pytest.approx(F.cross_entropy(logits_s[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1)).item(), rel=1e-5)
    cos, parts = distillation_loss(logits_s, logits_t, labels, mask, alpha=0.0, beta=0.0, gamma=1.0, temperature=1.0,
                                   hidden_pairs=[(hidden, hidden), (hidden, -hidden)])
    assert cos.item() == pytest.approx((0.0 + 2.0) / 2, rel=1e-5)  # mean over pairs of 1 - cos


def test_distill_run_halves_layers_lowers_loss_resumes_and_loads(teacher_dir, chat_data, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = DistillConfig(model=str(teacher_dir), data=str(chat_data), run_dir=str(tmp_path / "run"), max_steps=6,
                        micro_batch_size=2, max_length=48, lr=3e-3, eval_every=0, progress=False, stop_after=3)
    result, final = DistillRecipe(cfg).run()
    assert result.status == "stopped" and (tmp_path / "run" / "checkpoints" / "step_000003").is_dir()
    result, final = DistillRecipe(dataclasses.replace(cfg, stop_after=None, resume=True)).run()
    assert result.status == "completed"
    metrics = read_metrics(tmp_path / "run")
    train = [r for r in metrics if r["split"] == "train"]
    val = [r for r in metrics if r["split"] == "val"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert {"kd_loss", "ce_loss", "cos_loss", "grad_norm", "param_change"} <= set(train[0])
    assert val[-1]["loss"] < val[0]["loss"]  # the student's validation CE decreases
    assert train[-1]["loss"] < train[0]["loss"]
    manifest = json.loads((final / "lmforge.json").read_text())
    assert manifest["method"] == "distill" and manifest["parent"] == str(teacher_dir)
    m = manifest["metrics"]
    assert m["student_num_layers"] == 2 and m["teacher_num_layers"] == 4 and m["student_layer_map"] == [0, 2]
    assert m["val_ppl_after"] < m["val_ppl_before"] and m["teacher_val_ppl"] > 1
    student = AutoModelForCausalLM.from_pretrained(final)
    assert student.config.model_type == "llama" and student.config.num_hidden_layers == 2
    ids = torch.tensor([[1, 2, 3, 4]])
    assert student(input_ids=ids).logits.shape == (1, 4, student.config.vocab_size)
