"""The guarded output writer: no command replaces or writes into what it did not create."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import bench.loadtest as loadtest
import lmforge_cli
from bench.harness import Finished
from compress.quantize.onnx import export_onnx
from engine.checkpoint.outputs import (
    CHECKPOINT,
    DATA,
    TRAINING_FINAL,
    OutputDirError,
    check_copy,
    check_output_dir,
    check_output_file,
    staged_output_dir,
    write_output_file,
)
from engine.checkpoint.store import convert_gguf, named_source_path, read_manifest, resolve_checkpoint


@pytest.fixture()
def precious(tmp_path) -> Path:
    """A user's directory holding a file that must survive every refused command."""
    path = tmp_path / "precious"
    path.mkdir()
    (path / "notes.txt").write_text("keep me")
    return path


def _kept(path: Path) -> bool:
    return (path / "notes.txt").read_text() == "keep me" and sorted(p.name for p in path.iterdir()) == ["notes.txt"]


def test_check_refuses_cwd_parents_inputs_links_files_and_foreign_dirs(tmp_path, precious, monkeypatch):
    monkeypatch.chdir(precious)
    for bad in (".", "..", "/"):
        with pytest.raises(OutputDirError, match="working directory or one of its parents"):
            check_output_dir(bad)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    with pytest.raises(OutputDirError, match="precious: not empty and not an earlier lmforge checkpoint"):
        check_output_dir(precious)
    source = tmp_path / "a" / "ckpt"
    source.mkdir(parents=True)
    with pytest.raises(OutputDirError, match="would replace the input"):
        check_output_dir(source, sources=(source,))
    with pytest.raises(OutputDirError, match="would replace the input"):
        check_output_dir(tmp_path / "a", sources=(source,))  # a parent of the input
    with pytest.raises(OutputDirError, match="inside the input"):
        check_output_dir(source / "sub", sources=(source,))
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputDirError, match="exists and is not a directory"):
        check_output_dir(tmp_path / "file")
    (tmp_path / "link").symlink_to(precious)
    with pytest.raises(OutputDirError, match="symbolic link"):
        check_output_dir(tmp_path / "link")
    (tmp_path / "empty").mkdir()
    assert check_output_dir("../empty") == tmp_path / "empty"  # relative paths come back absolute
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "lmforge.json").write_text('{"method": "dynamic"}')
    assert check_output_dir(tmp_path / "old", kind=CHECKPOINT) == tmp_path / "old"
    with pytest.raises(OutputDirError, match="not an earlier lmforge data directory"):
        check_output_dir(tmp_path / "old", kind=DATA)  # an output of another kind
    assert _kept(precious)
    with pytest.raises(OutputDirError, match="one contains the other"):
        check_copy(source, source / "repo" / "m" / "1" / "weights")


def test_staged_writer_replaces_an_earlier_output_whole_and_keeps_it_on_failure(tmp_path):
    out = tmp_path / "out"
    with staged_output_dir(out) as tmp:
        (tmp / "lmforge.json").write_text('{"method": "dynamic", "v": 1}')
        assert not out.exists()  # nothing at the target until the work is done
    with pytest.raises(RuntimeError, match="interrupted"):
        with staged_output_dir(out) as tmp:
            (tmp / "lmforge.json").write_text('{"method": "dynamic", "v": 2}')
            raise RuntimeError("interrupted")
    assert json.loads((out / "lmforge.json").read_text()) == {"method": "dynamic", "v": 1}
    with staged_output_dir(out) as tmp:
        (tmp / "lmforge.json").write_text('{"method": "dynamic", "v": 3}')
    assert json.loads((out / "lmforge.json").read_text()) == {"method": "dynamic", "v": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary sibling left


def test_a_staged_output_gets_the_mode_of_a_plain_mkdir(tmp_path):
    """The output is readable by whoever may read its parent, as ``mkdir`` would make it (not 0o700)."""
    (tmp_path / "plain").mkdir()
    with staged_output_dir(tmp_path / "out") as tmp:
        (tmp / "lmforge.json").write_text("{}")
    assert (tmp_path / "out").stat().st_mode == (tmp_path / "plain").stat().st_mode


def test_quantize_cli_refuses_foreign_cwd_and_input(tiny_llama_dir, precious, monkeypatch, capsys):
    before = sorted(p.name for p in tiny_llama_dir.iterdir())
    for out, reason in [
        (precious, "not an earlier lmforge checkpoint"),
        (tiny_llama_dir, "would replace the input"),
        (tiny_llama_dir / "int8", "inside the input"),
    ]:
        assert (
            lmforge_cli.main(["quantize", "--model", str(tiny_llama_dir), "--method", "w8a8", "--out", str(out)]) == 2
        )
        err = capsys.readouterr().err
        assert f"error: {Path(out).resolve()}: " in err and reason in err and "choose a new or empty directory" in err
    monkeypatch.chdir(precious)
    assert lmforge_cli.main(["quantize", "--model", str(tiny_llama_dir), "--method", "w8a8", "--out", "."]) == 2
    assert "working directory" in capsys.readouterr().err
    assert _kept(precious) and sorted(p.name for p in tiny_llama_dir.iterdir()) == before


def test_onnx_export_refuses_a_foreign_directory(tiny_llama_dir, precious):
    with pytest.raises(OutputDirError, match="precious: not empty"):
        export_onnx(tiny_llama_dir, precious, task="text-generation-with-past")
    assert _kept(precious)


def test_finetune_and_distill_refuse_a_foreign_run_dir(tiny_llama_dir, precious, tmp_path, capsys):
    data = tmp_path / "data"
    for command in ("finetune", "distill"):
        assert (
            lmforge_cli.main(
                [
                    command,
                    "--model",
                    str(tiny_llama_dir),
                    "--data",
                    str(data),
                    "--run-dir",
                    str(precious),
                    "--max-steps",
                    "1",
                    "--no-progress",
                ]
            )
            == 2
        )
        assert "not an earlier lmforge training run (no run.json)" in capsys.readouterr().err
    assert _kept(precious)


def test_data_refuses_a_foreign_out_and_one_holding_its_input(precious, tmp_path, capsys):
    records = tmp_path / "in" / "records.jsonl"
    records.parent.mkdir()
    records.write_text("".join(json.dumps({"text": f"line number {i} of the data"}) + "\n" for i in range(8)))
    assert lmforge_cli.main(["data", "--input", str(records), "--out", str(precious)]) == 2
    assert "not an earlier lmforge data directory" in capsys.readouterr().err
    assert lmforge_cli.main(["data", "--input", str(records), "--out", str(records.parent)]) == 2
    assert "would replace the input" in capsys.readouterr().err
    assert _kept(precious) and records.is_file()


def test_export_copy_weights_into_the_checkpoint_is_refused(tiny_llama_dir, tmp_path, capsys):
    before = sorted(p.name for p in tiny_llama_dir.iterdir())
    repo = tiny_llama_dir / "model_repository"
    assert lmforge_cli.main(["export", "--model", str(tiny_llama_dir), "--repo", str(repo), "--copy-weights"]) == 2
    assert "inside the input" in capsys.readouterr().err
    assert sorted(p.name for p in tiny_llama_dir.iterdir()) == before
    foreign = tmp_path / "repo" / "m"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("keep me")
    assert (
        lmforge_cli.main(["export", "--model", str(tiny_llama_dir), "--repo", str(tmp_path / "repo"), "--name", "m"])
        == 2
    )
    assert "not an earlier Triton model directory (no config.pbtxt)" in capsys.readouterr().err
    assert _kept(foreign)
    users = tmp_path / "users-model"  # a checkpoint lmforge only read: its manifest says method import
    shutil.copytree(tiny_llama_dir, users)
    (users / "lmforge.json").unlink()
    for _ in range(2):
        assert (
            lmforge_cli.main(
                ["export", "--model", str(users), "--repo", str(tmp_path / "repo"), "--name", "u", "--copy-weights"]
            )
            == 0
        )
    assert json.loads((tmp_path / "repo" / "u" / "1" / "weights" / "lmforge.json").read_text())["method"] == "import"
    out = str(tmp_path / "repo")
    export_w = ["export", "--model", str(tiny_llama_dir), "--repo", out, "--name", "w", "--copy-weights"]
    assert lmforge_cli.main(export_w) == 0
    weights = tmp_path / "repo" / "w" / "1" / "weights"
    assert sorted(p.name for p in weights.iterdir()) == before
    assert lmforge_cli.main(export_w) == 0  # an earlier export of the same name is replaced
    assert sorted(p.name for p in weights.iterdir()) == before


def test_render_refuses_a_directory_of_foreign_files(precious, tmp_path, capsys):
    (precious / "compose.yaml").write_text("services: {}\n")  # the user's own compose file
    assert lmforge_cli.main(["render", "--target", "docker", "--out", str(precious)]) == 2
    assert "not an earlier `lmforge render` output" in capsys.readouterr().err
    assert (precious / "compose.yaml").read_text() == "services: {}\n"
    assert lmforge_cli.main(["render", "--target", "docker", "--out", str(tmp_path / "docker")]) == 0
    (tmp_path / "docker" / "mine.txt").write_text("kept")
    assert lmforge_cli.main(["render", "--target", "docker", "--out", str(tmp_path / "docker")]) == 0  # re-render
    assert (tmp_path / "docker" / "mine.txt").read_text() == "kept"


def test_loadtest_demo_and_bench_out_are_checked_before_any_work(precious, capsys, monkeypatch, tmp_path):
    argvs = [
        ["loadtest", "--host", "http://127.0.0.1:9", "--model", "m", "--out", str(precious)],
        ["demo", "--smoke", "--out", str(precious)],
        ["bench", "compression", "--out", str(precious), "--skip-minilm"],
    ]
    for argv in argvs:
        assert lmforge_cli.main(argv) == 2, argv
        assert f"{precious}: not empty and not an earlier lmforge" in capsys.readouterr().err
    assert _kept(precious)


def test_loadtest_relative_out_gets_the_child_files(tmp_path, monkeypatch):
    """The load generator runs in the repository root: every path it gets must be absolute."""
    seen = {}

    def fake_child(command, timeout_s, *, cwd, **kwargs):
        seen["command"], seen["cwd"] = command, cwd
        samples = Path(cwd) / command[command.index("--samples-out") + 1]  # as the child resolves it
        samples.write_text("")
        return Finished(1, "", "", False)

    monkeypatch.setattr(loadtest, "preflight", lambda config: None)
    monkeypatch.setattr(loadtest, "warm_up", lambda config, prompts: None)
    monkeypatch.setattr(loadtest, "run_process", fake_child)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(loadtest.LoadTestError, match="no requests were measured"):
        loadtest.run_loadtest(loadtest.LoadTestConfig(host="http://127.0.0.1:9", model="m"), "reports/rel")
    assert Path(seen["cwd"]) != tmp_path
    assert (tmp_path / "reports" / "rel" / "samples.jsonl").is_file() and (
        tmp_path / "reports" / "rel" / "locust.log"
    ).is_file()


def test_gguf_conversion_refuses_a_foreign_directory(precious):
    with pytest.raises(OutputDirError, match="precious: not empty and not an earlier lmforge checkpoint"):
        convert_gguf(named_source_path("smollm2-135m"), precious)  # refused before the GGUF is loaded
    assert _kept(precious)


def test_a_users_checkpoint_that_lmforge_only_read_is_never_replaced(tiny_llama_dir, tmp_path, capsys):
    """Resolving a user's Hugging Face directory adds an ``import`` manifest; that does not make it ours."""
    users = tmp_path / "my-model"
    shutil.copytree(tiny_llama_dir, users)
    (users / "lmforge.json").unlink()
    resolve_checkpoint(users)
    assert read_manifest(users).method == "import"
    before = sorted(p.name for p in users.iterdir())
    assert lmforge_cli.main(["quantize", "--model", str(tiny_llama_dir), "--method", "w8a8", "--out", str(users)]) == 2
    assert "not an earlier lmforge checkpoint (no lmforge.json that lmforge wrote)" in capsys.readouterr().err
    assert sorted(p.name for p in users.iterdir()) == before
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "lmforge.json").write_text("{not json")
    with pytest.raises(OutputDirError, match="corrupt: not empty"):
        check_output_dir(tmp_path / "corrupt")


def test_a_lora_adapter_is_not_replaced_by_a_checkpoint(tiny_llama_dir, tmp_path, capsys):
    """``quantize --out`` an adapter ``finetune --lora`` wrote is refused (its lmforge.json is not a
    checkpoint's); only a training run may replace its own ``final/`` adapter."""
    adapter = tmp_path / "run" / "final"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    (adapter / "lmforge.json").write_text(json.dumps({"method": "finetune-lora", "parent": str(tiny_llama_dir)}))
    before = {p.name: p.read_bytes() for p in adapter.iterdir()}
    assert (
        lmforge_cli.main(["quantize", "--model", str(tiny_llama_dir), "--method", "w8a8", "--out", str(adapter)]) == 2
    )
    assert f"error: {adapter}: not empty and not an earlier lmforge checkpoint" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in adapter.iterdir()} == before
    assert not CHECKPOINT.is_earlier_output(adapter) and TRAINING_FINAL.is_earlier_output(adapter)
    assert CHECKPOINT.is_earlier_output(tiny_llama_dir) and TRAINING_FINAL.is_earlier_output(tiny_llama_dir)


def test_output_files_replace_only_what_lmforge_wrote(tmp_path, precious, monkeypatch, capsys):
    """``--json`` / ``--out`` files: a user's file, an input or an edited report is never overwritten."""
    monkeypatch.setenv("LMFORGE_CACHE", str(tmp_path / "cache"))
    notes = precious / "notes.txt"
    with pytest.raises(OutputDirError, match="notes.txt: the file exists and was not written by lmforge"):
        check_output_file(notes, flag="--json")
    report = tmp_path / "report.json"
    write_output_file(report, "{}\n", flag="--json")
    write_output_file(report, '{"again": 1}\n', flag="--json")  # our own, unchanged: replaced
    assert json.loads(report.read_text()) == {"again": 1}
    report.write_text('{"edited by hand": true}\n')
    with pytest.raises(OutputDirError, match="was changed since"):
        check_output_file(report, flag="--json")
    link = tmp_path / "link.json"
    link.symlink_to(notes)
    with pytest.raises(OutputDirError, match="is a symbolic link"):
        check_output_file(link, flag="--json")
    # the reported commands: diagnose onto its own training log, plan onto a checkpoint's config.json
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "split": "train", "loss": 2.0}) + "\n")
    before = metrics.read_text()
    assert lmforge_cli.main(["diagnose", str(run_dir), "--json", str(metrics)]) == 2
    assert "was not written by lmforge" in capsys.readouterr().err
    assert metrics.read_text() == before
    assert _kept(precious)


def test_bench_serving_refuses_a_foreign_out_before_any_work(precious, capsys):
    assert (
        lmforge_cli.main(
            [
                "bench",
                "serving",
                "--endpoint",
                "name=x,api=openai,url=http://127.0.0.1:9,model=m",
                "--out",
                str(precious),
            ]
        )
        == 2
    )
    assert f"{precious}: not empty and not an earlier lmforge serving benchmark directory" in capsys.readouterr().err
    assert _kept(precious)
