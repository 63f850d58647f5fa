"""Stepped load for finding goodput: add users step by step until the latency objective breaks.

Goodput (DistServe, Zhong et al., OSDI 2024; vLLM ``benchmark_serving --goodput``) is the
highest throughput at which requests still meet their latency objective. ``StepLoadShape`` holds
``start_users``, then ``start_users + step_users``, ... for ``step_s`` seconds each; at the end of
every step it takes the p90 TTFT of the requests that started and finished in that step (E2E for
the non-streaming endpoint, which has no TTFT) and stops the test once it exceeds the bound, a
step had failures, or ``max_users`` is reached. ``bench.metrics.step_summaries`` then recomputes
each step from all raw samples and picks the goodput step.

Use from the command line: ``locust -f bench/locustfile.py,bench/shapes.py --model NAME``
(defaults below), or ``lmforge loadtest --shape steps``.
"""

from __future__ import annotations

import time

import numpy as np
from locust import LoadTestShape


class StepLoadShape(LoadTestShape):
    """Users ``start_users + k * step_users`` for step ``k``, each held ``step_s`` seconds.

    Attributes after the run: ``steps`` (list of ``{"users", "start_s", "end_s"}`` in epoch
    seconds) and ``stop_reason`` (why it stopped, in words).
    """

    def __init__(self, start_users: int = 1, step_users: int = 2, step_s: float = 10.0, max_users: int = 32,
                 ttft_p90_bound_ms: float = 1000.0, spawn_rate: float = 10.0, max_steps: int = 20):
        super().__init__()
        if start_users < 1 or step_users < 1 or max_users < start_users:
            raise ValueError(f"start_users={start_users}, step_users={step_users}, max_users={max_users}; "
                             "need start_users >= 1, step_users >= 1 and max_users >= start_users")
        if step_s <= 0 or ttft_p90_bound_ms <= 0:
            raise ValueError(f"step_s={step_s}, ttft_p90_bound_ms={ttft_p90_bound_ms}; both must be > 0")
        self.start_users, self.step_users, self.step_s = start_users, step_users, step_s
        self.max_users, self.bound_ms, self.spawn_rate, self.max_steps = max_users, ttft_p90_bound_ms, spawn_rate, max_steps
        self.steps: list[dict] = []
        self.stop_reason: str | None = None
        self._index: int | None = None

    def tick(self) -> tuple[int, float] | None:
        index = int(self.get_run_time() // self.step_s)
        if index != self._index:
            if self._index is not None and not self._step_passed():
                return self._stop()
            users = self.start_users + index * self.step_users
            if users > self.max_users or index >= self.max_steps:
                self.stop_reason = f"reached the limit ({self.max_users} users, {self.max_steps} steps) within the bound"
                return self._stop()
            self._begin_step(index, users)
        return self.steps[-1]["users"], self.spawn_rate

    def _begin_step(self, index: int, users: int) -> None:
        now = time.time()
        if self.steps:
            self.steps[-1]["end_s"] = now
        self.steps.append({"users": users, "start_s": now, "end_s": None})
        self._index = index
        state = self._state()
        if state is not None:
            state.record("step", {"users": users, "start_s": now})

    def _stop(self) -> None:
        if self.steps and self.steps[-1]["end_s"] is None:
            self.steps[-1]["end_s"] = time.time()
        state = self._state()
        if state is not None:
            state.record("shape_stop", {"time_s": time.time(), "reason": self.stop_reason})
        return None

    def _step_passed(self) -> bool:
        step = self.steps[-1]
        state = self._state()
        inside = [s for s in (state.samples if state else []) if s.start_s >= step["start_s"]]
        latencies = [(s.ttft_s if s.ttft_s is not None else s.e2e_s) for s in inside if s.ok]
        failed = sum(not s.ok for s in inside)
        if failed:
            self.stop_reason = f"{failed} failed requests at {step['users']} users"
            return False
        if not latencies:
            self.stop_reason = f"no request finished within the {self.step_s:g} s step at {step['users']} users"
            return False
        p90_ms = float(np.percentile(latencies, 90)) * 1000.0
        if p90_ms > self.bound_ms:
            self.stop_reason = f"TTFT p90 {p90_ms:.0f} ms > bound {self.bound_ms:g} ms at {step['users']} users"
            return False
        return True

    def _state(self):
        runner = self.runner
        return getattr(runner.environment, "lmforge_state", None) if runner is not None else None
