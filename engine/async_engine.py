"""``AsyncLLMEngine``: the engine stepping on a background thread, streaming to asyncio callers.

The step loop owns the ``LLMEngine`` and runs on one daemon thread; every call into the engine
holds ``_lock``. Outputs go to one ``asyncio.Queue`` per request through
``loop.call_soon_threadsafe`` (the only thread-safe way into an event loop). A request that
fails validation raises ``ValueError`` from its own ``generate`` and touches nobody else.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

#: Seconds the idle loop sleeps between checks of its stop flag when no request is queued.
IDLE_WAIT_S = 0.5


class EngineDeadError(RuntimeError):
    """The step loop failed; the original exception is chained."""


class AsyncLLMEngine:
    """Asynchronous front end of ``LLMEngine`` (vLLM's ``AsyncLLMEngine`` shape).

    Args:
        config: the engine configuration (the model loads in the constructor).

    Use ``async for out in engine.generate(prompt, params, request_id)``; call ``shutdown()``
    (or use ``with``) to stop the thread.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="lmforge-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ---------------------------------------------------------------- public API

    async def generate(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream ``RequestOutput``s of one request (cumulative text and tokens) until it finishes.

        Raises:
            ValueError: a bad prompt or parameter, or a duplicate ``request_id`` (this request only).
            EngineDeadError: the step loop crashed.

        Closing the iterator early (e.g. the client went away) aborts the request.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._wake:
            self._raise_if_dead()
            request_id = self.engine.add_request(request_id, prompt, params)
            self._queues[request_id] = (loop, queue)
            self._wake.notify()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError("the engine step loop failed") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request now: its blocks are freed before this returns; its stream ends with ``finish_reason="abort"``."""
        await asyncio.to_thread(self._abort_sync, request_id)

    def _abort_sync(self, request_id: str) -> None:
        with self._lock:
            outputs = self.engine.abort_request(request_id)
            self._deliver(outputs)

    def get_stats(self) -> EngineStats:
        with self._lock:
            return self.engine.get_stats()

    def check_invariants(self) -> None:
        with self._lock:
            self.engine.check_invariants()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the step loop thread (requests still running are abandoned)."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout_s)

    def __enter__(self) -> "AsyncLLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---------------------------------------------------------------- step loop

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and not self.engine.has_unfinished_requests():
                    self._wake.wait(IDLE_WAIT_S)
                if self._stopped:
                    return
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # noqa: BLE001 - forwarded to every waiting caller
                    self._fail(exc)
                    return
                self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their callers' loops (caller holds ``_lock``)."""
        for out in outputs:
            target = self._queues.get(out.request_id)
            if target is None:
                continue
            loop, queue = target
            if out.finished:
                del self._queues[out.request_id]
            if not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, out)

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        for loop, queue in self._queues.values():
            if not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, exc)
        self._queues.clear()

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise EngineDeadError("the engine step loop failed; create a new engine") from self._error
        if self._stopped:
            raise EngineDeadError("the engine was shut down")
