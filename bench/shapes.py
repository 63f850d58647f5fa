"""Stepped load for finding goodput: add users step by step until the latency objective breaks.

Goodput (DistServe, Zhong et al., OSDI 2024; vLLM ``benchmark_serving --goodput``) is the
highest throughput at which requests still meet their latency objective. ``StepLoadShape`` holds
``start_users``, then ``start_users + step_users``, ... for ``step_s`` seconds each; at the end of
every step it takes the p90 TTFT of the requests that ended in that step (E2E for the
non-streaming endpoint, which has no TTFT; a step in which nothing ended yet is held longer) and
stops the test once it exceeds the bound, a step had failures, or ``max_users`` is reached.
``bench.metrics.step_summaries`` then recomputes
each step from all raw samples and picks the goodput step.

Use from the command line: ``locust -f bench/locustfile.py,bench/shapes.py --model NAME``
(defaults below), or ``lmforge loadtest --shape steps``.
"""

from __future__ import annotations

import time

import numpy as np
from locust import LoadTestShape

PASS, WAIT = "pass", "wait"
MAX_STEP_STRETCH = 4  # a step with no finished request yet is held up to this many step lengths


class StepLoadShape(LoadTestShape):
    """Users ``start_users + k * step_users`` for step ``k``, each held ``step_s`` seconds.

    Attributes after the run: ``steps`` (list of ``{"users", "start_s", "end_s"}`` in epoch
    seconds) and ``stop_reason`` (why it stopped, in words).
    """

    def __init__(
        self,
        start_users: int = 1,
        step_users: int = 2,
        step_s: float = 10.0,
        max_users: int = 32,
        ttft_p90_bound_ms: float = 1000.0,
        spawn_rate: float = 10.0,
        max_steps: int = 20,
    ):
        super().__init__()
        if start_users < 1 or step_users < 1 or max_users < start_users:
            raise ValueError(
                f"start_users={start_users}, step_users={step_users}, max_users={max_users}; "
                "need start_users >= 1, step_users >= 1 and max_users >= start_users"
            )
        if step_s <= 0 or ttft_p90_bound_ms <= 0:
            raise ValueError(f"step_s={step_s}, ttft_p90_bound_ms={ttft_p90_bound_ms}; both must be > 0")
        self.start_users, self.step_users, self.step_s = start_users, step_users, step_s
        self.max_users, self.bound_ms, self.spawn_rate, self.max_steps = (
            max_users,
            ttft_p90_bound_ms,
            spawn_rate,
            max_steps,
        )
        self.steps: list[dict] = []
        self.stop_reason: str | None = None

    def tick(self) -> tuple[int, float] | None:
        if not self.steps:
            self._begin_step(self.start_users)
            return self.start_users, self.spawn_rate
        step = self.steps[-1]
        elapsed = time.time() - step["start_s"]
        if elapsed >= self.step_s:
            verdict = self._judge(step)
            if verdict == WAIT and elapsed < MAX_STEP_STRETCH * self.step_s:
                return step["users"], self.spawn_rate  # nothing finished yet: hold the step longer
            if verdict != PASS:
                return self._stop(
                    verdict
                    if verdict != WAIT
                    else f"no request finished within {elapsed:.0f} s at {step['users']} users"
                )
            users = step["users"] + self.step_users
            if users > self.max_users or len(self.steps) >= self.max_steps:
                return self._stop(
                    f"reached the limit ({self.max_users} users, {self.max_steps} steps) within the bound"
                )
            self._begin_step(users)
        return self.steps[-1]["users"], self.spawn_rate

    def _begin_step(self, users: int) -> None:
        now = time.time()
        if self.steps:
            self.steps[-1]["end_s"] = now
        self.steps.append({"users": users, "start_s": now, "end_s": None})
        state = self._state()
        if state is not None:
            state.record("step", {"users": users, "start_s": now})

    def _stop(self, reason: str) -> None:
        self.stop_reason = reason
        if self.steps and self.steps[-1]["end_s"] is None:
            self.steps[-1]["end_s"] = time.time()
        state = self._state()
        if state is not None:
            state.record("shape_stop", {"time_s": time.time(), "reason": reason})
        return None

    def _judge(self, step: dict) -> str:
        """``PASS``, ``WAIT`` (no request ended in the step yet) or the reason the step failed.

        A request counts for the step in which it ended (as ``bench.metrics.step_summaries``).
        """
        state = self._state()
        inside = [s for s in (state.samples if state else []) if s.end_s >= step["start_s"]]
        latencies = [(s.ttft_s if s.ttft_s is not None else s.e2e_s) for s in inside if s.ok]
        failed = sum(not s.ok for s in inside)
        if failed:
            return f"{failed} failed requests at {step['users']} users"
        if not latencies:
            return WAIT
        p90_ms = float(np.percentile(latencies, 90)) * 1000.0
        if p90_ms > self.bound_ms:
            return f"TTFT p90 {p90_ms:.0f} ms > bound {self.bound_ms:g} ms at {step['users']} users"
        return PASS

    def _state(self):
        runner = self.runner
        return getattr(runner.environment, "lmforge_state", None) if runner is not None else None
