"""``AsyncLLMEngine``: the engine stepping on a background thread, streaming to asyncio callers.

Only the step-loop thread touches the ``LLMEngine``. Callers validate their request in their own
thread (so a bad request raises ``ValueError`` from its own ``generate`` and touches nobody
else), then hand "add" and "abort" operations to the loop through a queue; the loop applies them
between steps. Outputs go to one ``asyncio.Queue`` per request through
``loop.call_soon_threadsafe`` (the thread-safe way into an event loop), so the event loop never
waits for a model step.

The engine is also built on that thread, so the caller's thread never runs a parallel torch op:
GNU OpenMP keeps a thread team per thread that ever opened a parallel region, and once its teams
hold more threads than there are cores it stops spinning between regions and puts the workers to
sleep after every one (a bf16 decode step of SmolLM2-135M at batch 4 took 1.6x as long on a
second thread of a process whose main thread had loaded the model as on the main thread).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from engine.config import EngineConfig
from engine.llm_engine import EngineDeadError, LLMEngine
from engine.lora import LoRARequest
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

__all__ = ["AsyncLLMEngine", "EngineDeadError"]

#: Seconds the idle loop waits for work before re-checking its stop flag.
IDLE_WAIT_S = 0.5

logger = logging.getLogger(__name__)


class AsyncLLMEngine:
    """Asynchronous front end of ``LLMEngine`` (vLLM's ``AsyncLLMEngine`` shape).

    Args:
        config: the engine configuration (the model loads in the constructor).

    Use ``async for out in engine.generate(prompt, params, request_id)``; ``await
    engine.abort(request_id)``; ``engine.get_stats()``; ``shutdown()`` (or ``with``) stops the thread.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.engine: LLMEngine
        self._ops: deque[Callable[[], None]] = deque()
        self._wake = threading.Condition()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._queues_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._stopped = False
        self._error: BaseException | None = None
        built = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(config, built), name="lmforge-engine", daemon=True)
        self._thread.start()
        built.wait()
        if self._error is not None:  # the model did not load: the caller gets the error, no thread is left
            self._thread.join()
            raise self._error
        self._stats = self.engine.get_stats()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_dead(self) -> bool:
        """Whether the step loop stopped for good (a fatal error or ``shutdown``)."""
        return self._error is not None or not self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        """Why the step loop failed (``"ExceptionType: message"``), ``None`` while it runs."""
        if self._error is not None:
            return f"{type(self._error).__name__}: {self._error}"
        return None if self._thread.is_alive() else "the engine was shut down"

    # ---------------------------------------------------------------- public API

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream ``RequestOutput``s of one request (cumulative text and tokens) until it finishes.

        ``lora_request`` names the LoRA adapter it runs with (``None``: the base).

        A request whose step failed ends with ``finish_reason="error"`` (``outputs[0].error``
        says why); the engine serves the others on.

        Raises:
            ValueError: a bad prompt or parameter, a LoRA adapter the engine cannot serve, or a duplicate
                ``request_id`` (this request only).
            EngineDeadError: the step loop crashed or was shut down.

        Closing the iterator early (e.g. the client went away) aborts the request.
        """
        self._raise_if_dead()
        # ValueError for this request only
        params, text, token_ids = self.engine.validate_request(prompt, params, lora_request)
        if params.structured_outputs is not None:  # compiled before the request joins: a bad grammar is its ValueError
            await self._compile_grammar(params)
        request_id = f"async-{next(self._ids)}" if request_id is None else str(request_id)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._queues_lock:
            if request_id in self._queues:
                raise ValueError(
                    f"request_id={request_id!r} is already in use by an unfinished request; pick another id"
                )
            self._queues[request_id] = (loop, queue)
        self._submit(lambda: self._add(request_id, text, token_ids, params, lora_request))
        finished = False
        try:
            while True:
                item = await queue.get()
                while not queue.empty() and isinstance(item, RequestOutput) and not item.finished:
                    item = queue.get_nowait()  # cumulative: the newest output holds what the skipped ones said
                if isinstance(item, ValueError):
                    finished = True
                    raise item
                if isinstance(item, BaseException):
                    finished = True
                    raise EngineDeadError("the engine step loop failed") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                await self.abort(request_id)

    async def _compile_grammar(self, params: SamplingParams) -> None:
        """Wait (off the step loop) for the request's grammar to compile.

        Raises:
            GrammarError (a ValueError): the constraint is invalid, matches nothing, or took longer
                than the compile timeout (counted from when the grammar tokenizer is ready).
        """
        compiler = self.engine.grammar_compiler
        submitted = time.monotonic()
        future = compiler.submit(params.structured_outputs)
        await asyncio.wait([asyncio.wrap_future(compiler.tokenizer_future())])  # a failed build fails the compile
        remaining = compiler.deadline(submitted) - time.monotonic()
        try:  # shielded: the compile is shared with other requests of the same constraint
            async with asyncio.timeout(max(remaining, 0.0)):  # keeps a cancellation that meets the result (3.11)
                await asyncio.shield(asyncio.wrap_future(future))
        except TimeoutError:
            raise compiler.timeout_error(params.structured_outputs.key) from None

    async def abort(self, request_id: str) -> None:
        """Abort a request; when this returns its blocks are free and its stream ends with ``finish_reason="abort"``."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def op() -> None:
            self._deliver(self.engine.abort_request(request_id))
            with self._queues_lock:
                self._queues.pop(request_id, None)
            loop.call_soon_threadsafe(_resolve, done)

        self._submit(op)
        if self._thread.is_alive():
            await done

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter (checked against the base) ahead of its requests; True once it is in memory.

        Raises:
            LoRAError: see ``engine.lora.load_adapter``; or the engine runs without LoRA.
        """
        self._raise_if_dead()
        return self.engine.add_lora(lora_request)  # thread-safe: touches no slot

    async def remove_lora(self, lora_id: int) -> bool:
        """Drop an adapter from memory and its slot between two steps (never under a running step);
        True if it was there. Requests still queued with it reload it from disk or fail cleanly."""
        return await self._on_loop(lambda: self.engine.remove_lora(lora_id))

    async def list_loras(self) -> set[int]:
        """Ids of the adapters in memory."""
        return self.engine.list_loras()

    async def _on_loop(self, fn: Callable[[], object]):
        """Run ``fn`` on the step-loop thread between steps; returns its result (raises its exception here)."""
        self._raise_if_dead()
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def op() -> None:
            try:
                result = fn()
            except Exception as exc:  # noqa: BLE001 - re-raised in the caller's loop
                loop.call_soon_threadsafe(_settle, done, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, done, result, None)

        self._submit(op)
        return await done

    def get_stats(self) -> EngineStats:
        """The snapshot taken after the latest step (cheap; never waits for a step)."""
        return self._stats

    def check_invariants(self, timeout_s: float = 60.0) -> None:
        """Run ``LLMEngine.check_invariants`` on the loop thread between steps (raises its error here)."""
        result: list[BaseException | None] = []
        event = threading.Event()

        def op() -> None:
            try:
                self.engine.check_invariants()
                result.append(None)
            except Exception as exc:  # noqa: BLE001 - re-raised in the caller's thread
                result.append(exc)
            event.set()

        self._submit(op)
        if not event.wait(timeout_s):
            raise TimeoutError(f"the engine loop did not run the check within {timeout_s} s")
        if result[0] is not None:
            raise result[0]

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

    # ---------------------------------------------------------------- loop thread

    def _submit(self, op: Callable[[], None]) -> None:
        self._ops.append(op)
        with self._wake:
            self._wake.notify()

    def _add(
        self,
        request_id: str,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> None:
        try:
            self.engine.add_validated_request(request_id, text, token_ids, params, None, lora_request)
        except Exception as exc:  # noqa: BLE001 - refuses this request, never the loop
            error = (
                exc if isinstance(exc, ValueError) else ValueError(f"request not added: {type(exc).__name__}: {exc}")
            )
            self._send(request_id, error, last=True)

    def _run(self, config: EngineConfig, built: threading.Event) -> None:
        try:
            self.engine = LLMEngine(config)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the constructor in the caller's thread
            self._error = exc
            return
        finally:
            built.set()
        try:
            while True:
                with self._wake:
                    while not self._stopped and not self._ops and not self.engine.has_unfinished_requests():
                        self._wake.wait(IDLE_WAIT_S)
                    if self._stopped:
                        return
                while self._ops:
                    self._ops.popleft()()
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                self._stats = self.engine.get_stats()
        except Exception as exc:  # noqa: BLE001 - forwarded to every waiting caller
            logger.error("engine step loop died; every request fails until the engine is restarted", exc_info=exc)
            self._fail(exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their callers: one ``call_soon_threadsafe`` per event loop."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._queues_lock:
            for out in outputs:
                target = self._queues.pop(out.request_id, None) if out.finished else self._queues.get(out.request_id)
                if target is not None:
                    batches.setdefault(target[0], []).append((target[1], out))
        for loop, items in batches.items():
            if not loop.is_closed():
                loop.call_soon_threadsafe(_put_all, items)

    def _send(self, request_id: str, item, last: bool) -> None:
        with self._queues_lock:
            target = self._queues.pop(request_id, None) if last else self._queues.get(request_id)
        if target is not None and not target[0].is_closed():
            target[0].call_soon_threadsafe(target[1].put_nowait, item)

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        with self._queues_lock:
            targets, self._queues = list(self._queues.values()), {}
        for loop, queue in targets:
            if not loop.is_closed():
                loop.call_soon_threadsafe(queue.put_nowait, exc)

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise EngineDeadError("the engine step loop failed; create a new engine") from self._error
        if self._stopped:
            raise EngineDeadError("the engine was shut down")


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _settle(future: asyncio.Future, result, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
