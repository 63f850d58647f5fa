"""lmforge distill: student construction, the KD loss, and a short run on a tiny teacher."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from compress.data.packing import IGNORE_INDEX
from compress.train.distill import (
    DistillConfig,
    DistillRecipe,
    angular_importance,
    build_student,
    calibration_indices,
    distillation_loss,
    perplexity_importance,
    scored_positions,
    select_layers,
)
from compress.train.monitor import read_metrics
from tests.compress.test_finetune import tiny_run_fields


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    """A random 4-layer GQA Llama teacher with the SmolLM2 tokenizer."""
    from engine.checkpoint.store import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("teacher"), seed=1, num_hidden_layers=4)


def test_select_layers():
    assert select_layers("every-other", 30) == list(range(0, 30, 2))
    assert select_layers("0,3,5", 6) == [0, 3, 5]
    for bad in ("3,1", "0,0", "0,9", "a,b"):
        with pytest.raises(ValueError, match="student_layers"):
            select_layers(bad, 6)


def test_drop_n_removes_the_least_important_middle_layers():
    importance = [0.01, 0.5, 0.02, 0.3, 0.04, 0.001]
    assert select_layers("drop:2", 6, importance) == [0, 1, 3, 5]  # layers 0 and 5 kept although least important
    assert select_layers("drop:4", 6, importance) == [0, 5]
    for bad in ("drop:0", "drop:5", "drop:x"):
        with pytest.raises(ValueError, match="student_layers"):
            select_layers(bad, 6, importance)
    with pytest.raises(ValueError, match="needs one importance per teacher layer"):
        select_layers("drop:1", 6)


def test_calibration_indices_pick_first_or_longest_replies():
    x = IGNORE_INDEX
    rows = [[x, 1], [x, 1, 2, 3], [x, x], [1, 2, 3], [x, 5, 6]]  # assistant tokens: 1, 3, 0, 3, 2
    assert calibration_indices(rows, 2, "first") == [0, 1]
    assert calibration_indices(rows, 3, "longest") == [1, 3, 4]  # file order kept
    assert calibration_indices(rows, 2, "longest") == [1, 3]  # the tie 1 / 3 both kept before 4
    assert calibration_indices(rows, 9, "longest") == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="calibration_select"):
        calibration_indices(rows, 2, "random")
    with pytest.raises(ValueError, match="calibration_select"):
        DistillConfig(data="d", calibration_select="last").validate()


def test_layer_importance_against_direct_computation(teacher_dir):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    with torch.no_grad():  # layer 2 becomes the identity: both residual branches write zeros
        teacher.model.layers[2].self_attn.o_proj.weight.zero_()
        teacher.model.layers[2].mlp.down_proj.weight.zero_()
    batches = [torch.tensor([[1, 400, 5000, 31, 77, 9]]), torch.tensor([[3, 8, 120, 4]])]
    angular = angular_importance(teacher, batches)
    assert len(angular) == 4 and angular[2] == pytest.approx(0.0, abs=1e-6)
    sums = torch.zeros(3)
    with torch.no_grad():
        for ids in batches:
            hidden = teacher(input_ids=ids, output_hidden_states=True).hidden_states  # [n + 1] x [1, T, hidden]
            for i in range(3):  # hidden[i + 1] is layer i's raw output for all but the last layer (normed)
                sums[i] += (1 - F.cosine_similarity(hidden[i], hidden[i + 1], dim=-1)).sum()
    assert angular[:3] == pytest.approx((sums / 10).tolist(), rel=1e-4, abs=1e-6)
    with torch.no_grad():
        full = sum(float(teacher(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1) for ids in batches) / 8
    removed = perplexity_importance(teacher, batches)
    assert removed[2] == pytest.approx(full, rel=1e-5)  # removing the identity layer changes nothing
    assert len(teacher.model.layers) == 4 and teacher.config.num_hidden_layers == 4  # restored


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
    labels[0, :2] = IGNORE_INDEX  # a prompt: no label
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0
    hidden = torch.randn(2, 5, 8)
    kw = dict(alpha=1.0, beta=0.0, gamma=0.0, temperature=2.0)
    m, targets = scored_positions(labels, mask, "all")
    assert m.tolist() == mask.bool().tolist() and targets[:, :-1].tolist() == labels[:, 1:].tolist()
    assert (targets[:, -1] == IGNORE_INDEX).all()
    same, parts = distillation_loss(logits_t[m], logits_t[m], targets[m], **kw)
    assert same.item() == pytest.approx(0.0, abs=1e-6)
    loss, parts = distillation_loss(logits_s[m], logits_t[m], targets[m], **kw)
    expected = (
        F.kl_div(
            F.log_softmax(logits_s[m] / 2, -1),
            F.log_softmax(logits_t[m] / 2, -1),
            log_target=True,
            reduction="batchmean",
        )
        * 4
    )
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    a, a_targets = scored_positions(labels, mask, "assistant")
    assert a.tolist() == (targets != IGNORE_INDEX).tolist() and not a[0, :1].any() and a[0, 1]
    ce_expected = F.cross_entropy(logits_s[a], a_targets[a]).item()
    for temperature in (1.0, 2.0):  # CE from the KL's normaliser (T = 1) or computed on its own
        ce_only, parts = distillation_loss(
            logits_s[a], logits_t[a], a_targets[a], alpha=0.0, beta=1.0, gamma=0.0, temperature=temperature
        )
        assert ce_only.item() == pytest.approx(ce_expected, rel=1e-5)
        _, parts = distillation_loss(logits_s[a], logits_t[a], a_targets[a], **{**kw, "temperature": temperature})
        assert parts["ce_loss"] == pytest.approx(ce_expected, rel=1e-5)  # logged with beta = 0 too
    cos, parts = distillation_loss(
        logits_s[m],
        logits_t[m],
        targets[m],
        alpha=0.0,
        beta=0.0,
        gamma=1.0,
        temperature=1.0,
        hidden_pairs=[(hidden, hidden), (hidden, -hidden)],
        hidden_mask=mask.bool(),
    )
    assert cos.item() == pytest.approx((0.0 + 2.0) / 2, rel=1e-5)  # mean over pairs of 1 - cos


def test_distill_run_halves_layers_lowers_loss_resumes_and_loads(teacher_dir, chat_data, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = DistillConfig(
        **tiny_run_fields(teacher_dir, chat_data, tmp_path / "run"),
        stop_after=3,
        student_layers="drop:2",
        calibration_records=4,
        calibration_select="longest",
        generate_records=6,
        generate_tokens=8,
        alpha=0.5,
        beta=0.5,
        gamma=0.1,
        temperature=2.0,
    )
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
    assert m["student_num_layers"] == 2 and m["teacher_num_layers"] == 4 and m["student_layer_map"] == [0, 3]
    assert m["layer_importance"] == "angular" and len(m["layer_importance_values"]) == 4
    generated = [json.loads(line) for line in (tmp_path / "run" / "teacher_generated.jsonl").read_text().splitlines()]
    assert 0 < len(generated) <= 6 and m["teacher_generated_records"] == len(generated)
    assert [t["role"] for t in generated[0]["messages"]][-2:] == ["user", "assistant"]
    assert m["val_ppl_after"] < m["val_ppl_before"] and m["teacher_val_ppl"] > 1
    freq = json.loads((final / "token_frequencies.json").read_text())  # the draft's reduced head
    assert len(freq["token_ids"]) == len(set(freq["token_ids"])) > 10
    assert freq["counts"] == sorted(freq["counts"], reverse=True) and freq["counts"][-1] >= 1
    student = AutoModelForCausalLM.from_pretrained(final)
    assert student.config.model_type == "llama" and student.config.num_hidden_layers == 2
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir)
    embed = "model.embed_tokens.weight"  # kept as the teacher's (train_embeddings=False)
    assert torch.equal(student.state_dict()[embed], teacher.state_dict()[embed])
    assert not torch.equal(student.model.layers[1].mlp.up_proj.weight, teacher.model.layers[3].mlp.up_proj.weight)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert student(input_ids=ids).logits.shape == (1, 4, student.config.vocab_size)


def test_student_speed_alternates_models_round_by_round(teacher_dir, tmp_path):
    from bench.student_speed import measure
    from engine.checkpoint.store import make_tiny_llama
    from engine.errors import UsageError

    student = str(make_tiny_llama(tmp_path / "student", seed=2, num_hidden_layers=2))
    lines = []
    figures = measure(
        [str(teacher_dir), student], rounds=2, requests=2, tokens=3, threads=1, dtype="float32", log=lines.append
    )
    assert list(figures) == [str(teacher_dir), student]
    assert all(
        len(rows) == 2 and all(r["wall_tok_s"] > 0 and r["cpu_tok_s"] > 0 for r in rows) for rows in figures.values()
    )
    assert [line.split(":")[0] for line in lines] == [f"round {r} {p}" for r in (0, 1) for p in figures]
    with pytest.raises(UsageError, match="rounds=0"):
        measure([str(teacher_dir)], rounds=0, requests=1, tokens=1, threads=1, dtype="float32")
