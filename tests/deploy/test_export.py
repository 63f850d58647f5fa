"""Triton export without a server: config builders, the repository check, request parsing."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from deploy.export import export, print_check
from deploy.llm_request import parse_request
from deploy.model_config import (
    CONFIG_NAME,
    ConfigCheckError,
    check_repository,
    encoder_ensemble_config,
    encoder_onnx_config,
    encoder_python_config,
    llm_config,
    parse_config_text,
    to_text,
    tokenizer_config,
)
from deploy.triton import free_ports, port_is_free, servable_models
from engine.errors import UsageError
from lmforge_cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llm_repo(tmp_path_factory, tiny_llama_dir) -> Path:
    repo = tmp_path_factory.mktemp("repo")
    export(tiny_llama_dir, repo, name="llm", engine={"max_model_len": 256, "max_num_seqs": 8})
    return repo


def test_built_configs_round_trip_through_the_proto():
    builders = [
        llm_config("llm"),
        encoder_python_config("enc", hidden_size=384),
        encoder_onnx_config("enc_onnx", input_names=["input_ids", "attention_mask"], hidden_size=384),
        tokenizer_config("enc_tok", output_names=["input_ids", "attention_mask"], max_length=128),
        encoder_ensemble_config(
            "enc_ens",
            tokenizer="enc_tok",
            encoder="enc_onnx",
            tensor_names=["input_ids", "attention_mask"],
            hidden_size=384,
        ),
    ]
    for config in builders:
        assert parse_config_text(to_text(config)) == config
    llm = builders[0]
    assert llm.model_transaction_policy.decoupled and llm.backend == "python"
    assert [i.name for i in llm.input] == [
        "text_input",
        "prompt_token_ids",
        "stream",
        "sampling_parameters",
        "exclude_input_in_output",
    ]
    assert all(i.optional for i in llm.input)  # one of text_input / prompt_token_ids: checked by the model
    assert [o.name for o in llm.output] == [
        "text_output",
        "finish_reason",
        "num_input_tokens",
        "num_output_tokens",
        "index",
        "output_token_ids",
        "logprobs",
        "num_cached_tokens",
        "prompt_logprobs",
    ]
    onnx_config = builders[2]
    assert onnx_config.backend == "onnxruntime" and onnx_config.dynamic_batching.max_queue_delay_microseconds > 0
    assert (
        list(onnx_config.output[0].dims) == [384] and onnx_config.max_batch_size == 64
    )  # [-1, 384] with the batch dim


def test_llm_export_writes_config_model_py_and_engine_config(llm_repo, tiny_llama_dir):
    info = json.loads((llm_repo / "llm" / "1" / "model.json").read_text())
    assert info["kind"] == "llm" and info["checkpoint"] == str(tiny_llama_dir)
    assert info["engine"]["max_model_len"] == 256 and info["engine"]["max_num_seqs"] == 8
    assert "block_size" in info["engine"] and "model" not in info["engine"]
    model_py = (llm_repo / "llm" / "1" / "model.py").read_text()
    assert "from deploy.triton_llm import TritonPythonModel" in model_py
    checked, problems = check_repository(llm_repo)
    assert checked == [llm_repo / "llm" / "config.pbtxt"] and problems == []


def test_check_catches_a_wrong_field_by_file(llm_repo, tmp_path, capsys):
    repo = tmp_path / "repo"
    shutil.copytree(llm_repo, repo)
    shutil.copytree(repo / "llm", repo / "broken")
    text = (repo / "broken" / "config.pbtxt").read_text().replace('name: "llm"', 'name: "broken"')
    (repo / "broken" / "config.pbtxt").write_text(
        text.replace('name: "broken"', 'name: "broken"\nmax_batch_sise: 0')
    )  # misspelt field
    checked, problems = check_repository(repo)
    assert len(checked) == 2 and [p.path for p in problems] == [repo / "broken" / "config.pbtxt"]
    assert "max_batch_sise" in problems[0].message and str(repo / "broken" / "config.pbtxt") in problems[0].message
    assert print_check(repo) == 1
    out = capsys.readouterr().out
    assert f"ok    {repo / 'llm' / 'config.pbtxt'}" in out and "1/2 config(s) valid" in out
    # a bad enum value and a name that differs from the directory are caught too
    (repo / "broken" / "config.pbtxt").write_text(text.replace("KIND_CPU", "KIND_TPU"))
    assert "KIND_TPU" in check_repository(repo)[1][0].message
    (repo / "broken" / "config.pbtxt").write_text(text.replace('name: "broken"', 'name: "other"'))
    assert "differs from its directory" in check_repository(repo)[1][0].message
    with pytest.raises(ConfigCheckError, match="not a directory"):
        check_repository(tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigCheckError, match="no \\*/config.pbtxt"):
        check_repository(tmp_path / "empty")


def test_export_rejects_bad_engine_fields_and_names(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="max_num_seqs"):
        export(tiny_llama_dir, tmp_path, name="llm", engine={"max_num_seqs": 0})
    with pytest.raises(ValueError, match="--name"):
        export(tiny_llama_dir, tmp_path, name="../escape")
    assert not (tmp_path / "llm").exists()


def test_cli_export_and_check(tiny_llama_dir, tmp_path):
    assert (
        main(
            [
                "export",
                "--model",
                str(tiny_llama_dir),
                "--repo",
                str(tmp_path),
                "--name",
                "cli_llm",
                "--max-model-len",
                "128",
                "--no-enable-prefix-caching",
            ]
        )
        == 0
    )
    engine = json.loads((tmp_path / "cli_llm" / "1" / "model.json").read_text())["engine"]
    assert engine["max_model_len"] == 128 and engine["enable_prefix_caching"] is False
    assert main(["export", "--check", "--repo", str(tmp_path)]) == 0


def committed_repository(root: Path) -> Path:
    """A copy of the committed model_repository (configs and model.py files only: nothing exported yet)."""
    source = REPO_ROOT / "model_repository"
    for path in [*source.glob("*/config.pbtxt"), *source.glob("*/1/model.py")]:
        target = root / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
    return root


def test_committed_repository_parses(tmp_path):
    checked, problems = check_repository(REPO_ROOT / "model_repository")
    assert problems == [] and {p.parent.name for p in checked} >= {"smollm2_135m", "minilm"}
    repo = committed_repository(tmp_path)
    for name in ("smollm2_135m", "minilm", "minilm_tokenizer"):  # what an export adds
        (repo / name / "1" / ("model.json" if name == "smollm2_135m" else "encoder.json")).write_text("{}")
    loadable, skipped = servable_models(repo)
    assert set(loadable) == {"smollm2_135m", "minilm", "minilm_tokenizer"}
    assert set(skipped) == {"minilm_onnx", "minilm_ensemble"}  # need the full Triton container


def test_serve_skips_models_never_exported_and_refuses_them_by_name(tiny_llama_dir, tmp_path, capsys):
    repo = committed_repository(tmp_path / "repo")
    export(tiny_llama_dir, repo, name="smollm2_135m")  # only the LLM exported, as `lmforge export` does by default
    loadable, skipped = servable_models(repo)
    assert loadable == ["smollm2_135m"]
    encoder_hint = "not exported yet (run `lmforge export --kind encoder --model CHECKPOINT --name minilm`)"
    assert skipped["minilm"] == encoder_hint and skipped["minilm_tokenizer"] == encoder_hint
    ports = [str(p) for p in free_ports(3)]
    flags = ["--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]]
    # named explicitly (commas split the names): one clean line, no server started
    assert main(["serve", "--repo", str(repo), *flags, "--models", "minilm,smollm2_135m"]) == 1
    err = capsys.readouterr().err
    assert err == f"error: --models minilm: {encoder_hint}\n"
    assert not (repo / "tritonserver.pid").exists() and not (repo / "tritonserver.log").exists()


def test_export_refuses_an_llm_over_an_encoder_and_the_reverse(tiny_llama_dir, tmp_path, capsys):
    repo = tmp_path / "repo"
    export("minilm-l6", repo, name="minilm")
    export(tiny_llama_dir, repo, name="llm")
    before = {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()}
    assert main(["export", "--model", str(tiny_llama_dir), "--repo", str(repo), "--name", "minilm"]) == 2
    assert capsys.readouterr().err.startswith(
        f"error: --name minilm: {repo / 'minilm'} holds an encoder model (exported by `lmforge export --model "
        f"minilm-l6`), and an LLM cannot replace it; choose another --name or remove {repo / 'minilm'}"
    )
    assert main(["export", "--model", "minilm-l6", "--repo", str(repo), "--name", "llm"]) == 2
    assert f"error: --name llm: {repo / 'llm'} holds an LLM model (exported by" in capsys.readouterr().err
    with pytest.raises(UsageError, match="minilm_onnx holds an encoder model"):  # the container half too
        export(tiny_llama_dir, repo, name="minilm_onnx")
    assert {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()} == before  # nothing written


def test_default_export_renders_the_committed_llm_config_byte_for_byte():
    """A default `lmforge export` rewrites model_repository/smollm2_135m/config.pbtxt: no diff in the checkout."""
    committed = (REPO_ROOT / "model_repository" / "smollm2_135m" / CONFIG_NAME).read_text()
    assert to_text(llm_config("smollm2_135m", instance_count=1)) == committed


@pytest.mark.parametrize(
    "inputs, message",
    [
        ({"text_input": [b"hi"], "sampling_parameters": [b"{not json"]}, "malformed JSON"),
        ({"text_input": [b"hi"], "sampling_parameters": [b'{"max_token": 3}']}, "unknown"),
        ({"text_input": [b"hi"], "sampling_parameters": [b'{"max_tokens": -1}']}, "max_tokens"),
        ({"text_input": [b"hi"], "sampling_parameters": [b"[1, 2]"]}, "JSON object"),
        ({"text_input": [b"   "]}, "text_input: empty"),
        ({"text_input": None}, "text_input: missing"),
        ({"text_input": [b"\xff\xfe"]}, "UTF-8"),
        ({"text_input": [b"hi"], "sampling_parameters": [b'{"n": 0}']}, "n=0"),
        ({"text_input": [b"hi"], "sampling_parameters": [b'{"presence_penalty": 3}']}, "presence_penalty"),
        ({"text_input": [b"hi"], "prompt_token_ids": [1, 2]}, "both given"),
        ({"text_input": None, "prompt_token_ids": []}, "prompt_token_ids: empty"),
    ],
)
def test_parse_request_rejects_bad_input_naming_the_field(inputs, message):
    with pytest.raises(ValueError, match=message):
        parse_request(**{k: None if v is None else np.array(v, dtype=object) for k, v in inputs.items()})


def test_parse_request_defaults_and_values():
    request = parse_request(np.array([b"Hello"], dtype=object))
    assert request.prompt == "Hello" and not request.stream and not request.exclude_input_in_output
    assert request.sampling_params.max_tokens == 16
    request = parse_request(
        np.array([[b"Hello"]], dtype=object),
        np.array([True]),
        np.array([b'{"temperature": 0, "max_tokens": 5}'], dtype=object),
        np.array([True]),
    )
    assert request.stream and request.exclude_input_in_output
    assert request.sampling_params.temperature == 0 and request.sampling_params.max_tokens == 5
    fields = (
        b'{"n": 2, "min_tokens": 2, "presence_penalty": 0.5, "frequency_penalty": -0.5, "min_p": 0.1, '
        b'"logit_bias": {"7": -100}}'
    )
    request = parse_request(
        None, np.array([True]), np.array([fields], dtype=object), None, np.array([3, 4, 5], dtype=np.int64)
    )
    assert request.prompt == {"prompt_token_ids": [3, 4, 5]} and request.prompt_text == ""
    p = request.sampling_params
    assert (p.n, p.min_tokens, p.presence_penalty, p.frequency_penalty, p.min_p, p.logit_bias) == (
        2,
        2,
        0.5,
        -0.5,
        0.1,
        {7: -100.0},
    )


def test_port_helpers():
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(port_is_free(p) for p in ports)

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", ports[0]))
        listener.listen()
        assert not port_is_free(ports[0])


def test_encoder_export_prints_only_its_own_output(tmp_path):
    """The ONNX exporter's tracer and config warnings do not reach the terminal of ``lmforge export``."""
    repo = tmp_path / "repo"
    cmd = [sys.executable, "-m", "lmforge_cli", "export", "--model", "minilm-l6", "--repo", str(repo), "--name", "enc"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == ""
    assert proc.stdout.splitlines()[0] == f"wrote {repo / 'enc' / 'config.pbtxt'}"
