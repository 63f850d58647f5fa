"""The builder of the C++ CPU kernels: cached builds that a killed build left broken are repaired, not fatal."""

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import native


def _a_real_library() -> Path:
    return next(Path(torch.__file__).parent.joinpath("lib").glob("libc10.so*"))


def test_truncated_library_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = "lmforge_test_abc"
    build_dir = tmp_path / name
    build_dir.mkdir()
    library = build_dir / f"{name}.so"
    shutil.copy(_a_real_library(), library)
    assert native._is_whole_elf(library)
    native._repair_build_dir(name)
    assert library.exists()  # a whole library stays
    with library.open("r+b") as f:
        f.truncate(1000)
    native._repair_build_dir(name)
    assert not library.exists()


#: Takes the build guard of ``argv[2]`` (extensions in ``argv[1]``), leaves torch's lock as a build does, says so
#: and waits to be killed.
_BUILDER = """
import os, sys, time
os.environ["TORCH_EXTENSIONS_DIR"] = sys.argv[1]
from engine import native
with native.build_guard(sys.argv[2]) as build_dir:
    (build_dir / "lock").write_text("")
    print("building", flush=True)
    time.sleep(600)
"""


def test_a_build_killed_midway_does_not_block_the_next(tmp_path, monkeypatch):
    """torch waits on its ``lock`` for as long as the file exists: the lock a killed build left must go."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = "lmforge_test_killed"
    builder = subprocess.Popen(
        [sys.executable, "-c", _BUILDER, str(tmp_path), name],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(native.__file__).parent.parent)},
    )
    try:
        assert builder.stdout.readline() == "building\n"
        with open(tmp_path / name / native.BUILD_LOCK_NAME) as guard:  # a live builder holds the guard
            with pytest.raises(BlockingIOError):
                fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        builder.kill()
        builder.wait(timeout=60)
    assert (tmp_path / name / "lock").exists()
    with native.build_guard(name) as build_dir:  # the dead builder's guard is free at once, its lock removed
        assert not (build_dir / "lock").exists()


def test_random_bytes_are_not_a_library(tmp_path):
    junk = tmp_path / "x.so"
    junk.write_bytes(os.urandom(200))
    assert not native._is_whole_elf(junk)


def test_the_reason_names_the_cause_not_the_last_line():
    text = "[1/2] c++ -O3 ...\n/bin/sh: 1: /nonexistent: not found\nninja: build stopped: subcommand failed."
    assert native._first_cause(text) == "/bin/sh: 1: /nonexistent: not found"
    assert native._first_cause("only line") == "only line"
    assert native._first_cause("") == ""


def test_kernels_needing_a_missing_cpu_flag_are_not_built(tmp_path):
    source = tmp_path / "never_built.cpp"
    source.write_text("#error this source must not be compiled\n")
    kernels = native.NativeKernels("lmforge_never_built", source, "op", requires=("no_such_cpu_flag",))
    assert not kernels.enable() and not kernels.available
    assert kernels.reason == "this CPU lacks no_such_cpu_flag"


def test_a_built_library_is_loaded_without_the_build_tools(tmp_path, monkeypatch):
    """A build's library is keyed by its inputs: found whole, it is loaded as is (running ninja again redid whole
    builds when another ninja had made them)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    source = tmp_path / "kernels.cpp"
    source.write_text("// operators\n")
    kernels = native.NativeKernels("lmforge_test_cached", source, "op")
    name = kernels.build_name()
    (tmp_path / name).mkdir()
    library = tmp_path / name / f"{name}.so"
    shutil.copy(_a_real_library(), library)
    loaded = []
    monkeypatch.setattr(native, "load", lambda **kwargs: pytest.fail(f"ran the build tools: {kwargs}"))
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    assert kernels.enable() is True
    assert loaded == [str(library)]
