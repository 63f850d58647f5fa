"""The one error handler of ``lmforge_cli.main``: message on stderr, exit 2 / 1 / 130, no traceback."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import types

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

import lmforge_cli
from bench.loadtest import LoadTestError
from bench.prompts import PromptError
from bench.workload import WorkloadError
from compress.evaluate.quality import EvaluationError
from compress.scale.diagnose import RunDirError
from compress.train.loop import TrainingError
from deploy.model_config import ConfigCheckError
from deploy.triton import TritonError
from engine.checkpoint.store import CheckpointError
from engine.errors import LmforgeError, UsageError
from engine.records import DataError


def test_error_classes_share_the_base_and_keep_their_builtin_base():
    for cls, builtin in [
        (CheckpointError, ValueError),
        (DataError, ValueError),
        (EvaluationError, ValueError),
        (RunDirError, ValueError),
        (PromptError, ValueError),
        (WorkloadError, ValueError),
        (ConfigCheckError, ValueError),
        (TrainingError, RuntimeError),
        (LoadTestError, RuntimeError),
        (TritonError, RuntimeError),
    ]:
        assert issubclass(cls, LmforgeError) and issubclass(cls, builtin), cls
    assert UsageError("--x 3: too big", fix="use 2").exit_code == 2 and CheckpointError("p").exit_code == 1
    assert str(UsageError("--x 3: too big", fix="use 2")) == "--x 3: too big; use 2"
    assert str(CheckpointError("p: missing")) == "p: missing"


def _fake_command(monkeypatch, run):
    """Point ``lmforge info`` at a module whose ``run`` is ``run``."""
    module = types.SimpleNamespace(add_arguments=lambda parser: None, run=run)
    real_import = lmforge_cli.importlib.import_module
    monkeypatch.setattr(
        lmforge_cli.importlib,
        "import_module",
        lambda name: module if name == "engine.checkpoint.store" else real_import(name),
    )


def _raise(exc: BaseException):
    def run(args: argparse.Namespace) -> int:
        raise exc

    return run


@pytest.mark.parametrize(
    "exc, status, message",
    [
        (
            UsageError("--port 70000: out of range", fix="use 1-65535"),
            2,
            "error: --port 70000: out of range; use 1-65535",
        ),
        (CheckpointError("/m/config.json: not JSON"), 1, "error: /m/config.json: not JSON"),
        (PermissionError(13, "Permission denied", "/ro/out"), 1, "error: /ro/out: Permission denied"),
        (ValueError("max_num_seqs=0; it must be >= 1"), 1, "error: max_num_seqs=0; it must be >= 1"),
        (KeyError("boom"), 1, "error: unexpected KeyError: 'boom' (rerun with --debug"),
        (KeyboardInterrupt(), 130, "error: interrupted"),
    ],
)
def test_main_prints_one_line_and_exits_with_the_class_status(monkeypatch, capsys, exc, status, message):
    _fake_command(monkeypatch, _raise(exc))
    assert lmforge_cli.main(["info"]) == status
    captured = capsys.readouterr()
    assert captured.err.startswith(message) and "Traceback" not in captured.err and captured.out == ""


def test_debug_flag_anywhere_shows_the_traceback(monkeypatch, capsys):
    _fake_command(monkeypatch, _raise(CheckpointError("/m: corrupt")))
    for argv in (["--debug", "info"], ["info", "--debug"]):
        assert lmforge_cli.main(argv) == 1
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and err.rstrip().endswith("error: /m: corrupt")


def test_real_commands_report_on_stderr(tmp_path, capsys):
    assert lmforge_cli.main(["info", "--model", str(tmp_path / "nope")]) == 1
    assert "nope: checkpoint not found" in capsys.readouterr().err
    assert lmforge_cli.main(["diagnose", str(tmp_path)]) == 2
    assert "metrics.jsonl: not found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # argparse's own usage errors keep status 2
        lmforge_cli.main(["plan", "--devices", "many"])
    assert info.value.code == 2


# --------------------------------------------------------------------------------------------
# Bad inputs of the real commands: the clear error, the exit status, and nothing written or lost
# --------------------------------------------------------------------------------------------


def _fails(argv: list[str], status: int, *needles: str, capsys) -> str:
    assert lmforge_cli.main(argv) == status, argv
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and "unexpected" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def test_false_success_is_refused(tiny_llama_dir, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    _fails(["diagnose", str(run)], 2, "metrics.jsonl: no train records, nothing to diagnose", capsys=capsys)
    (run / "metrics.jsonl").write_text('{"step": "1", "split": "train"}\n')
    _fails(["diagnose", str(run)], 2, "metrics.jsonl:1: step='1'; expected an integer", capsys=capsys)
    _fails(
        ["export", "--model", str(tiny_llama_dir), "--repo", str(tmp_path / "repo"), "--kind", "encoder"],
        2,
        "--kind encoder:",
        "is a causal LM",
        "--kind llm",
        capsys=capsys,
    )
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize(
    "flag, value, field",
    [
        ("--model-name", 'm"} or vector(1)', "model_name="),  # would be spliced into the PromQL rule
        ("--memory", "lots", "not a Kubernetes quantity"),
        ("--cpu", "0", "cpu='0': must be > 0"),
        ("--image", "Bad Image", "not an image reference"),
        ("--name", "Bad_Name", "not a Kubernetes name"),
        ("--namespace", "a" * 64, "not a Kubernetes name"),
        ("--locust-run-time", "soon", "not a duration"),
    ],
)
def test_render_validates_values_before_writing(tmp_path, capsys, flag, value, field):
    _fails(
        ["render", "--target", "k8s", "--out", str(tmp_path / "k8s"), flag, value],
        2,
        field,
        f"fix {flag}",
        capsys=capsys,
    )
    assert not (tmp_path / "k8s").exists()


def test_render_values_file_types_and_encoding(tmp_path, capsys):
    values = tmp_path / "values.yaml"
    values.write_text("cpu: 2\nreplicas: three\n")
    _fails(
        ["render", "--target", "k8s", "--out", str(tmp_path / "a"), "--values", str(values)],
        2,
        "replicas='three': must be an integer",
        capsys=capsys,
    )
    values.write_bytes(b"model_name: caf\xe9\n")
    _fails(
        ["render", "--target", "k8s", "--out", str(tmp_path / "b"), "--values", str(values)],
        2,
        f"--values {values}: not a UTF-8 YAML file",
        capsys=capsys,
    )
    values.write_text("cpu: 2\n")  # a YAML number where a quantity string is meant is fine
    assert lmforge_cli.main(["render", "--target", "k8s", "--out", str(tmp_path / "c"), "--values", str(values)]) == 0


def test_export_validates_device_and_length_against_the_machine_and_model(tiny_llama_dir, tmp_path, capsys):
    repo = tmp_path / "repo"
    if not torch.cuda.is_available():
        _fails(
            ["export", "--model", str(tiny_llama_dir), "--repo", str(repo), "--device", "cuda"],
            2,
            "--device cuda: CUDA is not available",
            capsys=capsys,
        )
    max_positions = json.loads((tiny_llama_dir / "config.json").read_text())["max_position_embeddings"]
    _fails(
        ["export", "--model", str(tiny_llama_dir), "--repo", str(repo), "--max-model-len", str(max_positions + 1)],
        2,
        f"--max-model-len {max_positions + 1}: longer than the model's max_position_embeddings={max_positions}",
        capsys=capsys,
    )
    assert not repo.exists()
    (tmp_path / "file").write_text("x")
    _fails(
        ["export", "--model", str(tiny_llama_dir), "--repo", str(tmp_path / "file")],
        2,
        "exists and is not a directory",
        capsys=capsys,
    )


def test_checkpoint_files_are_checked_by_path(tiny_llama_dir, tmp_path, capsys):
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_llama_dir, no_tokenizer)
    for file in no_tokenizer.glob("tokenizer*"):
        file.unlink()
    for command in (["info", "--model"], ["generate", "--prompt", "hi", "--model"]):
        _fails(
            [*command, str(no_tokenizer)], 1, f"{no_tokenizer}: no tokenizer files", "save_pretrained", capsys=capsys
        )
    (no_tokenizer / "config.json").write_bytes(b"\xff\xfe{}")
    _fails(["info", "--model", str(no_tokenizer)], 1, "config.json: not valid JSON", capsys=capsys)
    _fails(["info", "--model", ""], 2, "--model is empty", capsys=capsys)


def test_non_utf8_inputs_name_the_file(tiny_llama_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "caf\xe9"}\n')
    message = f"{bad}: not UTF-8 text (byte 13"
    _fails(["data", "--input", str(bad), "--out", str(tmp_path / "d")], 1, message, capsys=capsys)
    _fails(
        ["evaluate", str(tiny_llama_dir), "--data", str(bad), "--no-latency", "--no-write"], 1, message, capsys=capsys
    )
    _fails(
        [
            "loadtest",
            "--host",
            "http://127.0.0.1:9",
            "--model",
            "m",
            "--prompts",
            str(bad),
            "--out",
            str(tmp_path / "lt"),
        ],
        1,
        message,
        capsys=capsys,
    )
    _fails(
        ["generate", "--model", str(tiny_llama_dir), "--prompt", "caf\udce9"],
        2,
        "--prompt #1: not UTF-8 text",
        capsys=capsys,
    )
    for chat in ([], ["--chat"]):  # the chat template alone would make a prompt of an empty one
        _fails(
            ["generate", "--model", str(tiny_llama_dir), *chat, "--prompt", "  "],
            2,
            "--prompt #1 is empty",
            capsys=capsys,
        )
    assert not (tmp_path / "d").exists()


def test_flags_out_of_range_are_usage_errors(tiny_llama_dir, tmp_path, capsys):
    model, tmp = str(tiny_llama_dir), str(tmp_path)

    def train(command: str) -> list[str]:
        return [command, "--model", model, "--data", tmp, "--run-dir", str(tmp_path / "r")]

    cases = [  # (argv, what stderr says); each exits 2
        (["serve", "--repo", tmp, "--http-port", "70000"], "--http-port 70000: not a TCP port"),
        (["serve", "--repo", tmp, "--grpc-port", "8000", "--http-port", "8000"], "three different ports"),
        (
            ["loadtest", "--host", "http://127.0.0.1:99999", "--model", "m", "--out", str(tmp_path / "lt")],
            "the port is not a number in 1-65535",
        ),
        (
            [*train("distill"), "--student-config", '{"num_hidden_layers": -1}'],
            "--student-config num_hidden_layers=-1: must be an integer >= 1",
        ),
        ([*train("distill"), "--student-config", "[4]"], "expected a JSON object"),
        (["plan", "--model", model, "--dp", "1", "--tp", "0", "--pp", "1"], "--tp 0: a parallel degree must be >= 1"),
        (
            ["quantize", "--model", model, "--method", "llm-int8", "--device", "tpu", "--out", str(tmp_path / "q")],
            "device='tpu'",
        ),
        (["generate", "--model", model, "--prompt", "hi", "--device", "tpu"], "--device 'tpu': not a device"),
        ([*train("finetune"), "--lr", "-1"], "lr=-1.0: must be > 0"),
        (["data", "--val-fraction", "2", "--out", str(tmp_path / "d")], "--val-fraction 2.0: must be in (0, 1)"),
        (["evaluate", model, "--max-records", "0"], "--max-records 0: must be >= 1"),
        (["export", "--model", model, "--repo", ""], "--repo is empty; pass a model repository directory"),
        (["export", "--check", "--repo", " "], "--repo is empty"),
        (["evaluate", model, "--threads", "0"], "--threads 0: must be >= 1"),
        (["data", "--dedup-threshold", "2", "--out", str(tmp_path / "d")], "--dedup-threshold 2.0: must be in (0, 1]"),
    ]
    for argv, message in cases:
        _fails(argv, 2, message, capsys=capsys)
    assert not (tmp_path / "q").exists() and not (tmp_path / "r").exists() and not (tmp_path / "d").exists()


def test_unwritable_json_outputs_are_refused_before_the_work(tiny_llama_dir, tmp_path, capsys):
    _fails(
        ["evaluate", str(tiny_llama_dir), "--no-latency", "--no-write", "--json", str(tmp_path)],
        2,
        f"--json {tmp_path}: is a directory",
        capsys=capsys,
    )
    _fails(
        ["plan", "--model", str(tiny_llama_dir), "--json", str(tmp_path / "missing" / "p.json")],
        2,
        "does not exist",
        capsys=capsys,
    )


def test_lora_target_modules_are_checked_against_the_model(tiny_llama_dir, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.jsonl", "val.jsonl"):
        (data / name).write_text(
            "".join(json.dumps({"text": f"record {i} of the tiny data set"}) + "\n" for i in range(8))
        )
    _fails(
        [
            "finetune",
            "--model",
            str(tiny_llama_dir),
            "--data",
            str(data),
            "--run-dir",
            str(tmp_path / "run"),
            "--lora",
            "--lora-target-modules",
            "q_proj,nope",
            "--max-steps",
            "1",
            "--micro-batch-size",
            "1",
            "--max-length",
            "16",
            "--no-progress",
        ],
        2,
        "--lora-target-modules: nope not in",
        "choose from its linear layers: ",
        "q_proj",
        capsys=capsys,
    )


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--top-p", "0"], "--top-p"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--num-threads", "0"], "--num-threads"),
        (["--max-tokens", "100000000"], "--max-tokens"),  # past the context: refused with the prompt, same flag
    ],
)
def test_generate_bad_sampling_and_engine_values_are_usage_errors_naming_the_flag(tiny_llama_dir, flags, named, capsys):
    assert lmforge_cli.main(["generate", "--model", str(tiny_llama_dir), "--prompt", "hi", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"change {named}" in err and "Traceback" not in err
    if flags[1] == "100000000":  # the limit it must stay within: the context left after the prompt
        max_model_len = AutoConfig.from_pretrained(tiny_llama_dir).max_position_embeddings
        prompt_tokens = len(AutoTokenizer.from_pretrained(tiny_llama_dir)("hi").input_ids)
        assert f"set max_tokens <= {max_model_len - prompt_tokens} " in err


def test_generate_hf_backend_refuses_max_tokens_past_the_context(tiny_llama_dir, capsys):
    context = AutoConfig.from_pretrained(tiny_llama_dir).max_position_embeddings
    prompt_tokens = len(AutoTokenizer.from_pretrained(tiny_llama_dir)("hi").input_ids)
    argv = [
        "generate",
        "--backend",
        "hf",
        "--model",
        str(tiny_llama_dir),
        "--prompt",
        "hi",
        "--max-tokens",
        "100000000",
    ]
    _fails(
        argv,
        2,
        f"> the model's context of {context} tokens",
        f"pass --max-tokens <= {context - prompt_tokens}",
        capsys=capsys,
    )


def test_generate_with_an_empty_model_is_a_usage_error(capsys):
    _fails(
        ["generate", "--model", "", "--prompt", "hi"], 2, "--model is empty; pass a checkpoint directory", capsys=capsys
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--grace-s", "-1"], "--grace-s -1: must be >= 0; e.g. --grace-s 15"),
        (["--startup-timeout-s", "0"], "--startup-timeout-s 0: must be > 0"),
        (["--openai-port", "23997", "--stall-timeout-s", "0"], "--stall-timeout-s 0: must be > 0"),
        (["--http-port", "23999", "--openai-port", "23999"], "--openai-port 23999: also the --http-port; give each"),
        (["--openai-port", "8002"], "--openai-port 8002: also the --metrics-port"),
        (["--openai-port", "23998", "--host", "192.0.2.1"], "--host 192.0.2.1: not an address of this machine"),
        (["--openai-port", "23996", "--api-key", ""], "--api-key is empty: the server would accept every client"),
        (["--api-key", "  "], "--api-key is empty"),
        (
            ["--stall-timeout-s", "5"],
            "--stall-timeout-s 5.0: it sets the OpenAI API, which runs only with --openai-port",
        ),
        (["--tool-call-parser", "hermes"], "--tool-call-parser hermes: it sets the OpenAI API"),
    ],
)
def test_serve_flags_refused_before_anything_starts(tmp_path, capsys, flags, message):
    """Each is a usage error (exit 2) on stderr, before a server starts or a file is written in the repository."""
    assert lmforge_cli.main(["serve", "--repo", str(tmp_path), *flags]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: {message}") and captured.err.count("\n") == 1 and captured.out == ""
    assert list(tmp_path.iterdir()) == []


def test_serve_port_outside_the_tcp_range_is_a_usage_error_on_stderr(capsys):
    assert lmforge_cli.main(["serve", "--repo", "model_repository", "--openai-port", "99999"]) == 2
    captured = capsys.readouterr()
    assert "--openai-port 99999: not a TCP port" in captured.err and captured.out == ""


def test_a_path_of_the_wrong_kind_is_named_as_such(tmp_path, capsys):
    """A directory where a file is wanted (and the reverse) is not reported as missing; nothing is written."""
    file, folder, out = tmp_path / "file.txt", tmp_path / "folder", str(tmp_path / "d")
    file.write_text("hello\n")
    folder.mkdir()
    _fails(["data", "--input", str(folder), "--out", out], 1, f"--input {str(folder)!r}: a directory", capsys=capsys)
    _fails(["data", "--input", "", "--out", out], 1, "--input '': empty; pass chatterbot:LANG", capsys=capsys)
    _fails(["serve", "--repo", str(file)], 1, f"{file}: is a file, not a model repository", capsys=capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "folder"]


LIGHT_COMMAND_MODULES = ["deploy.serve", "deploy.render", "compress.data.prepare", "compress.scale.diagnose"]


@pytest.mark.parametrize("module", LIGHT_COMMAND_MODULES)
def test_commands_that_need_no_model_import_neither_torch_nor_transformers(module):
    """`lmforge serve` (`--help`, `--stop`), `render`, `data` and `diagnose` answer in a fraction of a second."""
    probe = f"import sys, {module}; print(sorted({{'torch', 'transformers'}} & set(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout


def test_generate_stats_go_to_stderr_so_stdout_is_the_completion(tiny_llama_dir, capsys):
    args = ["generate", "--model", str(tiny_llama_dir), "--prompt", "hi", "--max-tokens", "2", "--stats"]
    assert lmforge_cli.main(args) == 0
    captured = capsys.readouterr()
    assert "[engine]" in captured.err and "[engine]" not in captured.out and captured.out.strip()
