"""The engine benchmark's OpenVINO GenAI peer and its ``--contention`` busy processes.

Unit tests build the export command, the pipeline settings and the run loop against a stand-in
pipeline, without the peer; the last test runs the real peer and is skipped only where
``make peers-openvino`` has not installed it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from bench import engine_bench
from bench.engine_backends import (
    BACKENDS,
    RunSpec,
    _openvino_generate,
    openvino_properties,
    openvino_scheduler_fields,
)
from bench.engine_bench import check_contention, parse_configs
from bench.engine_bench_report import (
    engine_targets,
    format_agreement_table,
    format_single_table,
    format_table,
    greedy_agreement,
    summarize,
    summarize_single,
)
from bench.harness import Peers
from bench.peer_runs import BusyProcesses, busy_cores, not_installed, prepare_peer_model, run_config
from bench.peers import PeerError, openvino_export_command, run_converter
from engine.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    engine_bench.add_arguments(p)
    return p


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------


def test_contention_and_openvino_options_parse():
    args = parser().parse_args([])
    assert args.contention == 0 and args.openvino_python is None and args.gguf_dir is None
    args = parser().parse_args(
        ["--contention", "1", "--openvino-python", "/x/bin/python", "--peer-model-dir", "cache", "--threads", "2"]
    )
    assert args.contention == 1 and args.openvino_python == "/x/bin/python" and args.gguf_dir == "cache"
    assert parser().parse_args(["--gguf-dir", "old"]).gguf_dir == "old"  # the old name still works
    with pytest.raises(SystemExit):
        parser().parse_args(["--contention", "one"])

    cores = len(os.sched_getaffinity(0))
    check_contention(0)
    check_contention(cores)
    with pytest.raises(UsageError, match=r"--contention -1; it must be between 0 \(quiet\) and"):
        check_contention(-1)
    with pytest.raises(UsageError, match=f"--contention {cores + 1}; .* and {cores}, the cores"):
        check_contention(cores + 1)


def test_openvino_configurations():
    assert parse_configs("openvino_fp32, openvino_bf16,openvino_int8") == [
        "openvino_fp32",
        "openvino_bf16",
        "openvino_int8",
    ]
    ov = {c: BACKENDS[c] for c in ("openvino_fp32", "openvino_bf16", "openvino_int8")}
    assert {b.interpreter for b in ov.values()} == {"openvino"}
    assert [b.dtype for b in ov.values()] == ["fp32", "bf16", "int8"]
    # fp32 and bf16 run one fp32 IR at two precisions; int8 its own IR of int8 weights
    assert [b.openvino_weights for b in ov.values()] == ["fp32", "fp32", "int8"]
    assert all(b.gguf_type is None for b in ov.values())


def test_contention_with_speculative_is_refused(capsys):
    args = parser().parse_args(["--speculative", "--contention", "1"])
    assert engine_bench.run(args) == 2
    assert "--contention applies to the engine table" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# The OpenVINO runner, without the peer
# --------------------------------------------------------------------------------------------


def test_openvino_export_command_and_pipeline_settings():
    cmd = openvino_export_command(Path("/p/ov/bin/python"), Path("/m/smol"), "int8", Path("/c/smol-openvino-int8"))
    assert cmd == [
        "/p/ov/bin/optimum-cli",
        "export",
        "openvino",
        "--model",
        "/m/smol",
        "--task",
        "text-generation-with-past",
        "--weight-format",
        "int8",
        "/c/smol-openvino-int8",
    ]
    assert openvino_properties("bf16", 2) == {"INFERENCE_PRECISION_HINT": "bf16", "INFERENCE_NUM_THREADS": 2}
    assert openvino_properties("f32", None) == {"INFERENCE_PRECISION_HINT": "f32"}  # OpenVINO picks the threads
    assert openvino_scheduler_fields() == {"enable_prefix_caching": True, "cache_size": 1}


def test_openvino_peer_lookup_and_not_installed(tmp_path):
    missing = Peers(None, None, None, None)
    assert missing.python("openvino") is None and missing.python("ours") is None
    assert "OpenVINO GenAI not installed: run `make peers`" in not_installed("openvino_bf16", missing)
    assert "--openvino-python" in not_installed("openvino_bf16", missing)
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.touch()
    found = Peers.find(None, None, str(python))
    assert found.openvino_python == python and found.python("openvino") == python
    assert not_installed("openvino_int8", found) is None
    # no exporter and no cached IR: not installed; a cached IR is reused without the exporter
    path, note, converter_missing = prepare_peer_model("openvino_int8", Path("/m/smol"), tmp_path, missing)
    assert path is None and converter_missing and "optimum-cli (OpenVINO) not installed" in note
    cached = tmp_path / "smol-openvino-fp32"
    cached.mkdir()
    (cached / "openvino_model.xml").write_text("<net/>")
    path, note, converter_missing = prepare_peer_model("openvino_bf16", Path("/m/smol"), tmp_path, missing)
    assert path == str(cached) and not converter_missing and "(reused, 0 MiB)" in note
    with pytest.raises(ValueError, match="no peer model"):
        prepare_peer_model("engine_fp32", Path("/m/smol"), tmp_path, missing)


def test_run_converter_renames_a_finished_output_and_drops_a_failed_one(tmp_path):
    def writer(body: str):
        return lambda out: [sys.executable, "-c", body, str(out)]

    make_dir = (
        "import pathlib, sys; d = pathlib.Path(sys.argv[1]); d.mkdir(); (d / 'openvino_model.xml').write_text('x')"
    )
    out = tmp_path / "model-openvino-fp32"
    complete = lambda d: (d / "openvino_model.xml").is_file()  # noqa: E731
    assert run_converter("export", writer(make_dir), out, 60, complete=complete) == out
    assert (out / "openvino_model.xml").read_text() == "x" and not (tmp_path / "model-openvino-fp32.partial").exists()
    # a second call reuses it without running anything
    assert run_converter("export", writer("raise SystemExit(3)"), out, 60, complete=complete) == out

    failed = tmp_path / "model-openvino-int8"
    fail = "import pathlib, sys; pathlib.Path(sys.argv[1]).mkdir(); print('nncf: out of memory'); sys.exit(1)"
    with pytest.raises(PeerError, match=r"export exit 1: nncf: out of memory"):
        run_converter("export", writer(fail), failed, 60, complete=complete)
    assert not failed.exists() and not (tmp_path / "model-openvino-int8.partial").exists()
    incomplete = "import pathlib, sys; pathlib.Path(sys.argv[1]).mkdir()"  # exit 0, but no IR written
    with pytest.raises(PeerError, match="export exit 0"):
        run_converter("export", writer(incomplete), failed, 60, complete=complete)
    assert not failed.exists()


class FakeHandle:
    """A ``GenerationHandle``: the tokens of each step not read yet, then its final status."""

    def __init__(self, steps: list[list[int]], status: str = "FINISHED") -> None:
        self.steps, self.status, self.pending, self.done = steps, status, [], 0

    def can_read(self) -> bool:
        return bool(self.pending)

    def read(self) -> dict:
        out = self.pending.pop(0)
        return {0: SimpleNamespace(generated_ids=out)}

    def get_status(self):
        return SimpleNamespace(name=self.status if self.done >= len(self.steps) else "RUNNING")


class FakePipeline:
    """A ``ContinuousBatchingPipeline`` whose requests yield scripted tokens step by step."""

    def __init__(self, scripts: dict[int, tuple[list[list[int]], str]]) -> None:
        self.scripts, self.handles, self.added = scripts, [], []

    def add_request(self, request_id, tensor, config):
        self.added.append((request_id, tensor, config.max_new_tokens))
        steps, status = self.scripts[len(self.handles)]
        self.handles.append(FakeHandle(steps, status))
        return self.handles[-1]

    def has_non_finished_requests(self) -> bool:
        return any(h.done < len(h.steps) for h in self.handles)

    def step(self) -> None:
        time.sleep(0.001)
        for h in self.handles:
            if h.done < len(h.steps):
                if h.steps[h.done]:
                    h.pending.append(h.steps[h.done])
                h.done += 1


def test_openvino_generate_collects_tokens_and_first_token_times():
    # request 0 yields a token each step; request 1 waits two steps (prefill split across steps), then two at once
    pipe = FakePipeline({0: ([[5], [6], [7]], "FINISHED"), 1: ([[], [], [8, 9], [10]], "FINISHED")})
    config = SimpleNamespace(max_new_tokens=3)
    elapsed, ttft, tokens = _openvino_generate(pipe, [[1, 2], [3]], config, lambda p: ("tensor", p), 10)
    assert tokens == [[5, 6, 7], [8, 9, 10]]
    assert [a[0] for a in pipe.added] == [10, 11] and pipe.added[1][1] == ("tensor", [3])
    assert 0 < ttft[0] < ttft[1] <= elapsed

    ignored = FakePipeline({0: ([[5], [6], [7]], "FINISHED"), 1: ([[]], "IGNORED")})
    with pytest.raises(RuntimeError, match="ended 1 of 2 requests IGNORED"):
        _openvino_generate(ignored, [[1], [2]], config, list, 0)
    short = FakePipeline({0: ([[5], [6]], "FINISHED")})
    with pytest.raises(RuntimeError, match="returned 2 tokens, not 3"):
        _openvino_generate(short, [[1]], config, list, 0)


def test_openvino_run_without_the_peer_reports_not_installed(tmp_path):
    """The runner's real process, under an interpreter without openvino_genai (ours)."""
    pytest.importorskip("torch")
    try:
        import openvino_genai  # noqa: F401

        pytest.skip("this interpreter has openvino_genai; the not-installed path needs one without it")
    except ImportError:
        pass
    workload = tmp_path / "workload.json"
    workload.write_text(json.dumps({"prompts": [[1, 2, 3]], "max_tokens": 2}))
    spec = RunSpec(config="openvino_fp32", model=str(tmp_path), workload_path=str(workload), openvino_model="x")
    result = run_config(spec, tmp_path, 120, python=Path(sys.executable))
    assert result["status"] == "not installed", result
    assert "openvino_genai is not importable" in result["reason"] and "make peers" in result["reason"]


# --------------------------------------------------------------------------------------------
# Figures: agreement with our fp32 engine, ratios to OpenVINO, the contention column
# --------------------------------------------------------------------------------------------


def test_greedy_agreement_counts_identical_outputs_and_first_differences():
    ours = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9], [1, 1]]
    theirs = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9], [1, 1]]
    assert greedy_agreement(theirs, ours) == (2, 4, 1.0)  # first differences at tokens 2 and 0
    assert greedy_agreement(ours, ours) == (4, 4, None)
    assert greedy_agreement([[1, 2]], [[1, 2, 3]]) == (0, 1, 2.0)  # a shorter output differs where it ends
    assert greedy_agreement(None, ours) is None and greedy_agreement(ours, []) is None


def test_summary_against_openvino_and_engine_fp32():
    def ok(name, seconds, tokens, single_s=None):
        return {
            "config": name,
            "status": "ok",
            "output_tokens": 100,
            "elapsed_s": seconds,
            "ttft_s": [0.1],
            "token_ids": tokens,
            "contention": 1,
            "single": None if single_s is None else {"elapsed_s": single_s, "ttft_s": 0.1, "token_ids": [1, 2, 3, 4]},
        }

    fp32 = [[1, 2, 3], [4, 5, 6]]
    results = [
        ok("vllm_bf16", 1.0, [[1, 2, 0], [4, 5, 6]]),
        ok("openvino_fp32", 1.0, fp32, single_s=1.0),
        ok("openvino_bf16", 0.5, [[1, 0, 0], [4, 5, 6]], single_s=0.5),
        ok("openvino_int8", 0.8, [[0, 2, 3], [4, 5, 6]], single_s=0.4),
        ok("engine_fp32", 0.8, fp32, single_s=0.8),
        ok("engine_bf16", 0.4, [[1, 2, 3], [4, 0, 6]], single_s=0.4),
        ok("engine_int8", 0.25, [[1, 2, 3], [4, 5, 6]], single_s=0.25),
    ]
    rows = {r.config: r for r in summarize(results, {"fp32": 200.0, "bf16": 400.0, "int8": 800.0})}
    assert rows["engine_fp32"].speedup["openvino_same_dtype"] == 1.25
    assert rows["engine_bf16"].speedup["openvino_same_dtype"] == 1.25
    assert rows["engine_int8"].speedup["openvino_same_dtype"] == pytest.approx(3.2)
    assert rows["openvino_bf16"].identical_to_engine_fp32 == 1 and rows["openvino_bf16"].first_diff_vs_engine_fp32 == 1
    assert rows["engine_bf16"].first_diff_vs_engine_fp32 == 1 and rows["vllm_bf16"].first_diff_vs_engine_fp32 == 2
    assert rows["openvino_fp32"].identical_to_engine_fp32 == 2 and rows["openvino_fp32"].agreement_checked == 2
    assert all(r.contention == 1 for r in rows.values())

    table = format_table(list(rows.values()))
    assert "busy procs" in table.splitlines()[0] and "x openvino_same_dtype" in table.splitlines()[0]
    agreement = format_agreement_table(list(rows.values()))
    cells = [line.split() for line in agreement.splitlines()[1:]]
    assert ["openvino_bf16", "bf16", "1/2", "1.0"] in cells and ["openvino_fp32", "fp32", "2/2", "-"] in cells
    assert "engine_fp32" not in [c[0] for c in cells]

    singles = {s.config: s for s in summarize_single(results)}
    assert singles["engine_bf16_single"].speedup_openvino == 1.25
    assert "x OpenVINO same dtype" in format_single_table(list(singles.values()))

    targets = {w: (v, t) for w, v, t in engine_targets(list(rows.values()), list(singles.values()))}
    assert targets["engine_fp32 / openvino_fp32 tok/s"] == (1.25, ">= 1.15")
    assert targets["engine_bf16_single / openvino_bf16_single tok/s"] == (1.25, ">= 1.15")
    # ours INT8 against the faster of OpenVINO's INT8 and bf16 rows: bf16 on the workload, INT8 alone
    assert targets["engine_int8 / openvino_bf16 (faster OpenVINO INT8 or bf16) tok/s"] == (2.0, ">= 1.15")
    assert targets["engine_int8_single / openvino_int8_single (faster OpenVINO INT8 or bf16) tok/s"] == (
        1.6,
        ">= 1.15",
    )
    # both bf16 rows keep 1 of 2 requests identical to engine_fp32
    assert targets["engine_bf16 - vllm_bf16 greedy outputs identical to engine_fp32's (requests)"] == (0.0, ">= 0")


# --------------------------------------------------------------------------------------------
# Busy processes
# --------------------------------------------------------------------------------------------


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_busy_processes_spin_on_their_cores_and_are_killed_at_the_end():
    cores = sorted(os.sched_getaffinity(0))
    assert busy_cores(0) == [] and busy_cores(1) == [cores[-1]]
    assert busy_cores(len(cores) + 1)[-1] == cores[-1]  # wraps around
    with BusyProcesses(1, limit_s=120) as busy:
        (proc,) = busy.procs
        assert proc.poll() is None and os.sched_getaffinity(proc.pid) == {cores[-1]}
        spinning = psutil.Process(proc.pid)
        spinning.cpu_percent()
        time.sleep(0.5)
        assert spinning.status() in (psutil.STATUS_RUNNING, psutil.STATUS_SLEEPING)
        assert spinning.cpu_times().user > 0
        pid = proc.pid
    assert busy.procs == [] and _gone(pid)
    with BusyProcesses(0, limit_s=1) as none:
        assert none.procs == []
    with pytest.raises(ValueError, match="count -1"):
        BusyProcesses(-1, limit_s=1)


def test_busy_processes_are_killed_when_the_block_raises_and_end_by_themselves():
    pids = []
    with pytest.raises(RuntimeError, match="row failed"):
        with BusyProcesses(2, limit_s=120) as busy:
            pids = [p.pid for p in busy.procs]
            assert len(pids) == 2 and not any(_gone(p) for p in pids)
            raise RuntimeError("row failed")
    assert _wait_gone(pids, 5.0)
    # bounded in time: nobody kills this one, it stops spinning by itself
    busy = BusyProcesses(1, limit_s=0.5).__enter__()
    try:
        assert busy.procs[0].wait(timeout=30) == 0
    finally:
        busy.__exit__(None, None, None)


def test_busy_processes_die_with_the_benchmark_process():
    code = (
        "import time\nfrom bench.peer_runs import BusyProcesses\n"
        "busy = BusyProcesses(1, limit_s=600).__enter__()\n"
        "print(busy.procs[0].pid, flush=True)\ntime.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    bench = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        pid = int(bench.stdout.readline())
        assert not _gone(pid)
    finally:
        bench.send_signal(signal.SIGKILL)
        bench.wait(timeout=10)
    assert _wait_gone([pid])


def _busy_children(timeout_s: float = 5.0) -> list[int]:
    """The pids of this process's running busy-loop children.

    A child that ``Popen`` has just started can read an empty ``/proc/<pid>/cmdline`` for a moment on
    a loaded machine (seen once in CI), so this waits until no running child reads empty, within
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = {}
        for child in psutil.Process().children():
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    lines[child.pid] = child.cmdline()
            except psutil.NoSuchProcess:
                pass
        if all(lines.values()) or time.monotonic() > deadline:
            return [pid for pid, line in lines.items() if "-c" in line and "sys.argv[1]" in " ".join(line)]
        time.sleep(0.02)


def test_every_row_runs_beside_busy_processes_and_a_failing_row_leaves_none(monkeypatch, tmp_path):
    seen: list[list[int]] = []

    def fake_run_one(config, *args, **kwargs):
        seen.append(_busy_children())
        if config == "engine_bf16":
            raise RuntimeError("the row's process could not start")
        return {"config": config, "status": "failed", "reason": "stand-in"}

    monkeypatch.setattr(engine_bench, "_run_one", fake_run_one)
    args = SimpleNamespace(
        gguf_dir=None, single_max_tokens=4, rounds=1, contention=1, timeout_s=60.0, int8=None, threads=None
    )
    workload = SimpleNamespace(prompts=[[1, 2]], max_tokens=2)
    inputs = SimpleNamespace(
        configs=["engine_fp32", "engine_bf16"], model_dir=tmp_path, workload=workload, single=None, engine_args={}
    )
    with pytest.raises(RuntimeError, match="could not start"):
        engine_bench._run_systems(args, inputs, Peers(None, None, None, None))
    assert [len(s) for s in seen] == [1, 1] and seen[0] != seen[1]  # fresh ones for each row
    assert _wait_gone(seen[0] + seen[1], 5.0)

    seen.clear()
    args.contention, inputs.configs = 2, ["engine_fp32"]
    rounds, _, _ = engine_bench._run_systems(args, inputs, Peers(None, None, None, None))
    assert len(seen[0]) == 2 and rounds[0][0]["contention"] == 2 and _wait_gone(seen[0], 5.0)


# --------------------------------------------------------------------------------------------
# The real peer
# --------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.skipif(Peers.find().openvino_python is None, reason="OpenVINO GenAI not installed: `make peers-openvino`")
def test_real_openvino_rows_beside_our_engine(tiny_llama_dir, tmp_path, lmforge):
    out = tmp_path / "bench.json"
    configs = "hf_sequential,engine_fp32,openvino_fp32,openvino_int8"
    proc = lmforge(
        "bench",
        "engine",
        *("--model", tiny_llama_dir, "--smoke", "--configs", configs, "--threads", 1, "--contention", 1),
        *("--peer-model-dir", tmp_path / "models", "--out", out),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["config"]: r for r in report["rows"]}
    for name in ("openvino_fp32", "openvino_int8"):
        row = rows[name]
        assert row["status"] == "ok", row["reason"]
        assert row["output_tok_s"] > 0 and row["ttft_p50_ms"] > 0 and row["contention"] == 1
        assert row["agreement_checked"] == 4
    # fp32 OpenVINO against fp32 HF generate and our fp32 engine: the same greedy tokens
    assert rows["openvino_fp32"]["same_tokens_as_hf"] == 1.0
    assert rows["openvino_fp32"]["identical_to_engine_fp32"] == 4
    assert (tmp_path / "models" / f"{tiny_llama_dir.name}-openvino-fp32" / "openvino_model.xml").is_file()
    singles = {r["config"]: r for r in report["single_rows"]}
    assert singles["openvino_fp32_single"]["same_tokens_as_hf"] is True
    assert report["contention"]["busy_processes"] == 1
    assert "busy procs" in proc.stdout and "greedy tokens against engine_fp32" in proc.stdout
