"""Locust users for an LLM served by Triton's generate extension.

``LLMUser`` POSTs to ``/v2/models/NAME/generate_stream`` (server-sent events, one ``data: {...}``
JSON event per response; ``text_output`` holds the new text, and our model adds
``num_input_tokens``, ``num_output_tokens`` and ``finish_reason``) and reads the body line by line
with ``requests``' ``iter_lines`` as it arrives, so the time to first token is the time the first
text event reached the client. (``FastHttpUser`` is not used: it reads whole bodies, which turns
TTFT into end-to-end latency.) With ``--endpoint generate`` it calls the non-streaming
``/v2/models/NAME/generate`` instead, where only end-to-end latency exists.

With ``--api openai`` the same user streams OpenAI's ``/v1/chat/completions`` (``--endpoint
chat``, the prompt as one user message) or ``/v1/completions`` (``--endpoint completions``), so
the same load runs against our OpenAI frontend, ``vllm serve`` and ``llama-server``; token counts
come from the final chunk's ``usage`` (``stream_options.include_usage``).

Per request it records TTFT, the inter-token latencies, end-to-end latency, and the input and
output token counts (definitions: :mod:`bench.metrics`, after GenAI-Perf and vLLM's
``benchmark_serving``), and fires Locust request events so Locust's own statistics and CSVs show
them: ``POST generate_stream`` with the end-to-end time, and ``TTFT generate_stream`` with the
time to first token. An ``{"error": ...}`` event inside the stream, a non-200 status, a broken
connection or a stream that ends without a final event count as failures.

A fault mix (``--bad-share``, ``--disconnect-share``, used by ``lmforge bench reliability``)
replaces that share of the requests by requests the server must refuse with HTTP 400
(``BAD_REQUESTS``; Locust name ``bad``: a 400 with an error message is a success, anything else a
failure; ``BAD_OPENAI_REQUESTS`` with ``--api openai``) and by streams the client closes after the
first event (Locust name ``disconnect``).

Run it on its own: ``locust -f bench/locustfile.py --host http://127.0.0.1:8000 --model NAME``
(web UI, or ``--headless -u 4 -r 4 -t 60s``), or through ``lmforge loadtest``, which adds exact
percentiles over the raw samples (``--samples-out``), plots and a summary.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from dataclasses import dataclass, field
from typing import IO

import gevent
import requests
from locust import HttpUser, constant, events, task

from bench.loadtest import add_request_options
from bench.metrics import RequestSample
from bench.prompts import load_prompts, with_system_prompt
from bench.protocol import (
    OPENAI_PATHS,
    StreamError,
    StreamResult,
    openai_payload,
    read_openai_stream,
    read_openai_whole,
    read_stream,
    read_whole,
    request_payload,
)

CONNECT_TIMEOUT_S = 5.0
HEALTH_TIMEOUT_S = 2.0


def add_options(parser) -> None:
    """The locustfile's own command-line options (also used by ``bench.locust_runner``)."""
    group = parser.add_argument_group("lmforge LLM load")
    group.add_argument("--model", default=None, help="model name (required): Triton's, or the OpenAI server's")
    group.add_argument(
        "--api", choices=["triton", "openai"], default="triton", help="Triton's generate extension or the OpenAI API"
    )
    group.add_argument(
        "--endpoint",
        choices=["generate_stream", "generate", "chat", "completions"],
        default=None,
        help="triton: generate_stream (TTFT, ITL; default) or generate (E2E only); openai: chat (default) or "
        "completions",
    )
    group.add_argument("--no-stream", action="store_true", help="openai: non-streaming requests (E2E only)")
    group.add_argument("--api-key", default=None, help="send `Authorization: Bearer KEY` (Triton or OpenAI API)")
    add_request_options(group)
    group.add_argument("--samples-out", default=None, help="append one JSON line per request to this file")
    group.add_argument(
        "--bad-share", type=float, default=0.0, help="share of requests replaced by bad ones (expect HTTP 400)"
    )
    group.add_argument(
        "--disconnect-share", type=float, default=0.0, help="share of streams closed after their first event"
    )
    group.add_argument(
        "--keep-going", action="store_true", help="keep sending when the server stops answering (it is expected back)"
    )
    group.add_argument(
        "--lora-names",
        default=None,
        help="comma-separated LoRA adapters: request i runs with the (i mod N)-th (openai: as the model field; "
        "triton: sampling_parameters lora_name)",
    )
    group.add_argument("--response-format", default=None, help="openai: the response_format of every request (JSON)")
    group.add_argument("--record-text", action="store_true", help="keep each request's output text in its sample")


#: Requests the model must refuse with HTTP 400 (sampling_parameters JSON; None = a top-level unknown field).
BAD_REQUESTS = [
    {"sampling_parameters": json.dumps({"logprobs": 100000, "max_tokens": 4})},
    {"sampling_parameters": json.dumps({"max_tokens": "4"})},
    {"sampling_parameters": json.dumps({"temperature": "hot"})},
    {"sampling_parameters": json.dumps({"max_tokens": 10**7})},
    {"sampling_parameters": json.dumps({"stop_token_ids": [10**9]})},
    {"sampling_parameters": json.dumps({"seed": -5})},
    {"sampling_parameters": "[" * 20000},
    {"sampling_parameters": "[1, 2]"},
    {"sampling_parameters": "{not json"},
    {"sampling_parameters": json.dumps({"top_p": 0})},
    {"sampling_parameters": "{}", "temperature": 0},
    {"sampling_parameters": "{}", "text_input": ""},
]

#: The same for ``--api openai``: overrides of the JSON body the OpenAI API must refuse with HTTP 400.
BAD_OPENAI_REQUESTS = [
    {"max_tokens": 10**7},
    {"temperature": "hot"},
    {"top_logprobs": 3},
    {"logit_bias": {"999999999": 1}},
    {"no_such_field": 1},
    {"stream_options": {"include_usage": True}},
]


@events.init_command_line_parser.add_listener
def _on_parser(parser) -> None:
    add_options(parser)


@dataclass
class LoadConfig:
    """What every user sends; built once per test from the parsed options."""

    model: str
    endpoint: str
    prompts: list[str]
    sampling_parameters: dict
    request_timeout_s: float
    seed: int
    bad_share: float = 0.0
    disconnect_share: float = 0.0
    api: str = "triton"
    stream: bool = True
    api_key: str | None = None
    system_prompt: str | None = None  # openai chat: sent as a system message (elsewhere put before each prompt)
    lora_names: list[str] = field(default_factory=list)  # request i runs with lora_names[i % N] (none: the base)
    record_text: bool = False  # keep the output text in each sample

    def path(self, stream: bool | None = None) -> str:
        """The request path; for Triton ``stream`` picks generate_stream or generate (default: ``self.stream``)."""
        if self.api == "openai":
            return OPENAI_PATHS[self.endpoint]
        stream = self.stream if stream is None else stream
        return f"/v2/models/{self.model}/{'generate_stream' if stream else 'generate'}"

    @property
    def health_path(self) -> str:
        return "/health" if self.api == "openai" else "/v2/health/live"

    @property
    def bad_requests(self) -> list[dict]:
        """Body overrides the server must refuse with HTTP 400 (``BAD_REQUESTS`` or ``BAD_OPENAI_REQUESTS``)."""
        return BAD_OPENAI_REQUESTS if self.api == "openai" else BAD_REQUESTS

    def payload(self, prompt: str, stream: bool | None = None, index: int = 0) -> dict:
        """The request body; with ``lora_names``, request ``index`` names adapter ``index % N``."""
        stream = self.stream if stream is None else stream
        lora = self.lora_names[index % len(self.lora_names)] if self.lora_names else None
        if self.api == "openai":
            return openai_payload(
                prompt,
                self.sampling_parameters,
                model=lora or self.model,
                endpoint=self.endpoint,
                stream=stream,
                system=self.system_prompt,
            )
        sampling = self.sampling_parameters if lora is None else {**self.sampling_parameters, "lora_name": lora}
        return request_payload(prompt, sampling, stream=stream)

    def reader(self):
        if self.api == "openai":
            return read_openai_stream if self.stream else read_openai_whole
        return read_stream if self.stream else read_whole


@dataclass
class RunState:
    """Shared by all users of one Locust process (greenlets, so no locking)."""

    config: LoadConfig
    samples: list[RequestSample] = field(default_factory=list)
    in_flight: int = 0
    sink: IO[str] | None = None
    server_unreachable: str | None = None
    prompt_counter: itertools.count = field(default_factory=itertools.count)
    fault_rng: random.Random = field(default_factory=lambda: random.Random(0))

    def record(self, kind: str, payload: dict) -> None:
        """Append one JSON line ``{"kind": kind, ...}`` to the samples file (flushed at once)."""
        if self.sink is not None:
            self.sink.write(json.dumps({"kind": kind, **payload}) + "\n")
            self.sink.flush()


def config_from_options(options) -> LoadConfig:
    """Build the :class:`LoadConfig` from parsed options.

    Raises:
        ValueError: no ``--model``, or ``--max-tokens < 1``.
        bench.prompts.PromptError: the prompts cannot be read.
    """
    if not options.model:
        raise ValueError("--model is required: the Triton model name to load-test")
    if options.max_tokens < 1:
        raise ValueError(f"--max-tokens={options.max_tokens}; it must be >= 1")
    api = getattr(options, "api", "triton")
    endpoint = options.endpoint or ("chat" if api == "openai" else "generate_stream")
    allowed = ("chat", "completions") if api == "openai" else ("generate_stream", "generate")
    if endpoint not in allowed:
        raise ValueError(f"--endpoint {endpoint} does not belong to --api {api}; use one of {', '.join(allowed)}")
    bad, disconnect = getattr(options, "bad_share", 0.0), getattr(options, "disconnect_share", 0.0)
    if not (0 <= bad and 0 <= disconnect and bad + disconnect <= 1):
        raise ValueError(f"--bad-share={bad}, --disconnect-share={disconnect}; each must be >= 0 and their sum <= 1")
    system_message = api == "openai" and endpoint == "chat"  # a real system message, not a prefix
    prompts = load_prompts(options.prompts, limit=options.num_prompts)
    if not system_message:
        prompts = with_system_prompt(prompts, options.system_prompt)
    sampling = {"max_tokens": options.max_tokens, "temperature": options.temperature, "top_p": options.top_p}
    if options.ignore_eos:
        sampling["ignore_eos"] = True
    response_format = getattr(options, "response_format", None)
    if response_format:
        if api != "openai":
            raise ValueError("--response-format belongs to --api openai; drop it or use --api openai")
        sampling["response_format"] = json.loads(response_format)
    stream = endpoint == "generate_stream" if api == "triton" else not getattr(options, "no_stream", False)
    return LoadConfig(
        options.model,
        endpoint,
        prompts,
        sampling,
        options.request_timeout_s,
        options.seed,
        bad,
        disconnect,
        api=api,
        stream=stream,
        api_key=getattr(options, "api_key", None),
        system_prompt=options.system_prompt if system_message else None,
        lora_names=[n.strip() for n in (getattr(options, "lora_names", None) or "").split(",") if n.strip()],
        record_text=getattr(options, "record_text", False),
    )


@events.test_start.add_listener
def _on_test_start(environment, **_kwargs) -> None:
    if getattr(environment, "lmforge_state", None) is not None:
        return
    options = environment.parsed_options
    state = RunState(config_from_options(options))
    state.fault_rng.seed(options.seed)
    if getattr(options, "samples_out", None):
        state.sink = open(options.samples_out, "a", encoding="utf-8")  # closed at quit
    environment.lmforge_state = state


@events.quitting.add_listener
def _on_quitting(environment, **_kwargs) -> None:
    state = getattr(environment, "lmforge_state", None)
    if state is not None and state.sink is not None:
        state.sink.close()
        state.sink = None


class LLMUser(HttpUser):
    """One closed-loop client: sends a request, waits for the whole answer, sends the next.

    Prompts are taken round-robin from a shared counter, so ``U`` users together cover the
    prompt set in order (the same prompts for every run with the same seed).
    """

    wait_time = constant(0)

    @task
    def generate(self) -> None:
        state: RunState = self.environment.lmforge_state
        if state.server_unreachable is not None:
            gevent.sleep(0.5)
            return
        config = state.config
        prompts = config.prompts
        index = next(state.prompt_counter)
        prompt = prompts[(index + config.seed) % len(prompts)]
        draw = state.fault_rng.random()
        fault = (
            "bad"
            if draw < config.bad_share
            else "disconnect"
            if draw < config.bad_share + config.disconnect_share
            else None
        )
        stream = (config.stream and fault is None) or fault == "disconnect"  # bad: a non-streaming request (a 400)
        path = config.path(stream)
        state.in_flight += 1
        sample = RequestSample(
            start_s=time.time(),
            e2e_s=0.0,
            concurrency=state.in_flight,
            users=self.environment.runner.user_count if self.environment.runner else 1,
            endpoint=config.endpoint if config.api == "openai" else path.rsplit("/", 1)[-1],
            fault=fault,
        )
        payload = config.payload(prompt, stream, index)
        try:
            if fault == "bad":
                bad = config.bad_requests
                self._send_bad(state, path, {**payload, **bad[index % len(bad)]}, sample)
            elif fault == "disconnect":
                self._send_disconnect(state, path, payload, sample)
            else:
                self._send(state, path, payload, stream, sample)
        finally:
            state.in_flight -= 1
        state.samples.append(sample)
        state.record("request", sample.to_json())

    def _post(
        self,
        state: RunState,
        path: str,
        payload: dict,
        name: str,
        *,
        stream: bool = False,
        read_timeout_s: float = 60.0,
    ):
        """POST ``payload`` as the Locust request ``name`` with the run's API key; the caller marks the response a
        success or a failure (``catch_response``)."""
        return self.client.post(
            path,
            json=payload,
            stream=stream,
            name=name,
            catch_response=True,
            headers=_auth(state.config),
            timeout=(CONNECT_TIMEOUT_S, read_timeout_s),
        )

    def _send(self, state: RunState, path: str, payload: dict, stream: bool, sample: RequestSample) -> None:
        result = StreamResult()
        t0 = time.perf_counter()
        name = path.rsplit("/", 1)[-1]
        with self._post(
            state, path, payload, name, stream=stream, read_timeout_s=state.config.request_timeout_s
        ) as response:
            error = None
            try:
                error = _http_error(response)
                if error is None:
                    state.config.reader()(response, result)
            except StreamError as exc:
                error = str(exc)
            except requests.RequestException as exc:
                error = f"{type(exc).__name__}: {exc}"
            end = time.perf_counter()
            _fill_sample(sample, result, t0, end, error)
            if state.config.record_text:
                sample.text = result.text
            response.request_meta["response_time"] = (end - t0) * 1000.0
            response.request_meta["response_length"] = len(result.text.encode("utf-8"))
            if error is None:
                response.success()
            else:
                response.failure(error)
        if sample.ttft_s is not None:
            self.environment.events.request.fire(
                request_type="TTFT",
                name=name,
                response_time=sample.ttft_s * 1000.0,
                response_length=0,
                exception=None,
                context={},
            )
        if error is not None and _is_connection_error(response):
            self._check_server(state, error)

    def _send_bad(self, state: RunState, path: str, payload: dict, sample: RequestSample) -> None:
        """A request the server must refuse: HTTP 400 with an error message is the success."""
        t0 = time.perf_counter()
        with self._post(state, path, payload, "bad") as response:
            error = _http_error(response)
            sample.e2e_s = time.perf_counter() - t0
            if response.status_code == 400 and error:
                response.success()
            else:
                sample.error = f"expected HTTP 400 with an error, got {error or 'HTTP 200'} for {str(payload)[:120]}"
                response.failure(sample.error)

    def _send_disconnect(self, state: RunState, path: str, payload: dict, sample: RequestSample) -> None:
        """A stream the client closes after its first event (the server must abort it)."""
        t0 = time.perf_counter()
        with self._post(state, path, payload, "disconnect", stream=True) as response:
            error = _http_error(response)
            if error is None:
                try:
                    if not any(line.startswith(b"data:") for line in response.iter_lines(chunk_size=None)):
                        error = "stream ended before its first event"
                except requests.RequestException as exc:
                    error = f"{type(exc).__name__}: {exc}"
            response.close()  # any(...) stopped at the first event: the client goes away mid-stream
            sample.e2e_s = time.perf_counter() - t0
            sample.error = error
            if error is None:
                response.success()
            else:
                response.failure(error)

    def _check_server(self, state: RunState, error: str) -> None:
        """After a connection failure: if the server's health endpoint is gone too, stop the run
        (with ``--keep-going``: pause this user a moment and carry on)."""
        if getattr(self.environment.parsed_options, "keep_going", False):
            gevent.sleep(0.25)
            return
        if state.server_unreachable is not None:
            return
        try:
            requests.get(f"{self.host}{state.config.health_path}", timeout=HEALTH_TIMEOUT_S).raise_for_status()
            return
        except requests.RequestException as exc:
            state.server_unreachable = f"{error} (then {state.config.health_path}: {type(exc).__name__})"
        state.record("server_unreachable", {"time_s": time.time(), "error": state.server_unreachable})
        gevent.spawn(self.environment.runner.quit)


def _auth(config: LoadConfig) -> dict | None:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None


def _http_error(response) -> str | None:
    if getattr(response, "error", None) is not None and not response.status_code:
        return f"{type(response.error).__name__}: {response.error}"
    if response.status_code != 200:
        try:
            detail = response.json().get("error", response.text)
        except ValueError:
            detail = response.text
        return f"HTTP {response.status_code}: {str(detail)[:300]}"
    return None


def _is_connection_error(response) -> bool:
    return not response.status_code or isinstance(getattr(response, "error", None), requests.ConnectionError)


def _fill_sample(sample: RequestSample, result: StreamResult, t0: float, end: float, error: str | None) -> None:
    sample.e2e_s = end - t0
    sample.error = error
    times = result.chunk_times
    if times:
        sample.ttft_s = times[0] - t0
        sample.itl_s = [b - a for a, b in zip(times, times[1:])]
    sample.output_tokens = result.output_tokens if result.output_tokens is not None else len(times)
    sample.input_tokens = result.input_tokens
    sample.finish_reason = result.finish_reason
