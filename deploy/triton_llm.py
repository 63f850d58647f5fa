"""The LLM as a decoupled Triton Python-backend model, driven like Triton's vLLM backend.

One ``engine.AsyncLLMEngine`` per model instance runs on an asyncio event loop in its own
thread. ``execute`` only hands each request to that loop and returns at once; the loop parses
the request (``deploy.llm_request``), iterates ``engine.generate`` and sends responses through
the request's response sender: when ``stream`` is true, one per engine step at most (the engine
hands over only its newest output when this loop fell behind, so a response then carries the
new text and tokens of several steps: each send is a round trip to Triton, and under load
fewer, fuller responses are what keeps the stream up with the engine); one at the end
otherwise. The last response carries ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``, the finish
reason and ``num_cached_tokens`` (prompt tokens served from the prefix cache); the first carries the
request's ``prompt_logprobs`` when they were asked (JSON). A request whose client
went away (``response_sender.is_cancelled()``, polled by one task for all requests whether or
not the engine produced output, so a request still waiting for a batch slot is caught too: see
``CancelWatch``) is aborted in the engine, which frees its KV blocks at once. Triton 2.51 flags
gRPC stream cancellations at once; it flags an HTTP client that closed a ``generate_stream``
(SSE) only when it writes to the connection, so a streaming request that sent nothing for
``HEARTBEAT_INTERVAL_S`` (queued, or waiting on a long step) sends an empty response
(``heartbeat_tensors``; clients skip it) and a closed client is aborted within about a second,
queued or running; the heartbeats also tell a client that the instance serving it is alive. A
client that leaves a non-streaming ``generate`` is never flagged (no response may be written
before the last one); such a request runs to its end, bounded by the request limits
(``engine.limits``: one completion, ``n`` > 1 needs ``stream``, at most ``max_model_len`` tokens).

A bad request gets an error response (``INVALID_ARG``, HTTP 400); a request whose engine step
failed gets ``INTERNAL`` with the engine's reason; the other requests carry on. If the engine
dies (``EngineDeadError``: broken KV bookkeeping, every step failing), the model logs why,
answers ``UNAVAILABLE`` and unloads itself, so ``/v2/models/<name>/ready`` stops answering 200
(Triton 2.51's Python backend has no readiness hook; unloading is the one lever it offers) and
``lmforge serve`` loads it again (``deploy.triton.ModelSupervisor``).

Custom metrics (``pb_utils.MetricFamily``, on Triton's metrics port, labels ``model`` and
``version``) are listed in ``LLMMetrics``.

``model.json`` next to ``model.py`` (written by ``lmforge export``) names the checkpoint and the
``EngineConfig`` fields.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import traceback
import uuid
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from deploy.llm_request import LLMRequest, parse_request
from deploy.lora_adapters import AdapterRegistry
from engine.errors import EngineDeadError

STATS_INTERVAL_S = 0.05
#: How often a request asks Triton whether its client cancelled (an IPC round trip), at most...
CANCEL_CHECK_INTERVAL_S = 0.1
#: ...and how many of those round trips all requests share per second (``CancelWatch``).
CANCEL_POLLS_PER_S = 100
#: A streaming request that sent nothing for this long (queued behind others, or a long step) gets an empty
#: response (``heartbeat_tensors``): Triton 2.51's HTTP server notices a closed SSE connection only when it
#: writes to it, and a client (the OpenAI frontend) tells a live instance from a dead one by it.
HEARTBEAT_INTERVAL_S = 0.3
#: Request parameters Triton or its clients set themselves (e.g. ``triton_enable_empty_final_response``).
RESERVED_PARAMETER_PREFIX = "triton_"
#: Histogram buckets (seconds) for time to first token and time per output token.
TTFT_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
TPOT_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]


def read_model_info(version_dir: Path) -> dict:
    """``model.json``: ``{"kind": "llm", "checkpoint": path, "engine": {EngineConfig fields}}``.

    Raises:
        pb_utils.TritonModelException: missing or corrupt file (names it and the fix).
    """
    path = version_dir / "model.json"
    try:
        info = json.loads(path.read_text())
        checkpoint = Path(info["checkpoint"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise pb_utils.TritonModelException(
            f"{path}: missing or corrupt ({exc}); write it with `lmforge export --model CKPT --repo REPO "
            f"--name {version_dir.parent.name}`"
        ) from exc
    if not checkpoint.is_absolute():  # --copy-weights: relative to the version directory
        info["checkpoint"] = str(version_dir / checkpoint)
    return info


class LLMMetrics:
    """The model's Prometheus metrics (all labelled ``model``, ``version``).

    * ``lmforge_num_requests_running`` / ``_waiting`` (gauges): the engine's queues;
    * ``lmforge_num_requests_running_max`` (gauge): most requests in one engine batch since load;
    * ``lmforge_kv_cache_usage_ratio`` (gauge, 0..1): KV blocks in use;
    * ``lmforge_prefix_cache_hit_rate`` (gauge, 0..1): cached / queried prompt tokens;
    * ``lmforge_num_preemptions_total``, ``lmforge_requests_finished_total`` (label
      ``finish_reason``), ``lmforge_requests_aborted_total``, ``lmforge_request_errors_total``
      (counters);
    * ``lmforge_prompt_tokens_total``, ``lmforge_generation_tokens_total``,
      ``lmforge_engine_steps_total`` (the engine's counters) and ``lmforge_responses_total``
      (responses sent; with the tokens, the messages per token of the stream);
    * ``lmforge_time_to_first_token_seconds``, ``lmforge_time_per_output_token_seconds``
      (histograms);
    * speculative decoding: ``lmforge_spec_decode_num_drafts_total`` (request-steps that
      verified proposals), ``lmforge_spec_decode_num_draft_tokens_total`` (proposed tokens
      verified), ``lmforge_spec_decode_num_accepted_tokens_total`` (counters);
      ``lmforge_spec_decode_acceptance_rate`` (accepted / proposed) and
      ``lmforge_spec_decode_mean_accepted_length`` (tokens per speculative request-step) (gauges);
    * LoRA adapters (label ``lora_name``): ``lmforge_lora_requests_finished_total`` and
      ``lmforge_lora_generation_tokens_total`` (tokens of those requests) (counters);
    * structured output (counters): ``lmforge_structured_output_compiles_total`` and
      ``_compile_seconds_total`` (grammar compiles), ``_mask_seconds_total``, ``_mask_steps_total``
      and ``_masked_tokens_total`` (logit masking: mean ms per step or per token from their ratios).
    """

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        gauge, counter, histogram = (
            pb_utils.MetricFamily.GAUGE,
            pb_utils.MetricFamily.COUNTER,
            pb_utils.MetricFamily.HISTOGRAM,
        )
        self.families = {}  # kept alive as long as their metrics (Triton's rule)
        family, metric = self._family, self._metric

        self.running = metric("lmforge_num_requests_running", "Requests running in the engine", gauge)
        self.waiting = metric("lmforge_num_requests_waiting", "Requests waiting for KV blocks or a batch slot", gauge)
        self.running_max = metric(
            "lmforge_num_requests_running_max",
            "Most requests running in one engine batch since the model loaded",
            gauge,
        )
        self.kv_usage = metric("lmforge_kv_cache_usage_ratio", "Fraction of KV cache blocks in use", gauge)
        self.hit_rate = metric(
            "lmforge_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens queried", gauge
        )
        self.preemptions = metric(
            "lmforge_num_preemptions_total", "Requests preempted (recomputed) for lack of KV blocks", counter
        )
        self._finished_family = family(
            "lmforge_requests_finished_total", "Requests finished, by finish reason", counter
        )
        self._finished: dict[str, object] = {}
        self.aborted = metric(
            "lmforge_requests_aborted_total", "Requests aborted because the client cancelled or disconnected", counter
        )
        self.errors = metric("lmforge_request_errors_total", "Requests answered with an error", counter)
        self.ttft = metric(
            "lmforge_time_to_first_token_seconds", "Time to first token (s)", histogram, buckets=TTFT_BUCKETS_S
        )
        self.tpot = metric(
            "lmforge_time_per_output_token_seconds",
            "Time per output token after the first (s)",
            histogram,
            buckets=TPOT_BUCKETS_S,
        )
        self.acceptance_rate = metric(
            "lmforge_spec_decode_acceptance_rate", "Speculative decoding: accepted / proposed tokens", gauge
        )
        self.mean_accepted_length = metric(
            "lmforge_spec_decode_mean_accepted_length",
            "Speculative decoding: tokens emitted per request-step that verified proposals",
            gauge,
        )
        self._lora_requests_family = family(
            "lmforge_lora_requests_finished_total", "Requests finished, by LoRA adapter", counter
        )
        self._lora_tokens_family = family(
            "lmforge_lora_generation_tokens_total", "Tokens generated by finished requests, by LoRA adapter", counter
        )
        self._lora: dict[str, tuple[object, object]] = {}  # adapter name -> (requests, tokens) metrics
        #: EngineStats counter field -> (Prometheus counter, value already added).
        self._counters = self._engine_counters(counter)
        self._running_max_seen = 0
        self.responses = metric("lmforge_responses_total", "Responses sent (streamed pieces and finals)", counter)
        #: Responses sent, counted by the sending thread; ``update_stats`` exports them.
        self.num_responses = 0
        self._responses_exported = 0
        self._gauge_values: dict[int, float] = {}

    def _family(self, name: str, description: str, kind):
        self.families[name] = pb_utils.MetricFamily(name=name, description=description, kind=kind)
        return self.families[name]

    def _metric(self, name: str, description: str, kind, **kwargs):
        """The labelled metric of a new family (``kwargs``: a histogram's ``buckets``)."""
        return self._family(name, description, kind).Metric(labels=self.labels, **kwargs)

    def _engine_counters(self, counter) -> dict[str, list]:
        """The Prometheus counter of each cumulative ``EngineStats`` field, with the value already added (0)."""
        return {
            "num_preemptions_total": [self.preemptions, 0],
            **{
                field: [self._metric(name, help_text, counter), 0]
                for field, name, help_text in (
                    ("num_prompt_tokens_total", "lmforge_prompt_tokens_total", "Prompt tokens of admitted requests"),
                    ("num_generation_tokens_total", "lmforge_generation_tokens_total", "Tokens generated"),
                    ("num_steps_total", "lmforge_engine_steps_total", "Engine steps run"),
                )
            },
            **{
                f"spec_decode_{name}_total": [
                    self._metric(f"lmforge_spec_decode_{name}_total", help_text, counter),
                    0,
                ]
                for name, help_text in (
                    ("num_drafts", "Speculative decoding: request-steps that verified proposed tokens"),
                    ("num_draft_tokens", "Speculative decoding: proposed tokens verified by the model"),
                    ("num_accepted_tokens", "Speculative decoding: proposed tokens accepted"),
                )
            },
            **{
                f"structured_output_{field}_total": [
                    self._metric(f"lmforge_structured_output_{name}_total", help_text, counter),
                    0,
                ]
                for field, name, help_text in (
                    ("num_compiles", "compiles", "Structured output: grammars compiled"),
                    ("compile_seconds", "compile_seconds", "Structured output: seconds spent compiling grammars"),
                    ("mask_seconds", "mask_seconds", "Structured output: seconds spent masking logits to grammars"),
                    ("num_mask_steps", "mask_steps", "Structured output: engine steps that masked logits"),
                    ("num_masked_tokens", "masked_tokens", "Structured output: logit rows masked (tokens)"),
                )
            },
        }

    def _set(self, gauge, value: float) -> None:
        """Set a gauge only when its value changed: each set is a round trip to Triton."""
        if self._gauge_values.get(id(gauge)) != value:
            self._gauge_values[id(gauge)] = value
            gauge.set(value)

    def update_stats(self, stats) -> None:
        """Copy an ``EngineStats`` snapshot into the gauges and counters."""
        self._set(self.running, stats.num_running)
        self._set(self.waiting, stats.num_waiting)
        if stats.num_running > self._running_max_seen:
            self._running_max_seen = stats.num_running
            self.running_max.set(stats.num_running)
        self._set(self.kv_usage, float(stats.kv_cache_usage))
        queries = stats.prefix_cache_queries_tokens_total
        self._set(self.hit_rate, stats.prefix_cache_hits_tokens_total / queries if queries else 0.0)
        self._set(self.acceptance_rate, float(stats.spec_decode_acceptance_rate))
        self._set(self.mean_accepted_length, float(stats.spec_decode_mean_accepted_length))
        for field, entry in self._counters.items():
            value = getattr(stats, field)
            if value > entry[1]:
                entry[0].increment(value - entry[1])
                entry[1] = value
        responses = self.num_responses
        if responses > self._responses_exported:
            self.responses.increment(responses - self._responses_exported)
            self._responses_exported = responses

    def finished(self, output) -> None:
        """Record a finished ``RequestOutput``: its finish reason, TTFT and TPOT."""
        reason = output.outputs[0].finish_reason or "unknown"
        if reason not in self._finished:
            self._finished[reason] = self._finished_family.Metric(labels={**self.labels, "finish_reason": reason})
        self._finished[reason].increment(1)
        lora = getattr(output, "lora_request", None)
        if lora is not None:
            name = lora.lora_name
            if name not in self._lora:
                labels = {**self.labels, "lora_name": name}
                self._lora[name] = (
                    self._lora_requests_family.Metric(labels=labels),
                    self._lora_tokens_family.Metric(labels=labels),
                )
            requests, tokens = self._lora[name]
            requests.increment(1)
            tokens.increment(sum(len(c.token_ids) for c in output.outputs))
        metrics = getattr(output, "metrics", None)
        if metrics is None:
            return
        if metrics.ttft_s is not None:
            self.ttft.observe(metrics.ttft_s)
        if metrics.tpot_s is not None:
            self.tpot.observe(metrics.tpot_s)


def _is_cancelled(sender) -> bool:
    try:
        return bool(sender.is_cancelled())
    except Exception:  # noqa: BLE001 - a sender that cannot even say so is gone too
        return True


class CancelWatch:
    """Asks Triton whether the clients of the streaming requests cancelled, from one task.

    Each ``is_cancelled`` is an IPC round trip to the Triton process, which under load cost more
    than the responses themselves when every request polled on its own every 0.1 s. So the
    polls share a budget: every ``max(CANCEL_CHECK_INTERVAL_S, n / CANCEL_POLLS_PER_S)`` seconds
    one sweep asks about each of the ``n`` requests watched (at 64 requests, each every 0.64 s).
    A cancelled request's event is set and ``on_cancel(request_id)`` runs as its own task.

    Every ``HEARTBEAT_INTERVAL_S`` (apart from the sweeps) each streaming request that sent
    nothing since the last look sends a heartbeat (``heartbeat_tensors``); a send that fails
    counts as a cancel. Requests that stream tokens send none.
    """

    def __init__(self, on_cancel) -> None:
        self.on_cancel = on_cancel
        # request id -> (sender, cancelled event, _SentState of a streaming request or None, progress at the last look)
        self.watched: dict[str, list] = {}
        self.task: asyncio.Future | None = None
        self.aborts: set[asyncio.Future] = set()

    def add(self, request_id: str, sender, sent: "_SentState | None" = None) -> asyncio.Event:
        """Watch a request (on the running event loop); ``sent``: a streaming request's state (it gets
        heartbeats). Returns the event set when its client cancels."""
        cancelled = asyncio.Event()
        self.watched[request_id] = [sender, cancelled, sent, None]
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._run())
        return cancelled

    def remove(self, request_id: str) -> None:
        self.watched.pop(request_id, None)

    def interval_s(self) -> float:
        return max(CANCEL_CHECK_INTERVAL_S, len(self.watched) / CANCEL_POLLS_PER_S)

    def _cancel(self, request_id: str) -> None:
        entry = self.watched.pop(request_id, None)
        if entry is None:
            return
        entry[1].set()
        abort = asyncio.ensure_future(self.on_cancel(request_id))
        self.aborts.add(abort)
        abort.add_done_callback(self.aborts.discard)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_sweep = next_heartbeats = loop.time()
        while self.watched:
            await asyncio.sleep(max(0.0, min(next_sweep, next_heartbeats) - loop.time()))
            now = loop.time()
            if now >= next_heartbeats:
                next_heartbeats = now + HEARTBEAT_INTERVAL_S
                for request_id, entry in list(self.watched.items()):
                    if entry[2] is not None and request_id in self.watched and not self._heartbeat(entry):
                        self._cancel(request_id)
            if now >= next_sweep:
                next_sweep = now + self.interval_s()
                for request_id, entry in list(self.watched.items()):
                    if request_id in self.watched and _is_cancelled(entry[0]):  # an IPC round trip to Triton
                        self._cancel(request_id)

    @staticmethod
    def _heartbeat(entry: list) -> bool:
        """Send a heartbeat if the request sent nothing since the last look; False if the send failed."""
        sender, _, sent, progress = entry
        seen = (len(sent.chars), sum(sent.chars.values()), sum(sent.tokens.values()), len(sent.done))
        if seen != progress:
            entry[3] = seen
            return True
        try:
            sender.send(pb_utils.InferenceResponse(heartbeat_tensors(sent.last)), flags=0)
        except Exception:  # noqa: BLE001 -- the client is gone
            return False
        sent.heartbeats += 1
        return True


@dataclasses.dataclass
class _SentState:
    """What one request's responses already carried, per completion ``index``."""

    chars: dict[int, int] = dataclasses.field(default_factory=dict)  # text characters streamed
    tokens: dict[int, int] = dataclasses.field(default_factory=dict)  # token ids streamed
    done: set[int] = dataclasses.field(default_factory=set)  # completions whose finish was sent
    prompt_logprobs_sent: bool = False
    last: object = None  # the latest RequestOutput (heartbeats repeat its token counts)
    heartbeats: int = 0  # empty responses sent


def heartbeat_tensors(last) -> list:
    """An empty response of a streaming request: ``text_output`` "", no ``output_token_ids``, no
    ``finish_reason``, index 0 and the token counts of ``last`` (0 before the first output). Clients skip it."""
    num_in = len(last.prompt_token_ids) if last is not None else 0
    num_out = len(last.outputs[0].token_ids) if last is not None else 0
    return [
        pb_utils.Tensor("text_output", np.array([b""], dtype=np.object_)),
        pb_utils.Tensor("num_input_tokens", np.array([num_in], dtype=np.int32)),
        pb_utils.Tensor("num_output_tokens", np.array([num_out], dtype=np.int32)),
        pb_utils.Tensor("index", np.array([0], dtype=np.int32)),
        pb_utils.Tensor("output_token_ids", np.array([], dtype=np.int64)),
    ]


def _output_tensors(
    text: str, output, completion, finish_reason: str | None, token_ids=(), logprobs=None, final: bool = False
) -> list:
    """One response's tensors for one completion (``token_ids``/``logprobs``: those of this response).

    ``finish_reason`` and ``num_cached_tokens`` (prompt tokens served from the prefix cache) ride
    on a completion's last response only.
    """
    tensors = [
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("num_input_tokens", np.array([len(output.prompt_token_ids)], dtype=np.int32)),
        pb_utils.Tensor("num_output_tokens", np.array([len(completion.token_ids)], dtype=np.int32)),
        pb_utils.Tensor("index", np.array([completion.index], dtype=np.int32)),
        pb_utils.Tensor("output_token_ids", np.array(token_ids, dtype=np.int64)),
    ]
    if finish_reason is not None:
        tensors.append(pb_utils.Tensor("finish_reason", np.array([finish_reason.encode()], dtype=np.object_)))
    if final:
        cached = output.metrics.num_cached_tokens if getattr(output, "metrics", None) is not None else 0
        tensors.append(pb_utils.Tensor("num_cached_tokens", np.array([cached], dtype=np.int32)))
    if logprobs is not None:
        entries = [{str(t): v for t, v in entry.items()} for entry in logprobs]
        tensors.append(pb_utils.Tensor("logprobs", np.array([json.dumps(entries).encode()], dtype=np.object_)))
    return tensors


def _optional_input(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _check_parameters(text: str) -> None:
    """Refuse request parameters the model does not read (HTTP ``generate``: unknown top-level fields).

    Raises:
        ValueError: names the unknown fields and where sampling parameters go.
    """
    parameters = json.loads(text) if text else {}
    unknown = sorted(k for k in parameters if not k.startswith(RESERVED_PARAMETER_PREFIX))
    if unknown:
        raise ValueError(
            f"unknown field(s) {unknown}; the inputs are text_input, stream, sampling_parameters (a JSON string "
            'such as "{\\"max_tokens\\": 32}") and exclude_input_in_output'
        )


class TritonPythonModel:
    """Decoupled LLM model: one ``AsyncLLMEngine`` per instance, on an event-loop thread."""

    limits = None  # the engine's RequestLimits (set in initialize; None: the defaults)
    max_model_len = None
    _cancel_watch: CancelWatch | None = None

    def initialize(self, args: dict) -> None:
        # the engine (and torch) load when Triton initializes an instance, not when its stub imports this file
        import torch

        from engine import AsyncLLMEngine, EngineConfig

        self.logger = pb_utils.Logger
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException(
                f"{args['model_name']}: the LLM model must be decoupled; add `model_transaction_policy {{ "
                "decoupled: true }` to config.pbtxt"
            )
        self.model_name = args["model_name"]
        self.dead_reported = False
        version_dir = Path(args["model_repository"]) / args["model_version"]
        info = read_model_info(version_dir)
        self.adapters = AdapterRegistry(version_dir, info)
        self.engine = AsyncLLMEngine(EngineConfig(model=info["checkpoint"], **info.get("engine", {})))
        self.limits = self.engine.engine.config.limits
        self._prepare_grammar_tokenizer()
        self.max_model_len = self.engine.engine.config.max_model_len
        self.logger.log_info(
            f"lmforge: {args['model_name']} engine ready on {info['checkpoint']} (torch threads "
            f"{torch.get_num_threads()})"
        )
        self.metrics = LLMMetrics({"model": args["model_name"], "version": args["model_version"]})
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self._run_loop, name="lmforge-engine-loop", daemon=True)
        self.loop_thread.start()
        self.ongoing: set[asyncio.Future] = set()
        # get_stats waits for the engine step in progress, so it polls on its own thread,
        # never on the event loop that sends the responses.
        self.stop_stats = threading.Event()
        self.stats_thread = threading.Thread(target=self._publish_stats, name="lmforge-stats", daemon=True)
        self.stats_thread.start()

    def _prepare_grammar_tokenizer(self) -> None:
        """Build the grammar library's view of the vocabulary now, before the instance is ready: built on the
        first structured request instead, it holds the interpreter long enough (0.5 s for SmolLM2's 49k tokens on
        a shared core) to miss the heartbeats the frontend waits for. A tokenizer it cannot read is reported to
        the structured requests themselves, as before."""
        try:
            self.engine.engine.grammar_compiler.tokenizer_future().result(timeout=120)
        except Exception as exc:  # noqa: BLE001 - optional feature; each structured request gets the error
            self.logger.log_warn(f"lmforge: {self.model_name}: structured outputs unavailable: {exc}")

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _publish_stats(self) -> None:
        while not self.stop_stats.wait(STATS_INTERVAL_S):
            try:
                self.metrics.update_stats(self.engine.get_stats())
            except Exception as exc:  # noqa: BLE001 -- metrics must never stop serving
                self.logger.log_warn(f"lmforge: stats update failed: {exc!r}")
            if self.engine.is_dead and not self.stop_stats.is_set():
                self._report_dead()
                return

    def _report_dead(self) -> None:
        """Log why the engine died and unload this model so its readiness stops answering 200."""
        self.dead_reported = True
        self.logger.log_error(
            f"lmforge: {self.model_name} engine is dead ({self.engine.dead_reason}); answering UNAVAILABLE and "
            "unloading the model (`lmforge serve` loads it again; elsewhere load it with POST /v2/repository/models/"
            f"{self.model_name}/load)"
        )
        try:
            pb_utils.unload_model(self.model_name)
        except Exception as exc:  # noqa: BLE001 -- e.g. not in explicit model control mode
            self.logger.log_error(f"lmforge: could not unload {self.model_name} ({exc!r}); restart the server")

    def execute(self, requests):
        """Hand every request to the event loop; responses go through their senders."""
        for request in requests:
            future = asyncio.run_coroutine_threadsafe(self._serve(request), self.loop)
            self.ongoing.add(future)
            future.add_done_callback(self.ongoing.discard)
        return None

    async def _serve(self, request) -> None:
        """Answer one request: parse it, stream the engine's outputs, always end with FINAL."""
        sender = request.get_response_sender()
        if self.engine.is_dead:
            self._send_error(
                sender,
                f"the engine of {self.model_name} is dead ({self.engine.dead_reason}); it is being reloaded, retry",
                pb_utils.TritonError.UNAVAILABLE,
            )
            return
        try:
            _check_parameters(request.parameters())
            parsed = parse_request(
                _optional_input(request, "text_input"),
                _optional_input(request, "stream"),
                _optional_input(request, "sampling_parameters"),
                _optional_input(request, "exclude_input_in_output"),
                _optional_input(request, "prompt_token_ids"),
                limits=self.limits,
                max_model_len=self.max_model_len,
            )
        except ValueError as exc:
            self._send_error(sender, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 -- an unreadable request fails alone
            self.logger.log_error(f"lmforge: unreadable request: {traceback.format_exc()}")
            self._send_error(sender, f"unreadable request: {exc!r}", pb_utils.TritonError.INTERNAL)
            return
        request_id = uuid.uuid4().hex
        stream = None
        try:
            lora = {} if parsed.lora_name is None else {"lora_request": await self._adapter(parsed.lora_name)}
            stream = self.engine.generate(parsed.prompt, parsed.sampling_params, request_id, **lora)
            final_sent, last = await self._stream(parsed, request_id, stream, sender)
        except ValueError as exc:  # the engine refused the request (e.g. prompt over max_model_len)
            self._send_error(sender, str(exc))
            return
        except asyncio.CancelledError:  # the model is being unloaded
            await self.engine.abort(request_id)
            self._close(sender, None)
            raise
        except EngineDeadError as exc:
            self._send_error(
                sender,
                f"the engine of {self.model_name} is dead ({self.engine.dead_reason or exc}); it is being "
                "reloaded, retry",
                pb_utils.TritonError.UNAVAILABLE,
            )
            return
        except Exception as exc:  # noqa: BLE001 -- answer this client, keep serving the others
            self.logger.log_error(f"lmforge: request {request_id} failed: {traceback.format_exc()}")
            await self.engine.abort(request_id)
            self._send_error(sender, f"internal error: {exc!r}", pb_utils.TritonError.INTERNAL)
            return
        finally:
            if hasattr(stream, "aclose"):
                await stream.aclose()
        if not final_sent:
            self._close(sender, last)

    async def _adapter(self, name: str):
        """The ``LoRARequest`` of adapter ``name`` (``deploy.lora_adapters``); adapters unloaded since the last
        look leave the engine's memory (requests already running with one finish on its weights).

        Raises:
            ValueError: an adapter this model does not serve (names it and the served ones).
        """
        for lora_id in self.adapters.refresh():
            await self.engine.remove_lora(lora_id)
        return self.adapters.resolve(name)

    async def _stream(self, request: LLMRequest, request_id: str, stream, sender) -> tuple[bool, object]:
        """Send the engine's outputs; returns (FINAL sent, last output).

        ``CancelWatch`` aborts the request once Triton reports its client cancelled.
        """
        sent = _SentState()
        last = None
        if self._cancel_watch is None:
            self._cancel_watch = CancelWatch(self._client_cancelled)
        cancelled = self._cancel_watch.add(request_id, sender, sent if request.stream else None)
        try:
            async for output in stream:
                last = sent.last = output
                if cancelled.is_set():
                    return False, last
                try:
                    if self._send_output(request, output, sender, sent):
                        return True, last
                except Exception:
                    if not _is_cancelled(sender):
                        raise
                    if not cancelled.is_set():  # the client left between two polls of the watcher
                        self.metrics.aborted.increment(1)
                    return False, last  # closing the stream aborts the engine request
        finally:
            self._cancel_watch.remove(request_id)
        return False, last

    async def _client_cancelled(self, request_id: str) -> None:
        """Abort a request whose client cancelled, whether or not it has output yet."""
        self.metrics.aborted.increment(1)
        await self.engine.abort(request_id)  # the stream ends with the abort output

    def _send_output(self, request: LLMRequest, output, sender, sent: "_SentState") -> bool:
        """Send what ``output`` adds to what ``sent`` records as already sent; returns whether FINAL was sent.

        Streaming: for each completion (``index``; ``n`` of them), a response when its text grew,
        it got logprobs, or it finished. Otherwise one response per completion at the end. The
        request's last response carries FINAL. A completion that finished with ``"error"`` (the
        engine step running it failed) answers the whole request with an error (FINAL); the
        caller closing the stream then aborts its other completions.
        """
        if output.finished:
            self.metrics.finished(output)
        failed = next((c for c in output.outputs if c.finish_reason == "error"), None)
        if failed is not None:
            self._send_error(sender, f"the engine failed this request: {failed.error}", pb_utils.TritonError.INTERNAL)
            return True
        responses = []
        for completion in output.outputs:
            index = completion.index
            if index in sent.done or not (request.stream or output.finished):
                continue
            start_chars, start_tokens = (
                (sent.chars.get(index, 0), sent.tokens.get(index, 0)) if request.stream else (0, 0)
            )
            delta = completion.text[start_chars:]
            new_tokens = completion.token_ids[start_tokens:]
            has_logprobs = completion.logprobs is not None and len(new_tokens) > 0
            if not delta and not has_logprobs and completion.finish_reason is None:
                continue
            sent.chars[index], sent.tokens[index] = len(completion.text), len(completion.token_ids)
            if completion.finish_reason is not None:
                sent.done.add(index)
            if not request.stream and not request.exclude_input_in_output:
                delta = request.prompt_text + delta
            logprobs = completion.logprobs[start_tokens:] if completion.logprobs is not None else None
            finish = completion.finish_reason
            responses.append(
                _output_tensors(delta, output, completion, finish, new_tokens, logprobs, final=finish is not None)
            )
        prompt_logprobs = getattr(output, "prompt_logprobs", None)
        if responses and prompt_logprobs is not None and not sent.prompt_logprobs_sent:
            sent.prompt_logprobs_sent = True  # complete once anything is sent: the prompt ran before the first token
            entries = [None if e is None else {str(t): v for t, v in e.items()} for e in prompt_logprobs]
            responses[0].append(
                pb_utils.Tensor("prompt_logprobs", np.array([json.dumps(entries).encode()], dtype=np.object_))
            )
        for i, tensors in enumerate(responses):
            final = output.finished and i == len(responses) - 1
            sender.send(
                pb_utils.InferenceResponse(tensors), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
            )
        if output.finished and not responses:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        self.metrics.num_responses += len(responses) or output.finished
        return output.finished

    def _send_error(self, sender, message: str, code=None) -> None:
        """An error response with FINAL; bad input is INVALID_ARG (HTTP 400)."""
        self.metrics.errors.increment(1)
        code = pb_utils.TritonError.INVALID_ARG if code is None else code
        response = pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _close(self, sender, last) -> None:
        """Send the FINAL flag of a request that ended without a finished output."""
        try:
            if last is None or sender.is_cancelled():
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:  # the engine stopped it (aborted elsewhere)
                tensors = _output_tensors("", last, last.outputs[0], "abort")
                sender.send(pb_utils.InferenceResponse(tensors), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:  # noqa: BLE001 -- the client is gone; nothing left to tell it
            self.logger.log_verbose(f"lmforge: closing a cancelled request: {exc!r}")

    def finalize(self) -> None:
        """Abort what is in flight, stop the engine and the loop thread."""
        deadline = time.monotonic() + 10.0
        for future in list(self.ongoing):
            future.cancel()
        while self.ongoing and time.monotonic() < deadline:
            time.sleep(0.05)
        self.stop_stats.set()
        self.stats_thread.join(timeout=5)
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            result = shutdown()
            if asyncio.iscoroutine(result):
                asyncio.run_coroutine_threadsafe(result, self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(timeout=10)
