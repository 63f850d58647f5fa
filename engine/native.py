"""lmforge's C++ CPU kernels: built on first use with the machine's compiler, cached, optional.

Two sources register torch operators: ``engine/csrc/w8a8_cpu.cpp`` (``torch.ops.lmforge_int8``,
the fused W8A8 linear) and ``engine/csrc/cpu_ops.cpp`` (``torch.ops.lmforge_engine``: RMSNorm, argmax, paged
decode attention). ``torch.utils.cpp_extension.load`` compiles one with ``-O3 -march=native`` (15-25 s once)
into ``~/.cache/torch_extensions``, one build per source path and content (with the headers beside it), torch
include paths, flags and CPU flag set, so a build made for another checkout, environment or CPU is never reused or
rebuilt over; a process finding the library of its key built loads it without running the build tools. Every
caller keeps a pure-torch path: without a compiler, or when a build fails, ``NativeKernels.available`` is False,
the reason is logged once and kept in ``NativeKernels.reason``.

A build runs holding an exclusive ``flock`` on ``BUILD_LOCK_NAME`` in its build directory (``build_guard``),
which the kernel releases when its holder dies. Holding it, a torch build lock (``lock``, which torch's loader
waits on for as long as it exists) can only be one left by a build that was killed (a ``kill -9`` of a model
server's process during its first request): it is removed, and the build runs again instead of every later
process waiting on it forever. A cached library that is not a whole ELF file (a build killed while linking, a
full disk) is removed so it is linked again (loading it would end the process with a bus error); both are
logged with their paths. ninja, which ``torch.utils.cpp_extension`` drives, comes from the ``ninja``
package where the system has none.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import struct
import threading
from pathlib import Path

import torch
from torch.utils.cpp_extension import _get_build_directory, include_paths, load

from engine.platform import cpu_flags

logger = logging.getLogger(__name__)

#: The C++ sources of every kernel (one folder, one shared header).
CSRC = Path(__file__).with_name("csrc")

#: The file whose ``flock`` a build holds (``build_guard``), next to torch's own ``lock`` in the build directory.
BUILD_LOCK_NAME = "lmforge-build.flock"


class NativeKernels:
    """One C++ source of torch operators in namespace ``namespace``, loaded at most once per process.

    Args:
        namespace: the ``TORCH_LIBRARY`` namespace the source registers (``torch.ops.<namespace>``).
        source: the ``.cpp`` file.
        probe: one operator name of it (already registered in this process means loaded).
        cflags: compiler flags (``-march=native`` ties the build to this CPU's flag set).
        requires: ``/proc/cpuinfo`` flags without which the source is not built (e.g. ``amx_int8`` for
            kernels compiled with ``-mamx-int8``); the torch path runs and ``reason`` names the missing flags.
    """

    def __init__(
        self,
        namespace: str,
        source: Path,
        probe: str,
        cflags: tuple[str, ...] = ("-O3", "-march=native"),
        requires: tuple[str, ...] = (),
    ):
        self.namespace, self.source, self.probe, self.cflags = namespace, Path(source), probe, tuple(cflags)
        self.requires = tuple(requires)
        self.state: bool | None = None  # None: not tried yet
        self.reason = ""
        self.forbidden = False  # held off by forbid(): enable(True) does not bring it back
        self._lock = threading.Lock()

    def forbid(self, why: str) -> None:
        """Hold the torch path for the rest of the process (a forced kernel path); ``allow`` lifts it."""
        with self._lock:
            self.forbidden, self.state, self.reason = True, False, f"forbidden: {why}"

    def allow(self) -> None:
        """Lift ``forbid``; the operators load again on next use."""
        with self._lock:
            if self.forbidden:
                self.forbidden, self.state, self.reason = False, None, ""

    def enable(self, enable: bool | None = None) -> bool:
        """Load on first call; ``False`` forces the torch path (comparisons), ``True`` re-enables it
        (unless ``forbid`` holds it off).

        Returns:
            True when the operators are loaded and enabled.
        """
        with self._lock:
            if self.forbidden:
                return False
            if enable is False:
                self.state, self.reason = False, "disabled by enable(False)"
                return False
            if enable is True and self.reason.startswith("disabled"):
                self.state = None
            if self.state is None:
                self.state = self._load()
            return self.state

    @property
    def available(self) -> bool:
        """Whether the operators run (loads them on first use)."""
        return self.enable() if self.state is None else self.state

    @property
    def ops(self):
        """``torch.ops.<namespace>``."""
        return getattr(torch.ops, self.namespace)

    def build_name(self) -> str:
        """The name of this source's build (and of its directory): its namespace and a hash of the source, the
        headers beside it, torch's version and include paths, the flags and this CPU's flags."""
        key = "\n".join(
            [
                str(self.source),
                self.source.read_text(),
                *(h.read_text() for h in sorted(self.source.parent.glob("*.h"))),  # headers it may include
                torch.__version__,
                *include_paths(),
                *self.cflags,
                "-fopenmp",
                *sorted(cpu_flags()),
            ]
        )
        return f"lmforge_{self.namespace}_{hashlib.sha1(key.encode()).hexdigest()[:12]}"

    def _load(self) -> bool:
        if hasattr(torch.ops, self.namespace) and hasattr(self.ops, self.probe):
            return True  # already loaded in this process
        missing = [flag for flag in self.requires if flag not in cpu_flags()]
        if missing:
            self.reason = f"this CPU lacks {', '.join(missing)}"
            logger.info("%s: not built (%s); running the torch ops", self.namespace, self.reason)
            return False
        try:
            name = self.build_name()
            with build_guard(name) as build_dir:
                library = build_dir / f"{name}.so"
                if library.exists():  # whole (``build_guard`` removed a truncated one) and built for this very key
                    torch.ops.load_library(str(library))
                    return True
                with _ninja_on_path():
                    load(
                        name=name,
                        sources=[str(self.source)],
                        # -fopenmp: at::parallel_for is an OpenMP region only when _OPENMP is defined; without it
                        # every kernel would run on the calling thread alone
                        extra_cflags=[*self.cflags, "-fopenmp"],
                        extra_ldflags=["-fopenmp"],
                        is_python_module=False,
                        verbose=False,
                    )
            return True
        except Exception as exc:  # no compiler, a failed build or link: every cause means the torch path
            self.reason = f"{type(exc).__name__}: {_first_cause(str(exc))}"
            logger.warning("%s: C++ CPU kernels unavailable (%s); running the torch ops", self.namespace, self.reason)
            return False


def _first_cause(text: str) -> str:
    """The line of a build failure that names its cause (a compiler error, a missing program), else the last."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    for marker in ("error:", "not found", "No such file", "command not found", "Permission denied"):
        for line in lines:
            if marker in line:
                return line
    return lines[-1] if lines else ""


@contextlib.contextmanager
def build_guard(name: str):
    """Hold the build directory of ``name`` alone (an exclusive ``flock``: another process building it is waited
    for, one that died is not), and repair what a killed build left there (``_repair_build_dir``)."""
    build_dir = Path(_get_build_directory(name, verbose=False))
    with open(build_dir / BUILD_LOCK_NAME, "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released by the kernel when this process ends, however it ends
        try:
            _repair_build_dir(name)
            yield build_dir
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def _repair_build_dir(name: str) -> None:
    """Remove a truncated library and a dead build's torch lock from this build's directory (``build_guard`` held:
    no live process is building it)."""
    build_dir = Path(_get_build_directory(name, verbose=False))
    lock = build_dir / "lock"
    with contextlib.suppress(OSError):
        if lock.exists():
            logger.warning("%s: removing the build lock of a build that was killed", lock)
            lock.unlink()
    library = build_dir / f"{name}.so"
    with contextlib.suppress(OSError):
        if library.exists() and not _is_whole_elf(library):
            logger.warning("%s: not a complete shared library (an interrupted build?); linking it again", library)
            library.unlink()


def _is_whole_elf(path: Path) -> bool:
    """Whether ``path`` starts with a 64-bit ELF header and is long enough to hold its section headers."""
    with path.open("rb") as f:
        header = f.read(64)
    if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2:
        return False
    (section_offset,) = struct.unpack_from("<Q", header, 0x28)
    entry_size, count = struct.unpack_from("<HH", header, 0x3A)
    return path.stat().st_size >= section_offset + entry_size * count


@contextlib.contextmanager
def _ninja_on_path():
    """First on ``PATH`` for the build: the ``ninja`` package's binary (pinned), else the system's.

    Always the same one, whatever the caller's ``PATH``: ninja 1.11 and 1.13 keep incompatible build logs, so a
    build made by one was compiled again from scratch by the other (a model server's stub, with the environment's
    ``bin`` first on its ``PATH``, rebuilt in its first request what a shell without it had built)."""
    try:
        import ninja  # the pip package: its BIN_DIR holds the binary
    except ImportError:
        yield
        return
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + old
    try:
        yield
    finally:
        os.environ["PATH"] = old
