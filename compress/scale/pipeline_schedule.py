"""The 1F1B pipeline schedule: closed-form bubble and an event simulation that checks it.

With ``p`` stages and ``m`` micro-batches, each stage idles for ``(p - 1)`` forward+backward slots
of a step that lasts ``m + p - 1`` of them, so the bubble fraction is ``(p - 1) / (m + p - 1)``
(GPipe, Huang et al. 2019; the same for 1F1B / PipeDream-Flush, Narayanan et al. 2021, Sec. 2.2,
whose gain is memory: stage ``i`` holds at most ``p - i`` micro-batches instead of ``m``).
"""

from __future__ import annotations

from dataclasses import dataclass


def bubble_fraction(pipeline_parallel: int, micro_batches: int) -> float:
    """Fraction of a step each stage idles in a 1F1B (or GPipe) schedule: ``(p - 1) / (m + p - 1)``.

    Raises:
        ValueError: ``pipeline_parallel`` or ``micro_batches`` below 1.
    """
    if pipeline_parallel < 1 or micro_batches < 1:
        raise ValueError(f"pipeline_parallel={pipeline_parallel}, micro_batches={micro_batches}: both must be >= 1")
    return (pipeline_parallel - 1) / (micro_batches + pipeline_parallel - 1)


def one_f_one_b_order(stage: int, pipeline_parallel: int, micro_batches: int) -> list[tuple[str, int]]:
    """Operations of one stage in 1F1B order: warm-up forwards, alternating F/B, cool-down backwards.

    Returns:
        ``[("F" | "B", micro_batch_index), ...]``, ``2 * micro_batches`` entries.
    """
    warmup = min(pipeline_parallel - stage - 1, micro_batches)
    order = [("F", j) for j in range(warmup)]
    next_f, next_b = warmup, 0
    while next_b < micro_batches:
        if next_f < micro_batches:
            order.append(("F", next_f))
            next_f += 1
        order.append(("B", next_b))
        next_b += 1
    return order


@dataclass(frozen=True)
class ScheduleResult:
    """Outcome of a simulated pipeline step."""

    step_time: float  # time units from the first forward to the last backward
    busy_time: float  # time each stage computes: m * (forward + backward)
    bubble_fraction: float  # 1 - busy / step
    max_in_flight: list[int]  # per stage: most micro-batches between their forward and backward


def simulate_1f1b(
    pipeline_parallel: int, micro_batches: int, forward_time: float = 1.0, backward_time: float = 2.0
) -> ScheduleResult:
    """Run the 1F1B schedule on ``p`` stages with uniform op times; measure the idle fraction.

    An op starts when its stage is free and its input is ready: ``F(i, j)`` after ``F(i-1, j)``,
    ``B(i, j)`` after ``B(i+1, j)`` (and after ``F(i, j)``). Communication takes no time. Bounded:
    each sweep over the stages schedules at least one op, at most ``2 * p * m`` ops in total.

    Raises:
        ValueError: sizes below 1 or non-positive op times.
    """
    p, m = pipeline_parallel, micro_batches
    bubble_fraction(p, m)  # validates p and m
    if forward_time <= 0 or backward_time <= 0:
        raise ValueError(f"forward_time={forward_time}, backward_time={backward_time}: must be > 0")
    orders = [one_f_one_b_order(i, p, m) for i in range(p)]
    position = [0] * p
    stage_free = [0.0] * p
    done: dict[tuple[str, int, int], float] = {}  # (op, stage, micro-batch) -> end time
    in_flight, max_in_flight = [0] * p, [0] * p
    for _ in range(2 * p * m):
        progressed = False
        for i in range(p):
            if position[i] == len(orders[i]):
                continue
            op, j = orders[i][position[i]]
            dep = ("F", i - 1, j) if op == "F" else ("B", i + 1, j)
            has_dep = (op == "F" and i > 0) or (op == "B" and i < p - 1)
            if has_dep and dep not in done:
                continue
            start = max(stage_free[i], done[dep] if has_dep else 0.0)
            end = start + (forward_time if op == "F" else backward_time)
            done[(op, i, j)] = stage_free[i] = end
            position[i] += 1
            in_flight[i] += 1 if op == "F" else -1
            max_in_flight[i] = max(max_in_flight[i], in_flight[i])
            progressed = True
        if not progressed:
            break
    if any(position[i] < len(orders[i]) for i in range(p)):
        raise RuntimeError(f"1F1B schedule deadlocked at positions {position}")  # a bug, not user input
    step = max(stage_free)
    busy = m * (forward_time + backward_time)
    return ScheduleResult(step, busy, 1.0 - busy / step, max_in_flight)
