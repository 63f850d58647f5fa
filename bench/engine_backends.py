"""The configurations the engine benchmark compares, each run in its own fresh process.

``python -m bench.engine_backends SPEC.json RESULT.json`` loads one configuration, measures its
start-up (construction to the first token of a short warm-up prompt), runs the whole workload
once, then (``single_prompts`` in the workload) one request alone per prompt, and writes a ``RunResult`` as
JSON. One process per configuration keeps their peak RSS apart. The vLLM and OpenVINO GenAI
configurations run this same module under their own venv's interpreter (``--vllm-python``,
``--openvino-python``): it imports only the standard library at module level, and each backend
imports its own stack (torch, transformers, vLLM, OpenVINO, the engine, ``bench.peers``) inside
its run function.

How time to first token (TTFT) is measured, per configuration (``ttft_basis`` in the result):

* ``hf_sequential``: requests are served one after the other; TTFT is from the start of that
  request's own ``generate`` call to its first new token (a streamer callback), so the wait
  behind earlier requests is excluded.
* ``hf_static``: all requests form one left-padded batch submitted at once; the first new token
  of every request appears after the first (prefill) step, so every request gets that one time.
* ``hf_generate_batch`` / ``engine_*`` / ``vllm_*`` / ``openvino_*`` / ``llama_cpp_server_*``: all
  requests are submitted at once; TTFT is from submission to the request's first new token (includes waiting
  to be scheduled).

Peak RSS: ``ru_maxrss`` of this process (``openvino_*`` included: its pipeline runs in it); for
``vllm_*`` the sampled sum over the processes of its session (vLLM's engine core runs in
processes of its own), for ``llama_cpp_server_*`` the server process's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import resource
import signal
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

#: A short prompt unrelated to the workload, used to warm every configuration up.
WARMUP_TEXT = "The quick brown fox jumps over the lazy dog."


@dataclasses.dataclass
class RunSpec:
    """What one benchmark process runs.

    Attributes:
        config: configuration name (a key of ``BACKENDS``).
        model: checkpoint directory (HF backends, engine).
        workload_path: JSON file with ``prompts`` (token id lists) and ``max_tokens``.
        gguf: GGUF file for a ``llama_cpp_server_*`` configuration; ``None`` makes it unavailable.
        openvino_model: OpenVINO IR directory (``optimum-cli export openvino``) for an
            ``openvino_*`` configuration; ``None`` makes it unavailable.
        llama_server: the ``llama-server`` binary; ``None``: not installed.
        int8_model: INT8 checkpoint dir (``w8a8`` by default) for ``engine_int8``; ``None`` makes it unavailable.
        threads: torch / llama.cpp / OpenVINO threads, ``None`` keeps the library default.
        engine_args: extra ``EngineConfig`` fields for the engine configurations.
        profile: also profile a repeat run of the engine configurations (torch.profiler).
        sequential_limit: serve only the first N requests in ``hf_sequential`` (one at a time,
            so its tok/s does not depend on N); ``None``: all.
        log_dir: where peer servers write their logs (the run's work directory).
    """

    config: str
    model: str
    workload_path: str
    gguf: str | None = None
    openvino_model: str | None = None
    llama_server: str | None = None
    int8_model: str | None = None
    threads: int | None = None
    engine_args: dict = dataclasses.field(default_factory=dict)
    profile: bool = False
    sequential_limit: int | None = None
    log_dir: str | None = None


@dataclasses.dataclass
class SingleResult:
    """One request alone, after the workload (``single_prompts`` of the workload file): the repeat of median
    ``elapsed_s`` (the host's speed swings from one 2-second run to the next), the first prompt's tokens.

    Attributes:
        elapsed_s: from submission to the last token.
        ttft_s: from submission to the first token.
        token_ids: the generated token ids (of the first prompt, the one compared across configurations).
        repeats_elapsed_s: ``elapsed_s`` of every repeat, in run order.
    """

    elapsed_s: float
    ttft_s: float
    token_ids: list[int]
    repeats_elapsed_s: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RunResult:
    """What one configuration measured.

    Attributes:
        config: configuration name.
        status: ``ok``, ``unavailable``, ``not installed`` or ``failed``.
        reason: why it is not ``ok`` (``None`` when it is).
        elapsed_s: wall time of the timed run (all requests, after warm-up).
        output_tokens: new tokens produced in the timed run.
        ttft_s: per request time to first token, seconds (see the module docstring).
        ttft_basis: how ``ttft_s`` was measured.
        peak_rss_bytes: peak resident set size of the process (load + warm-up + run).
        load_s: time to load the model (construct the ``LLM``, start the server).
        startup_s: from the start of loading to the first token of the warm-up prompt.
        single: one request alone (``None`` when the workload has no ``single_prompts`` or the
            configuration has no one-request path).
        prefix_hit_rate: prompt tokens served from the prefix cache / prompt tokens (engine only).
        token_ids: per request, the generated token ids (checked against HF sequential).
        profile_top: top entries of a torch.profiler table of a repeat run (engine, ``--profile``).
        alone: one result per ``Work.alone_prompts`` entry, each request served alone.
    """

    config: str
    status: str = "ok"
    reason: str | None = None
    elapsed_s: float | None = None
    output_tokens: int = 0
    ttft_s: list[float] = dataclasses.field(default_factory=list)
    ttft_basis: str = ""
    peak_rss_bytes: int | None = None
    load_s: float | None = None
    startup_s: float | None = None
    single: SingleResult | None = None
    prefix_hit_rate: float | None = None
    token_ids: list[list[int]] = dataclasses.field(default_factory=list)
    profile_top: str | None = None
    alone: list[SingleResult] = dataclasses.field(default_factory=list)


def run_singles(work: Work, run_one: Callable[[int, list[int]], SingleResult]) -> SingleResult | None:
    """``run_one(i, prompt)`` for each of ``work.single_prompts`` in turn: the run of median ``elapsed_s``
    (the lower middle of an even count) with the first prompt's tokens; ``None`` when there are no prompts."""
    runs = [run_one(i, prompt) for i, prompt in enumerate(work.single_prompts)]
    if not runs:
        return None
    middle = sorted(runs, key=lambda r: r.elapsed_s)[(len(runs) - 1) // 2]
    return SingleResult(middle.elapsed_s, middle.ttft_s, runs[0].token_ids, [r.elapsed_s for r in runs])


class Unavailable(Exception):
    """The configuration cannot run here; the message says why (reported, not raised further)."""


class NotInstalled(Exception):
    """An optional package the configuration needs is missing; the message says how to add it."""


@dataclasses.dataclass
class Work:
    """The workload file a benchmark process reads (written by ``bench.engine_bench``).

    Attributes:
        prompts: per request, the prompt token ids.
        max_tokens: new tokens per request (greedy, EOS ignored).
        single_prompts: token ids of the one-request-alone runs, one request alone each, one after the other
            (``bench.workload.single_prompts``: no shared prefix); empty: no such run.
        single_max_tokens: new tokens of each.
        alone_prompts: token ids of requests run one at a time after the rest, each ending at EOS
            or ``max_tokens`` (``lmforge bench engine --speculative``'s peer rows; vLLM only).
    """

    prompts: list[list[int]]
    max_tokens: int
    single_prompts: list[list[int]] = dataclasses.field(default_factory=list)
    single_max_tokens: int = 64
    alone_prompts: list[list[int]] = dataclasses.field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Hugging Face transformers
# --------------------------------------------------------------------------------------------


class FirstTokenTimer:
    """A ``generate`` streamer that records when the first new tokens arrive.

    ``generate`` calls ``put`` once with the prompt, then once per step with the new tokens of
    the whole batch; the time of the second call is the first-token time.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_time: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        pass


def _greedy_config(tokenizer, max_tokens: int):
    """A ``GenerationConfig``: greedy, exactly ``max_tokens`` new tokens, EOS not a stop."""
    from transformers import GenerationConfig

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad)


def _hf_load(spec: RunSpec, result: RunResult):
    """Load the checkpoint, then warm up on :data:`WARMUP_TEXT` (2 tokens); records ``load_s``
    and ``startup_s`` (to the warm-up's first token)."""
    import torch

    from engine.checkpoint.store import load_causal_lm

    start = time.perf_counter()
    model, tokenizer, _ = load_causal_lm(spec.model)
    model.eval()
    result.load_s = time.perf_counter() - start
    ids = torch.tensor([tokenizer(WARMUP_TEXT).input_ids])
    timer = FirstTokenTimer()
    with torch.inference_mode():
        model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=_greedy_config(tokenizer, 2), streamer=timer
        )
    result.startup_s = timer.first_token_time - start
    return model, tokenizer


def _hf_one(model, config, prompt: list[int]) -> SingleResult:
    """One HF ``generate`` call on one prompt (batch of 1, no padding)."""
    import torch

    ids = torch.tensor([prompt])  # (1, T)
    timer = FirstTokenTimer()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=timer)
    return SingleResult(time.perf_counter() - t0, timer.first_token_time - t0, out[0, ids.shape[1] :].tolist())


def run_hf_sequential(spec: RunSpec, work: Work, result: RunResult) -> None:
    """HF ``generate`` one request at a time (batch of 1, no padding)."""
    model, tokenizer = _hf_load(spec, result)
    config = _greedy_config(tokenizer, work.max_tokens)
    result.ttft_basis = "from the start of the request's own generate call (requests served one by one)"
    start = time.perf_counter()
    for prompt in work.prompts[: spec.sequential_limit]:
        one = _hf_one(model, config, prompt)
        result.ttft_s.append(one.ttft_s)
        result.token_ids.append(one.token_ids)
    result.elapsed_s = time.perf_counter() - start
    result.single = run_singles(
        work, lambda _, prompt: _hf_one(model, _greedy_config(tokenizer, work.single_max_tokens), prompt)
    )


def left_pad(prompts: list[list[int]], pad_id: int):
    """Left-pad token id lists into ``(input_ids, attention_mask)``, both ``(B, T_max)`` long."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def run_hf_static(spec: RunSpec, work: Work, result: RunResult) -> None:
    """HF ``generate`` on all requests as one left-padded static batch (no one-request run: with
    one request it is ``hf_sequential``)."""
    import torch

    model, tokenizer = _hf_load(spec, result)
    config = _greedy_config(tokenizer, work.max_tokens)
    prompts = work.prompts
    ids, mask = left_pad(prompts, config.pad_token_id)
    timer = FirstTokenTimer()
    result.ttft_basis = "all submitted at once; the first step yields every request's first token"
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, generation_config=config, streamer=timer)
    result.elapsed_s = time.perf_counter() - start
    result.ttft_s = [timer.first_token_time - start] * len(prompts)
    result.token_ids = out[:, ids.shape[1] :].tolist()


class _ErrorCollector(logging.Handler):
    """Keeps the ERROR records (with their exceptions) that transformers' batching thread logs."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            self.errors.append(f"{type(exc).__name__}: {exc} (in {Path(frame.filename).name}:{frame.name})")
        else:
            self.errors.append(record.getMessage())


def run_hf_generate_batch(spec: RunSpec, work: Work, result: RunResult) -> None:
    """transformers' own continuous batching (``generate_batch`` machinery, paged ``sdpa``).

    Uses the manager behind ``generate_batch`` with streaming on, to timestamp first tokens.
    The background thread logs its failure instead of raising; the logged error is the reason.
    """
    model, tokenizer = _hf_load(spec, result)
    model.set_attn_implementation("sdpa_paged")
    prompts, max_tokens = work.prompts, work.max_tokens
    collector = _ErrorCollector()
    logging.getLogger("ContinuousBatchingLogger").addHandler(collector)
    config = _greedy_config(tokenizer, max_tokens)
    config.eos_token_id = -1  # the batching manager's own "no EOS"
    result.ttft_basis = "all submitted at once; from submission to the request's first streamed token"
    manager = model.init_continuous_batching(generation_config=config, streaming=True)
    manager.start()
    try:
        start = time.perf_counter()
        ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=max_tokens) for i, p in enumerate(prompts)]
        first: dict[str, float] = {}
        final: dict[str, list[int]] = {}
        deadline = start + 3600
        while len(final) < len(ids) and time.perf_counter() < deadline:
            out = manager.get_result(timeout=0.5)
            if out is None:
                if not manager.is_running():
                    break
                continue
            if out.generated_tokens and out.request_id not in first:
                first[out.request_id] = time.perf_counter()
            if out.status.value == "finished":
                final[out.request_id] = list(out.generated_tokens)
        result.elapsed_s = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=10.0)
    if len(final) < len(ids):
        reason = collector.errors[0] if collector.errors else f"{len(final)}/{len(ids)} requests finished"
        raise Unavailable(reason)
    result.ttft_s = [first[i] - start for i in ids]
    result.token_ids = [final[i] for i in ids]


# --------------------------------------------------------------------------------------------
# llama.cpp's llama-server
# --------------------------------------------------------------------------------------------


def run_llama_cpp_server(spec: RunSpec, work: Work, result: RunResult) -> None:
    """``llama-server`` on the GGUF: one slot per request (``-np``), continuous batching, every
    request streamed from its own client thread, all submitted at once, token ids as prompts.

    Slots keep their own prompt cache (``cache_prompt``), but the shared system prompt is
    computed once per slot: llama-server does not share KV blocks between slots.
    """
    from bench.harness import NOT_INSTALLED
    from bench.peers import PeerError, TreeRssSampler, stream_completion

    if spec.llama_server is None or not Path(spec.llama_server).exists():
        raise NotInstalled(f"llama-server {NOT_INSTALLED}")
    if spec.gguf is None:
        raise Unavailable("no GGUF for this model (the conversion did not run)")
    lens = [len(p) for p in work.prompts] + [len(p) for p in work.single_prompts]
    ctx_per_slot = max(lens) + max(work.max_tokens, work.single_max_tokens) + 16
    warm_ids = _tokenize_warmup(spec.model)
    log = Path(spec.log_dir or ".") / f"{spec.config}.server.log"
    with contextlib.ExitStack() as stack:
        start = time.perf_counter()
        server, note = _start_llama_server(stack, spec, len(work.prompts), ctx_per_slot, log)
        sampler = TreeRssSampler(server.proc.pid).start()
        result.load_s = time.perf_counter() - start
        warm = stream_completion(server.base_url, warm_ids, 2)
        result.startup_s = warm.first_token_time - start
        result.ttft_basis = (
            "all submitted at once (one client thread each); from submission to the first streamed token" + note
        )
        with ThreadPoolExecutor(max_workers=len(work.prompts)) as pool:
            start = time.perf_counter()
            futures = [pool.submit(stream_completion, server.base_url, p, work.max_tokens) for p in work.prompts]
            done = [f.result() for f in futures]
        result.elapsed_s = max(c.end_time for c in done) - start
        for c in done:
            if len(c.token_ids) != work.max_tokens:
                raise PeerError(
                    f"llama-server returned {len(c.token_ids)} tokens, not {work.max_tokens} (stop_type {c.stop_type})"
                )
        result.ttft_s = [c.first_token_time - start for c in done]
        result.token_ids = [c.token_ids for c in done]

        def one_alone(_: int, prompt: list[int]) -> SingleResult:
            t0 = time.perf_counter()
            one = stream_completion(server.base_url, prompt, work.single_max_tokens)
            return SingleResult(one.end_time - t0, one.first_token_time - t0, one.token_ids)

        result.single = run_singles(work, one_alone)
        result.peak_rss_bytes = sampler.stop()


def _tokenize_warmup(model: str) -> list[int]:
    """:data:`WARMUP_TEXT` as token ids of ``model``'s tokenizer (every peer gets token ids)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)(WARMUP_TEXT, add_special_tokens=False).input_ids


def _start_llama_server(stack: contextlib.ExitStack, spec: RunSpec, n_parallel: int, ctx_per_slot: int, log: Path):
    """Start ``llama-server``; if it dies of a signal while loading (here: SIGILL or SIGSEGV in
    ggml's AMX kernels for Q8_0, which weight repacking selects on CPUs that report AMX), start
    it again with ``--no-repack``. Returns ``(server, note for the TTFT basis)``.

    Raises:
        PeerError: it does not come up either way.
    """
    from bench.peers import LlamaServer, PeerError

    def server(extra: tuple[str, ...]) -> LlamaServer:
        return LlamaServer(
            Path(spec.llama_server),
            Path(spec.gguf),
            n_parallel=n_parallel,
            ctx_per_slot=ctx_per_slot,
            threads=spec.threads,
            log_path=log,
            extra_args=extra,
        )

    first = server(())
    try:
        return stack.enter_context(first), ""
    except PeerError:
        if first.exit_code is None or first.exit_code >= 0:
            raise
    died = signal.Signals(-first.exit_code).name
    return stack.enter_context(
        server(("--no-repack",))
    ), f"; run with --no-repack (with weight repacking it died of {died} while loading)"


# --------------------------------------------------------------------------------------------
# vLLM (runs under the vLLM venv's interpreter)
# --------------------------------------------------------------------------------------------


def _vllm_generate(
    llm, prompts: list[list[int]], max_tokens: int, tag: str, ignore_eos: bool = True
) -> tuple[float, list[float], list[list[int]]]:
    """All prompts submitted at once to vLLM's ``LLMEngine``, stepped until done (what
    ``LLM.generate`` does), stamping each request's first token as it appears; greedy, EOS
    ignored unless ``ignore_eos`` is false.

    Returns ``(elapsed_s, ttft_s per request, token ids per request)``.

    Raises:
        RuntimeError: requests still unfinished after an hour.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)), params)
    first: dict[str, float] = {}
    final: dict[str, list[int]] = {}
    deadline = start + 3600.0
    while engine.has_unfinished_requests() and time.perf_counter() < deadline:
        for out in engine.step():
            now = time.perf_counter()
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                final[out.request_id] = list(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    missing = [i for i in ids if i not in final]
    if missing:
        raise RuntimeError(f"vLLM left {len(missing)} of {len(ids)} requests unfinished")
    return elapsed, [first[i] - start for i in ids], [final[i] for i in ids]


def _vllm_run(spec: RunSpec, work: Work, result: RunResult, dtype: str) -> None:
    """vLLM's offline ``LLM`` on the same checkpoint and token ids, prefix caching on, greedy."""
    try:
        from vllm import LLM
    except ImportError as exc:
        from bench.harness import NOT_INSTALLED

        raise NotInstalled(
            f"vllm is not importable by {sys.executable} ({exc}); {NOT_INSTALLED} or pass --vllm-python"
        ) from exc
    from bench.peers import TreeRssSampler

    sampler = TreeRssSampler(os.getpid(), session=True).start()
    start = time.perf_counter()
    llm = LLM(model=spec.model, dtype=dtype, enable_prefix_caching=True, seed=0)
    result.load_s = time.perf_counter() - start
    warm = llm.get_tokenizer()(WARMUP_TEXT).input_ids
    submitted = time.perf_counter()
    _, warm_ttft, _ = _vllm_generate(llm, [warm], 2, "warmup")
    result.startup_s = submitted - start + warm_ttft[0]
    result.ttft_basis = "all submitted at once; from submission to the request's first token (engine step loop)"
    if work.prompts:
        result.elapsed_s, result.ttft_s, result.token_ids = _vllm_generate(llm, work.prompts, work.max_tokens, "run")

    def one_alone(i: int, prompt: list[int]) -> SingleResult:
        elapsed, ttft, tokens = _vllm_generate(llm, [prompt], work.single_max_tokens, f"single-{i}")
        return SingleResult(elapsed, ttft[0], tokens[0])

    result.single = run_singles(work, one_alone)
    for i, prompt in enumerate(work.alone_prompts):
        elapsed, ttft, tokens = _vllm_generate(llm, [prompt], work.max_tokens, f"alone-{i}", ignore_eos=False)
        result.alone.append(SingleResult(elapsed, ttft[0], tokens[0]))
    result.peak_rss_bytes = max(sampler.stop(), peak_rss_bytes())


def run_vllm_fp32(spec: RunSpec, work: Work, result: RunResult) -> None:
    """vLLM-CPU, fp32 weights and activations."""
    _vllm_run(spec, work, result, "float32")


def run_vllm_bf16(spec: RunSpec, work: Work, result: RunResult) -> None:
    """vLLM-CPU, bf16 weights and activations."""
    _vllm_run(spec, work, result, "bfloat16")


# --------------------------------------------------------------------------------------------
# OpenVINO GenAI (runs under the OpenVINO venv's interpreter)
# --------------------------------------------------------------------------------------------

#: KV cache of the OpenVINO pipeline, GiB: as much as vLLM's (``bench.peers.vllm_env``), several
#: times what the workload holds.
OPENVINO_CACHE_GIB = 1


def openvino_properties(precision_hint: str, threads: int | None) -> dict[str, object]:
    """The CPU plugin properties of an ``openvino_*`` pipeline: the precision its matmuls and
    attention run in (``f32`` or ``bf16``; the weights are the IR's) and, when given, the
    inference threads (else OpenVINO's default: every core). Everything else, the 8-bit KV
    cache included, stays OpenVINO's default, as a user gets it."""
    props: dict[str, object] = {"INFERENCE_PRECISION_HINT": precision_hint}
    if threads:
        props["INFERENCE_NUM_THREADS"] = int(threads)
    return props


def openvino_scheduler_fields() -> dict[str, object]:
    """``SchedulerConfig`` fields set on the pipeline (the rest keep OpenVINO's defaults: 256
    batched tokens a step with prompts split across steps, 256 sequences): prefix caching on, as
    in every other continuous-batching row, and the KV cache size in GiB."""
    return {"enable_prefix_caching": True, "cache_size": OPENVINO_CACHE_GIB}


def _openvino_generate(
    pipe, prompts: list[list[int]], config, tensor: Callable[[list[int]], object], first_id: int
) -> tuple[float, list[float], list[list[int]]]:
    """All prompts submitted at once to a ``ContinuousBatchingPipeline``, stepped until done, each
    request's first token stamped when a step yields it (``GenerationHandle.read`` returns the
    tokens of the steps not read yet).

    Args:
        pipe: the pipeline (``add_request``, ``step``, ``has_non_finished_requests``).
        prompts: token ids per request.
        config: the ``GenerationConfig`` (greedy, ``max_new_tokens``, EOS ignored).
        tensor: token ids -> the ``(1, T)`` int64 ``ov.Tensor`` ``add_request`` takes.
        first_id: request id of the first prompt (ids must not repeat within a pipeline).

    Returns ``(elapsed_s, ttft_s per request, token ids per request)``.

    Raises:
        RuntimeError: unfinished after an hour, a request not ``FINISHED`` (e.g. ``IGNORED``: it
            did not fit the KV cache), or one with other than ``max_new_tokens`` tokens.
    """
    start = time.perf_counter()
    handles = [pipe.add_request(first_id + i, tensor(list(p)), config) for i, p in enumerate(prompts)]
    first: list[float | None] = [None] * len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    deadline = start + 3600.0
    while pipe.has_non_finished_requests():
        if time.perf_counter() > deadline:
            raise RuntimeError("OpenVINO GenAI requests still unfinished after 3600 s")
        pipe.step()
        now = time.perf_counter()
        for i, handle in enumerate(handles):
            while handle.can_read():
                for out in handle.read().values():  # one sequence per request (greedy)
                    if out.generated_ids and first[i] is None:
                        first[i] = now
                    tokens[i].extend(int(t) for t in out.generated_ids)
    elapsed = time.perf_counter() - start
    statuses = [handle.get_status().name for handle in handles]
    if any(s != "FINISHED" for s in statuses):
        bad = sorted({s for s in statuses if s != "FINISHED"})
        raise RuntimeError(
            f"OpenVINO GenAI ended {sum(s != 'FINISHED' for s in statuses)} of {len(prompts)} requests {'/'.join(bad)}"
        )
    short = [len(t) for t in tokens if len(t) != config.max_new_tokens]
    if short:
        raise RuntimeError(
            f"OpenVINO GenAI returned {short[0]} tokens, not {config.max_new_tokens} ({len(short)} requests)"
        )
    return elapsed, [f - start for f in first], tokens


def _openvino_run(spec: RunSpec, work: Work, result: RunResult, precision_hint: str) -> None:
    """OpenVINO GenAI's ``ContinuousBatchingPipeline`` on the exported IR, on the CPU, with the
    same token ids; prefix caching on, greedy, EOS ignored."""
    try:
        import numpy as np
        import openvino as ov
        import openvino_genai
    except ImportError as exc:
        from bench.harness import NOT_INSTALLED

        raise NotInstalled(
            f"openvino_genai is not importable by {sys.executable} ({exc}); {NOT_INSTALLED} or pass --openvino-python"
        ) from exc
    if spec.openvino_model is None:
        raise Unavailable("no OpenVINO IR for this model (the export did not run)")
    scheduler = openvino_genai.SchedulerConfig()
    for field, value in openvino_scheduler_fields().items():
        setattr(scheduler, field, value)
    start = time.perf_counter()
    pipe = openvino_genai.ContinuousBatchingPipeline(
        spec.openvino_model, scheduler, "CPU", openvino_properties(precision_hint, spec.threads)
    )
    result.load_s = time.perf_counter() - start

    def tensor(prompt: list[int]):
        return ov.Tensor(np.array([prompt], dtype=np.int64))

    def greedy(max_tokens: int):
        return openvino_genai.GenerationConfig(max_new_tokens=max_tokens, ignore_eos=True, do_sample=False)

    submitted = time.perf_counter()
    _, warm_ttft, _ = _openvino_generate(pipe, [_tokenize_warmup(spec.model)], greedy(2), tensor, 0)
    result.startup_s = submitted - start + warm_ttft[0]
    result.ttft_basis = "all submitted at once; from submission to the step that yields the request's first token"
    if work.prompts:
        result.elapsed_s, result.ttft_s, result.token_ids = _openvino_generate(
            pipe, work.prompts, greedy(work.max_tokens), tensor, 1
        )

    def one_alone(i: int, prompt: list[int]) -> SingleResult:
        elapsed, ttft, tokens = _openvino_generate(
            pipe, [prompt], greedy(work.single_max_tokens), tensor, 1 + len(work.prompts) + i
        )
        return SingleResult(elapsed, ttft[0], tokens[0])

    result.single = run_singles(work, one_alone)


def run_openvino_fp32(spec: RunSpec, work: Work, result: RunResult) -> None:
    """OpenVINO GenAI, fp32 IR, f32 inference precision."""
    _openvino_run(spec, work, result, "f32")


def run_openvino_bf16(spec: RunSpec, work: Work, result: RunResult) -> None:
    """OpenVINO GenAI, fp32 IR, bf16 inference precision (the CPU plugin's default where the CPU has bf16)."""
    _openvino_run(spec, work, result, "bf16")


def run_openvino_int8(spec: RunSpec, work: Work, result: RunResult) -> None:
    """OpenVINO GenAI, IR with NNCF int8 weights (``--weight-format int8``), bf16 inference precision."""
    _openvino_run(spec, work, result, "bf16")


# --------------------------------------------------------------------------------------------
# Our engine
# --------------------------------------------------------------------------------------------


def _engine_run(
    spec: RunSpec,
    model: str,
    work: Work,
    result: RunResult,
    *,
    prefix_caching: bool,
    dtype: str | None,
    kv_cache_dtype: str | None = None,
) -> None:
    """Our ``LLM`` on the token ids; ``dtype`` and ``kv_cache_dtype`` (when given) override ``--engine-arg``."""
    from engine import LLM, SamplingParams

    engine_args = {
        **spec.engine_args,
        **({"dtype": dtype} if dtype else {}),
        **({"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype else {}),
    }
    start = time.perf_counter()
    llm = LLM(model, enable_prefix_caching=prefix_caching, **engine_args)
    result.load_s = time.perf_counter() - start
    submitted = time.perf_counter()
    warm = llm.generate([WARMUP_TEXT], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    result.startup_s = submitted - start + warm[0].metrics.ttft_s
    params = SamplingParams(temperature=0.0, max_tokens=work.max_tokens, ignore_eos=True)
    stats_before = _engine_prefix_counters(llm)
    result.ttft_basis = "all submitted at once; from submission (arrival) to the request's first token"
    start = time.perf_counter()
    outputs = llm.generate([list(p) for p in work.prompts], params)
    result.elapsed_s = time.perf_counter() - start
    result.ttft_s = [o.metrics.ttft_s for o in outputs]
    result.token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    result.prefix_hit_rate = _prefix_hit_rate(llm, outputs, stats_before)

    def one_alone(_: int, prompt: list[int]) -> SingleResult:
        t0 = time.perf_counter()
        one = llm.generate(
            [list(prompt)], SamplingParams(temperature=0.0, max_tokens=work.single_max_tokens, ignore_eos=True)
        )[0]
        return SingleResult(time.perf_counter() - t0, one.metrics.ttft_s, list(one.outputs[0].token_ids))

    result.single = run_singles(work, one_alone)
    if spec.profile:
        result.peak_rss_bytes = peak_rss_bytes()  # before the profiler's own memory
        result.profile_top = _profile(lambda: llm.generate([list(p) for p in work.prompts], params))


def _engine_prefix_counters(llm) -> tuple[int, int] | None:
    """``(queries, hits)`` prefix-cache token counters from the engine's stats, if it has them."""
    engine = getattr(llm, "llm_engine", None) or getattr(llm, "engine", None)
    get_stats = getattr(engine, "get_stats", None) or getattr(llm, "get_stats", None)
    if get_stats is None:
        return None
    stats = get_stats()
    queries = getattr(stats, "prefix_cache_queries_tokens_total", None)
    hits = getattr(stats, "prefix_cache_hits_tokens_total", None)
    return None if queries is None or hits is None else (int(queries), int(hits))


def _prefix_hit_rate(llm, outputs, before: tuple[int, int] | None) -> float | None:
    """Hit rate of the timed run: engine stats counters if present, else per-request cached tokens."""
    after = _engine_prefix_counters(llm)
    if before is not None and after is not None and after[0] > before[0]:
        return (after[1] - before[1]) / (after[0] - before[0])
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    cached = [getattr(o.metrics, "num_cached_tokens", None) for o in outputs]
    if prompt_tokens == 0 or any(c is None for c in cached):
        return None
    return sum(cached) / prompt_tokens


def _profile(fn: Callable[[], object], rows: int = 15) -> str:
    """Run ``fn`` under torch.profiler (CPU) and return the top ``rows`` ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    wall_s = time.perf_counter() - start
    averages = prof.key_averages()
    ops_s = sum(e.self_cpu_time_total for e in averages) / 1e6
    head = (
        f"profiled run: {wall_s:.2f} s wall, {ops_s:.2f} s self CPU in torch ops "
        f"(the rest, {max(wall_s - ops_s, 0.0):.2f} s, is Python, scheduling and profiler overhead)"
    )
    return head + "\n" + averages.table(sort_by="self_cpu_time_total", row_limit=rows)


def run_engine_prefix_off(spec: RunSpec, work: Work, result: RunResult) -> None:
    """Our engine, fp32, prefix caching off."""
    _engine_run(spec, spec.model, work, result, prefix_caching=False, dtype="float32")


def run_engine_fp32(spec: RunSpec, work: Work, result: RunResult) -> None:
    """Our engine, fp32, prefix caching on."""
    _engine_run(spec, spec.model, work, result, prefix_caching=True, dtype="float32")


def run_engine_bf16(spec: RunSpec, work: Work, result: RunResult) -> None:
    """Our engine, bf16 weights and activations, prefix caching on."""
    _engine_run(spec, spec.model, work, result, prefix_caching=True, dtype="bfloat16")


def run_engine_bf16_kv8(spec: RunSpec, work: Work, result: RunResult) -> None:
    """Our engine, bf16, with the int8 KV cache (``kv_cache_dtype="int8"``), prefix caching on."""
    _engine_run(spec, spec.model, work, result, prefix_caching=True, dtype="bfloat16", kv_cache_dtype="int8")


def run_engine_int8(spec: RunSpec, work: Work, result: RunResult) -> None:
    """Our engine on the INT8 checkpoint (``w8a8`` unless ``--int8`` names another), prefix caching on."""
    if spec.int8_model is None:
        raise Unavailable("no INT8 checkpoint: pass --int8 DIR (from `lmforge quantize --method w8a8`)")
    _engine_run(spec, spec.int8_model, work, result, prefix_caching=True, dtype=None)


@dataclasses.dataclass(frozen=True)
class Backend:
    """One configuration of the benchmark.

    Attributes:
        run: fills a ``RunResult`` from a ``RunSpec`` and the workload.
        dtype: the matmul dtype it runs (``fp32``, ``bf16``, ``int8``): its fraction of the
            compute bound is taken against that dtype's measured peak.
        interpreter: ``ours`` (this venv), ``vllm`` (``--vllm-python``) or ``openvino``
            (``--openvino-python``).
        gguf_type: converter ``--outtype`` of the GGUF it serves (``llama_cpp_server_*``).
        openvino_weights: ``--weight-format`` of the OpenVINO IR it runs (``openvino_*``).
    """

    run: Callable[[RunSpec, Work, RunResult], None]
    dtype: str
    interpreter: str = "ours"
    gguf_type: str | None = None
    openvino_weights: str | None = None


#: Configuration name -> how it runs, in table order.
BACKENDS: dict[str, Backend] = {
    "hf_sequential": Backend(run_hf_sequential, "fp32"),
    "hf_static": Backend(run_hf_static, "fp32"),
    "hf_generate_batch": Backend(run_hf_generate_batch, "fp32"),
    "llama_cpp_server_f32": Backend(run_llama_cpp_server, "fp32", gguf_type="f32"),
    "llama_cpp_server_q8_0": Backend(run_llama_cpp_server, "int8", gguf_type="q8_0"),
    "vllm_fp32": Backend(run_vllm_fp32, "fp32", interpreter="vllm"),
    "vllm_bf16": Backend(run_vllm_bf16, "bf16", interpreter="vllm"),
    "openvino_fp32": Backend(run_openvino_fp32, "fp32", interpreter="openvino", openvino_weights="fp32"),
    "openvino_bf16": Backend(run_openvino_bf16, "bf16", interpreter="openvino", openvino_weights="fp32"),
    "openvino_int8": Backend(run_openvino_int8, "int8", interpreter="openvino", openvino_weights="int8"),
    "engine_prefix_off": Backend(run_engine_prefix_off, "fp32"),
    "engine_fp32": Backend(run_engine_fp32, "fp32"),
    "engine_bf16": Backend(run_engine_bf16, "bf16"),
    "engine_bf16_kv8": Backend(run_engine_bf16_kv8, "bf16"),
    "engine_int8": Backend(run_engine_int8, "int8"),
}


def peak_rss_bytes() -> int:
    """Peak resident set size of this process, bytes (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_spec(spec: RunSpec) -> RunResult:
    """Run one configuration in this process; failures become a result with a reason."""
    result = RunResult(config=spec.config)
    if spec.config not in BACKENDS:
        return dataclasses.replace(
            result, status="failed", reason=f"unknown config {spec.config!r}; known: {', '.join(BACKENDS)}"
        )
    if spec.threads and BACKENDS[spec.config].interpreter == "ours":
        import torch

        torch.set_num_threads(spec.threads)
    work = Work(**json.loads(Path(spec.workload_path).read_text()))
    try:
        BACKENDS[spec.config].run(spec, work, result)
    except NotInstalled as exc:
        result.status, result.reason = "not installed", str(exc)
    except Unavailable as exc:
        result.status, result.reason = "unavailable", str(exc)
    except Exception as exc:  # reported in the table; the other configurations still run
        result.status, result.reason = "failed", f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    if result.status == "ok":
        result.output_tokens = sum(len(t) for t in result.token_ids)
    if result.peak_rss_bytes is None:
        result.peak_rss_bytes = peak_rss_bytes()
    return result


def main(argv: list[str]) -> int:
    """``python -m bench.engine_backends SPEC.json RESULT.json``."""
    if len(argv) != 2:
        print("usage: python -m bench.engine_backends SPEC.json RESULT.json", file=sys.stderr)
        return 2
    spec = RunSpec(**json.loads(Path(argv[0]).read_text()))
    result = run_spec(spec)
    Path(argv[1]).write_text(json.dumps(dataclasses.asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
