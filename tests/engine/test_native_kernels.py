"""The builder of the C++ CPU kernels: cached builds that a killed build left broken are repaired, not fatal."""

import os
import shutil
import time
from pathlib import Path

import torch

from engine import native


def _a_real_library() -> Path:
    return next(Path(torch.__file__).parent.joinpath("lib").glob("libc10.so*"))


def test_truncated_library_and_stale_lock_are_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = "lmforge_test_abc"
    build_dir = tmp_path / name
    build_dir.mkdir()
    library = build_dir / f"{name}.so"
    shutil.copy(_a_real_library(), library)
    assert native._is_whole_elf(library)
    lock = build_dir / "lock"
    lock.write_text("")
    native._repair_build_dir(name)
    assert library.exists() and lock.exists()  # a whole library and a fresh lock (a build running now) stay
    with library.open("r+b") as f:
        f.truncate(1000)
    old = time.time() - native.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    native._repair_build_dir(name)
    assert not library.exists() and not lock.exists()


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
