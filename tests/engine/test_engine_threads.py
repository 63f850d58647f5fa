"""The thread governor: the engine's thread count follows the cores other processes leave free."""

import os

import pytest

from engine.threads import ThreadGovernor, machine_busy_s


class FakeMachine:
    """Wall clock, machine-wide busy CPU seconds and this process's CPU seconds, advanced by hand."""

    def __init__(self) -> None:
        self.now, self.busy, self.own = 0.0, 0.0, 0.0
        self.applied: list[int] = []

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + other_cores) * seconds

    def governor(self, max_threads: int = 2, cores: int = 2) -> ThreadGovernor:
        return ThreadGovernor(
            max_threads,
            cores=cores,
            interval_s=0.5,
            busy=lambda: self.busy,
            own=lambda: self.own,
            clock=lambda: self.now,
            set_threads=self.applied.append,
        )


def test_a_busy_core_drops_a_thread_and_a_freed_core_brings_it_back():
    m = FakeMachine()
    gov = m.governor()
    m.run(0.6, own_cores=2.0, other_cores=0.0)
    assert gov.maybe_adjust() == 2 and m.applied == []  # quiet: all cores
    m.run(0.6, own_cores=1.0, other_cores=1.0)  # another process spins on a core
    assert gov.maybe_adjust() == 2 and gov.others_cores == pytest.approx(1.0)  # one look is not enough
    m.run(1.5, own_cores=1.0, other_cores=1.0)
    assert gov.maybe_adjust() == 1 and m.applied == [1]
    m.run(0.6, own_cores=1.0, other_cores=0.9)
    assert gov.maybe_adjust() == 1  # still taken
    m.run(0.6, own_cores=1.0, other_cores=0.1)  # it stopped
    m.run(0.0, own_cores=0.0, other_cores=0.0)
    assert gov.maybe_adjust() == 1  # one look
    m.run(0.6, own_cores=1.0, other_cores=0.1)
    assert gov.maybe_adjust() == 1  # two looks agree, but within MIN_DWELL_S of the last change
    m.run(1.0, own_cores=1.0, other_cores=0.1)
    assert gov.maybe_adjust() == 2 and m.applied == [1, 2]
    assert gov.num_changes == 2


def test_a_flickering_load_does_not_flip_the_thread_count():
    m = FakeMachine()
    gov = m.governor()
    for i in range(20):
        m.run(0.6, own_cores=1.5, other_cores=1.0 if i % 2 else 0.0)
        gov.maybe_adjust()
    assert m.applied == []


def test_a_half_used_core_counts_as_taken_and_a_light_load_does_not():
    m = FakeMachine()
    gov = m.governor()
    for _ in range(3):
        m.run(1.0, own_cores=1.5, other_cores=0.3)
        assert gov.maybe_adjust() == 2
    for _ in range(2):
        m.run(1.5, own_cores=1.5, other_cores=0.5)
        gov.maybe_adjust()
    assert gov.threads == 1


def test_it_looks_at_most_every_interval_and_never_goes_below_one_or_above_the_maximum():
    m = FakeMachine()
    gov = m.governor(max_threads=2, cores=4)
    m.run(0.2, own_cores=0.0, other_cores=4.0)
    assert gov.maybe_adjust() == 2 and m.applied == []  # too soon to look
    for _ in range(4):
        m.run(0.6, own_cores=0.0, other_cores=4.0)
        gov.maybe_adjust()
    assert gov.threads == 1  # every core taken: one thread still
    for _ in range(4):
        m.run(1.0, own_cores=1.0, other_cores=0.0)
        gov.maybe_adjust()
    assert gov.threads == 2  # 4 cores free, but at most max_threads


def test_the_machine_busy_time_is_read_from_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 1000 5 0 0 10 0 0\ncpu0 1 2 3 4 5 6 7 8\n")
    assert machine_busy_s(str(stat)) == pytest.approx(160 / os.sysconf("SC_CLK_TCK"))
    stat.write_text("cpu  100 40 50 1000 5 0 0 10 0 0\n")  # 40 ticks of niced work
    tick_s = 1 / os.sysconf("SC_CLK_TCK")
    assert machine_busy_s(str(stat), count_niced=False) == pytest.approx(160 * tick_s)  # it yields to us
    assert machine_busy_s(str(stat), count_niced=True) == pytest.approx(200 * tick_s)  # we are niced too
    assert machine_busy_s(str(tmp_path / "missing")) is None
    stat.write_text("intr 1 2 3\n")
    assert machine_busy_s(str(stat)) is None
