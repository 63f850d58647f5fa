"""lm-evaluation-harness (``lm-eval --model local-completions``) against the served ``/v1/completions``.

lm-eval 0.4.13 runs from its own venv, ``.venv-lmeval`` (``make lmeval-venv``: its pins must not move the
project's); the test builds it through that target when it is missing. The tiny random Llama is exported
again with ``dtype=float32`` (``llm_f32``), loaded into the session's Triton server and served by a
frontend of its own, so its scores compare tightly with two oracles:

* the in-process engine, same checkpoint and ``EngineConfig``: ``SamplingParams(prompt_logprobs=0)``
  over the context + continuation ids, summed over the continuation;
* Hugging Face ``transformers`` in float32: ``log_softmax`` of the logits of the same ids.

The tasks are local files (``dataset_path: json`` + ``data_files``; nothing from a hub, datasets offline):
a multiple-choice task (``loglikelihood`` requests: ``echo``, ``logprobs: 1``, ``max_tokens: 1`` and token-id
prompts) and a generation task (``generate_until``: greedy, stop strings), whose texts must equal the
engine's greedy completions. lm-eval tokenizes through the server (``tokenizer_backend=remote``:
``/tokenizer_info``, ``/tokenize``, ``/detokenize``); the oracles split the texts with the Hugging Face
tokenizer, so the served tokenizer is checked too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from deploy.export import export
from engine import LLM, SamplingParams
from tests.conftest import ENGINE_CONFIG, REPO_ROOT

pytestmark = pytest.mark.integration

LMEVAL_VENV = REPO_ROOT / ".venv-lmeval"
#: Seconds ``make lmeval-venv`` may take when the venv is missing (it downloads lm-eval, datasets, transformers).
LMEVAL_BUILD_TIMEOUT_S = 1200
ENGINE_F32 = {**ENGINE_CONFIG, "dtype": "float32"}
MODEL = "llm_f32"

MC_DOCS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "Berlin", "a small cat"], "answer": 0},
    {"question": "Which number comes after two?", "choices": ["seven", "three"], "answer": 1},
    {"question": "What colour is the sky on a clear day?", "choices": ["green", "blue", "loud"], "answer": 1},
    {"question": "Which animal barks?", "choices": ["a dog", "a fish", "a tree"], "answer": 0},
]
GEN_DOCS = [
    {"prompt": "Count with me: one, two,", "target": " three"},
    {"prompt": "The opposite of hot is", "target": " cold"},
    {"prompt": "Q: What do bees make?\nA:", "target": " honey"},
]
UNTIL = ["\n", "."]
MAX_GEN_TOKS = 8

MC_TASK = """task: lmforge_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_TASK = """task: lmforge_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: {until}
  max_gen_toks: {max_gen_toks}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def lmeval_python(tmp_path_factory) -> Path:
    """``.venv-lmeval/bin/python`` after ``make lmeval-venv`` (it builds the venv when missing or older than the
    Makefile's pins, within ``LMEVAL_BUILD_TIMEOUT_S``; else does nothing). A failed build fails the test."""
    log_path = tmp_path_factory.mktemp("lmeval-venv") / "make.log"
    with open(log_path, "w") as log:
        try:
            subprocess.run(
                ["make", "lmeval-venv", f"PYTHON={sys.executable}"],
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=LMEVAL_BUILD_TIMEOUT_S,
                check=True,
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            pytest.fail(f"make lmeval-venv failed ({exc}):\n{log_path.read_text()[-3000:]}")
    return LMEVAL_VENV / "bin" / "python"


@pytest.fixture(scope="module")
def f32_frontend(server, served_repo, tiny_llama_dir, start_frontend):
    """The tiny Llama exported as ``llm_f32`` (float32), loaded into the session's Triton and served by a frontend
    of its own; unloaded and removed from the repository afterwards (other tests list the repository)."""
    export(tiny_llama_dir, served_repo, name=MODEL, engine=ENGINE_F32)
    try:
        loaded = requests.post(f"{server.http_url}/v2/repository/models/{MODEL}/load", json={}, timeout=600)
        assert loaded.status_code == 200, loaded.text
        with start_frontend(served_repo, server, "--models", MODEL) as url:
            yield url
    finally:
        requests.post(f"{server.http_url}/v2/repository/models/{MODEL}/unload", json={}, timeout=120)
        shutil.rmtree(served_repo / MODEL, ignore_errors=True)


def write_tasks(root: Path) -> Path:
    """The two tasks' YAML and JSON-lines data under ``root``; returns the ``--include_path`` folder."""
    tasks = root / "tasks"
    tasks.mkdir()
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / "lmforge_mc.yaml").write_text(MC_TASK.format(data=root / "mc.jsonl"))
    gen = GEN_TASK.format(data=root / "gen.jsonl", until=json.dumps(UNTIL), max_gen_toks=MAX_GEN_TOKS)
    (tasks / "lmforge_gen.yaml").write_text(gen)
    return tasks


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) into token ids (``TemplateLM._encode_pair``, causal models,
    ``add_special_tokens=False`` as its API models encode): trailing spaces of the context move to the
    continuation; the continuation is the whole text's ids after the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    return context_ids, whole[len(context_ids) :]


def read_samples(out: Path, task: str) -> list[dict]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])


def test_lm_eval_local_completions_scores_equal_the_engine_and_hf_float32(
    lmeval_python, f32_frontend, tiny_llama_dir, tmp_path
):
    tasks = write_tasks(tmp_path)
    out = tmp_path / "results"
    model_args = (
        f"model={MODEL},base_url={f32_frontend}/v1/completions,tokenizer_backend=remote,"
        "max_length=512,max_retries=1,timeout=120"
    )
    command = [str(lmeval_python), "-m", "lm_eval", "run", "--model", "local-completions"]
    command += ["--model_args", model_args, "--tasks", "lmforge_mc,lmforge_gen", "--include_path", str(tasks)]
    command += ["--output_path", str(out), "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["HF_DATASETS_CACHE"] = str(tmp_path / "datasets-cache")
    env.pop("PYTHONPATH", None)  # lm-eval's own venv, none of the project's modules
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    (results_path,) = out.rglob("results_*.json")
    results = json.loads(results_path.read_text())["results"]

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    llm = LLM(str(tiny_llama_dir), **ENGINE_F32)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    # multiple choice: every choice's loglikelihood, from the engine's prompt logprobs and from HF float32
    samples = read_samples(out, "lmforge_mc")
    assert [s["doc_id"] for s in samples] == list(range(len(MC_DOCS)))
    pairs = [encode_pair(tokenizer, *args) for s in samples for args in _arguments(s)]
    served = [float(resp[0][0]) for s in samples for resp in s["resps"]]
    prompts = [{"prompt_token_ids": context + continuation} for context, continuation in pairs]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    engine_scores, hf_scores = [], []
    for (context, continuation), output in zip(pairs, outputs):
        ids = context + continuation
        engine_scores.append(sum(output.prompt_logprobs[i][ids[i]] for i in range(len(context), len(ids))))
        with torch.inference_mode():
            logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, vocab]
        hf_scores.append(sum(float(logprobs[i - 1, ids[i]]) for i in range(len(context), len(ids))))
    assert len(served) == sum(len(d["choices"]) for d in MC_DOCS)
    for got, engine_score, hf_score in zip(served, engine_scores, hf_scores):
        assert abs(got - engine_score) <= 1e-4 and abs(got - hf_score) <= 1e-3, (got, engine_score, hf_score)
    start, expected_acc = 0, []
    for doc in MC_DOCS:  # acc: the highest loglikelihood picks the answer
        scores = engine_scores[start : start + len(doc["choices"])]
        expected_acc.append(float(scores.index(max(scores)) == doc["answer"]))
        start += len(doc["choices"])
    assert results["lmforge_mc"]["acc,none"] == pytest.approx(sum(expected_acc) / len(expected_acc))

    # generation: the engine's greedy completions of the same ids, cut at the first stop string
    gen = read_samples(out, "lmforge_gen")
    contexts = [tokenizer(_arguments(s)[0][0], add_special_tokens=False).input_ids for s in gen]
    greedy = llm.generate(
        [{"prompt_token_ids": ids} for ids in contexts], SamplingParams(max_tokens=MAX_GEN_TOKS, temperature=0)
    )
    for sample, output in zip(gen, greedy):
        expected = output.outputs[0].text
        for stop in UNTIL:
            expected = expected.split(stop)[0]
        assert sample["filtered_resps"][0] == expected, (sample["filtered_resps"], output.outputs[0].text)
    assert "exact_match,none" in results["lmforge_gen"]


def _arguments(sample: dict) -> list[tuple]:
    """A logged sample's request arguments: (context, continuation) or (context, generation kwargs) each."""
    arguments = sample["arguments"]
    if isinstance(arguments, dict):  # {"gen_args_0": {"arg_0": ..., "arg_1": ...}, ...}
        return [tuple(a[k] for k in sorted(a)) for _, a in sorted(arguments.items(), key=lambda kv: int(kv[0][9:]))]
    return [tuple(a) for a in arguments]
