"""The one error handler of ``lmforge_cli.main``: message on stderr, exit 2 / 1 / 130, no traceback."""

from __future__ import annotations

import argparse
import types

import pytest

import lmforge_cli
from compress.checkpoints import CheckpointError
from compress.data import DataError
from compress.diagnose import RunDirError
from compress.errors import LmforgeError, UsageError
from compress.evaluate import EvaluationError
from compress.training import TrainingError
from bench.loadtest import LoadTestError
from bench.prompts import PromptError
from bench.workload import WorkloadError
from deploy.model_config import ConfigCheckError
from deploy.triton import TritonError


def test_error_classes_share_the_base_and_keep_their_builtin_base():
    for cls, builtin in [(CheckpointError, ValueError), (DataError, ValueError), (EvaluationError, ValueError),
                         (RunDirError, ValueError), (PromptError, ValueError), (WorkloadError, ValueError),
                         (ConfigCheckError, ValueError), (TrainingError, RuntimeError), (LoadTestError, RuntimeError),
                         (TritonError, RuntimeError)]:
        assert issubclass(cls, LmforgeError) and issubclass(cls, builtin), cls
    assert UsageError("--x 3: too big", fix="use 2").exit_code == 2 and CheckpointError("p").exit_code == 1
    assert str(UsageError("--x 3: too big", fix="use 2")) == "--x 3: too big; use 2"
    assert str(CheckpointError("p: missing")) == "p: missing"


def _fake_command(monkeypatch, run):
    """Point ``lmforge info`` at a module whose ``run`` is ``run``."""
    module = types.SimpleNamespace(add_arguments=lambda parser: None, run=run)
    real_import = lmforge_cli.importlib.import_module
    monkeypatch.setattr(lmforge_cli.importlib, "import_module",
                        lambda name: module if name == "compress.checkpoints" else real_import(name))


def _raise(exc: BaseException):
    def run(args: argparse.Namespace) -> int:
        raise exc
    return run


@pytest.mark.parametrize("exc, status, message", [
    (UsageError("--port 70000: out of range", fix="use 1-65535"), 2, "error: --port 70000: out of range; use 1-65535"),
    (CheckpointError("/m/config.json: not JSON"), 1, "error: /m/config.json: not JSON"),
    (PermissionError(13, "Permission denied", "/ro/out"), 1, "error: /ro/out: Permission denied"),
    (ValueError("max_num_seqs=0; it must be >= 1"), 1, "error: max_num_seqs=0; it must be >= 1"),
    (KeyError("boom"), 1, "error: unexpected KeyError: 'boom' (rerun with --debug"),
    (KeyboardInterrupt(), 130, "error: interrupted"),
])
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
