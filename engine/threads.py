"""The CPU engine's thread count follows the cores that other processes leave free.

Each step's kernels split their work evenly over the OpenMP threads and meet at a barrier, so one thread
on a core another process also wants holds every step back to that core's share of time: with 2 threads on
2 cores and one other process spinning, a step runs at a fraction of its single-thread speed. A served engine
always shares its cores (Triton, the HTTP frontend, the tokenizer, often the load client), so the thread
count is a property of the moment, not of the machine.

``ThreadGovernor.maybe_adjust`` (called at each engine step; it acts at most every ``interval_s``) reads the
machine's busy time from ``/proc/stat`` and this process's own CPU time, takes the difference as the cores
other processes used since the last look, and sets ``torch.set_num_threads`` to the cores left free
(at least 1, at most the configured maximum).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

#: Seconds between two looks at the machine's load.
DEFAULT_INTERVAL_S = 0.5
#: Other processes' use (in cores) from which a core counts as taken: a core half-used by another
#: process already stalls the barrier of a thread placed on it.
BUSY_CORE_FRACTION = 0.5
#: Consecutive looks that must agree on a new thread count before it is applied, and the least time
#: between two changes: a change makes oneDNN build its kernels again for the new thread count, so a
#: flickering load must not flip it back and forth.
AGREEING_LOOKS = 2
MIN_DWELL_S = 2.0


def machine_busy_s(stat: str = "/proc/stat", count_niced: bool | None = None) -> float | None:
    """Seconds of CPU time all processes have used (every core summed), or ``None`` where unreadable.

    From the first ``cpu`` line of ``/proc/stat``: user, system, irq, softirq and steal ticks, and nice
    ticks when ``count_niced`` (default: when this process itself runs at a nice value above 0). Niced
    work yields its core to a normal-priority process (the kernel weighs nice 19 at about 1.5% of nice 0),
    so a core busy with it is still free for our threads; a niced engine competes with it and counts it.
    """
    if count_niced is None:
        count_niced = os.getpriority(os.PRIO_PROCESS, 0) > 0
    try:
        with open(stat, encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + (nice if count_niced else 0) + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """Seconds of CPU time this process has used (all its threads)."""
    t = os.times()
    return t.user + t.system


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class ThreadGovernor:
    """Sets the torch thread count to the cores other processes leave free.

    Args:
        max_threads: the most threads to use (``EngineConfig.num_threads`` or torch's default).
        cores: the cores this process may use (default: its affinity mask).
        interval_s: seconds between two looks.
        busy: machine-wide busy CPU seconds (``machine_busy_s``); tests pass their own.
        own: this process's CPU seconds (``own_cpu_s``).
        clock: wall seconds (``time.monotonic``).
        set_threads: applies a thread count (``torch.set_num_threads``).
    """

    def __init__(
        self,
        max_threads: int,
        cores: int | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        busy: Callable[[], float | None] = machine_busy_s,
        own: Callable[[], float] = own_cpu_s,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        self.max_threads = max(1, max_threads)
        self.cores = cores or usable_cores()
        self.interval_s = interval_s
        self._busy, self._own, self._clock, self._set = busy, own, clock, set_threads
        self.threads = self.max_threads
        self.others_cores = 0.0  # other processes' use at the last look, in cores
        self.num_changes = 0
        self._last = self._sample()
        self._last_change = self._last[0]
        self._proposal, self._agreeing = self.threads, 0

    def _sample(self) -> tuple[float, float | None, float]:
        return self._clock(), self._busy(), self._own()

    def maybe_adjust(self) -> int:
        """Look again if ``interval_s`` has passed; returns the thread count in force."""
        now = self._clock()
        if now - self._last[0] < self.interval_s:
            return self.threads
        sample = self._sample()
        (t0, busy0, own0), (t1, busy1, own1) = self._last, sample
        self._last = sample
        if busy0 is None or busy1 is None or t1 <= t0:
            return self.threads
        self.others_cores = max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)
        taken = int(self.others_cores + (1 - BUSY_CORE_FRACTION) + 1e-6)  # a core counts from BUSY_CORE_FRACTION
        threads = max(1, min(self.max_threads, self.cores - taken))
        self._agreeing = self._agreeing + 1 if threads == self._proposal else 1
        self._proposal = threads
        if threads != self.threads and self._agreeing >= AGREEING_LOOKS and t1 - self._last_change >= MIN_DWELL_S:
            self._set(threads)
            self.threads = threads
            self.num_changes += 1
            self._last_change = t1
        return self.threads


def proc_stat_readable() -> bool:
    """Whether ``/proc/stat`` can be read (Linux): the governor needs it."""
    return Path("/proc/stat").is_file() and machine_busy_s() is not None
