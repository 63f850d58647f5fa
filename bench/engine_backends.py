"""The configurations the engine benchmark compares, each run in its own fresh process.

``python -m bench.engine_backends SPEC.json RESULT.json`` loads one configuration, warms it up
on an unrelated short prompt, runs the whole workload once, and writes a ``RunResult`` as JSON.
One process per configuration keeps their peak RSS (``getrusage`` ``ru_maxrss``) apart.

How time to first token (TTFT) is measured, per configuration (``ttft_basis`` in the result):

* ``hf_sequential`` / ``llama_cpp``: requests are served one after the other; TTFT is from the
  start of that request's own ``generate`` call to its first new token (a streamer callback),
  so the wait behind earlier requests is excluded.
* ``hf_static``: all requests form one left-padded batch submitted at once; the first new token
  of every request appears after the first (prefill) step, so every request gets that one time.
* ``hf_generate_batch`` / ``engine*``: all requests are submitted at once; TTFT is from
  submission to the request's first new token (includes waiting to be scheduled).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import resource
import sys
import time
import traceback
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
        gguf: GGUF file for ``llama_cpp``; ``None`` makes it unavailable.
        int8_model: ``dynamic`` INT8 checkpoint dir for ``engine_int8``; ``None`` makes it unavailable.
        threads: torch / llama.cpp threads, ``None`` keeps the library default.
        engine_args: extra ``EngineConfig`` fields for the engine configurations.
        profile: also profile a repeat run of the engine configurations (torch.profiler).
        sequential_limit: serve only the first N requests in the one-at-a-time configurations
            (``hf_sequential``, ``llama_cpp``), whose tok/s does not depend on N; ``None``: all.
    """

    config: str
    model: str
    workload_path: str
    gguf: str | None = None
    int8_model: str | None = None
    threads: int | None = None
    engine_args: dict = dataclasses.field(default_factory=dict)
    profile: bool = False
    sequential_limit: int | None = None


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
        load_s: time to load the model.
        prefix_hit_rate: prompt tokens served from the prefix cache / prompt tokens (engine only).
        token_ids: per request, the generated token ids (checked against HF sequential).
        profile_top: top entries of a torch.profiler table of a repeat run (engine, ``--profile``).
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
    prefix_hit_rate: float | None = None
    token_ids: list[list[int]] = dataclasses.field(default_factory=list)
    profile_top: str | None = None


class Unavailable(Exception):
    """The configuration cannot run here; the message says why (reported, not raised further)."""


class NotInstalled(Exception):
    """An optional package the configuration needs is missing; the message says how to add it."""


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
    from compress.checkpoints import load_causal_lm

    start = time.perf_counter()
    model, tokenizer, _ = load_causal_lm(spec.model)
    model.eval()
    result.load_s = time.perf_counter() - start
    return model, tokenizer


def _hf_warmup(model, tokenizer) -> None:
    import torch

    ids = torch.tensor([tokenizer(WARMUP_TEXT).input_ids])
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=_greedy_config(tokenizer, 2))


def run_hf_sequential(spec: RunSpec, prompts: list[list[int]], max_tokens: int, result: RunResult) -> None:
    """HF ``generate`` one request at a time (batch of 1, no padding)."""
    import torch

    model, tokenizer = _hf_load(spec, result)
    _hf_warmup(model, tokenizer)
    config = _greedy_config(tokenizer, max_tokens)
    result.ttft_basis = "from the start of the request's own generate call (requests served one by one)"
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts[:spec.sequential_limit]:
            ids = torch.tensor([prompt])  # (1, T)
            timer = FirstTokenTimer()
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=timer)
            result.ttft_s.append(timer.first_token_time - t0)
            result.token_ids.append(out[0, ids.shape[1]:].tolist())
    result.elapsed_s = time.perf_counter() - start


def left_pad(prompts: list[list[int]], pad_id: int):
    """Left-pad token id lists into ``(input_ids, attention_mask)``, both ``(B, T_max)`` long."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def run_hf_static(spec: RunSpec, prompts: list[list[int]], max_tokens: int, result: RunResult) -> None:
    """HF ``generate`` on all requests as one left-padded static batch."""
    import torch

    model, tokenizer = _hf_load(spec, result)
    _hf_warmup(model, tokenizer)
    config = _greedy_config(tokenizer, max_tokens)
    ids, mask = left_pad(prompts, config.pad_token_id)
    timer = FirstTokenTimer()
    result.ttft_basis = "all submitted at once; the first step yields every request's first token"
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, generation_config=config, streamer=timer)
    result.elapsed_s = time.perf_counter() - start
    result.ttft_s = [timer.first_token_time - start] * len(prompts)
    result.token_ids = out[:, ids.shape[1]:].tolist()


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


def run_hf_generate_batch(spec: RunSpec, prompts: list[list[int]], max_tokens: int, result: RunResult) -> None:
    """transformers' own continuous batching (``generate_batch`` machinery, paged ``sdpa``).

    Uses the manager behind ``generate_batch`` with streaming on, to timestamp first tokens.
    The background thread logs its failure instead of raising; the logged error is the reason.
    """
    model, tokenizer = _hf_load(spec, result)
    model.set_attn_implementation("sdpa_paged")
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
# llama.cpp
# --------------------------------------------------------------------------------------------


def run_llama_cpp(spec: RunSpec, prompts: list[list[int]], max_tokens: int, result: RunResult) -> None:
    """llama.cpp (``llama-cpp-python``) on the GGUF, one request at a time, greedy.

    ``Llama.generate`` keeps the KV cache of the longest prefix shared with the previous
    request, so the shared system prompt is computed once, as llama.cpp users get it.
    """
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        raise NotInstalled(f"llama-cpp-python is not importable ({exc}); `make llama-cpp` builds it") from exc
    if spec.gguf is None:
        raise Unavailable("no GGUF file for this model; pass --gguf FILE")
    n_ctx = max(len(p) for p in prompts) + max_tokens + 16
    kwargs = {"n_threads": spec.threads, "n_threads_batch": spec.threads} if spec.threads else {}
    start = time.perf_counter()
    llm = Llama(model_path=spec.gguf, n_ctx=n_ctx, n_batch=512, verbose=False, **kwargs)
    result.load_s = time.perf_counter() - start
    warm = llm.tokenize(WARMUP_TEXT.encode())
    _llama_cpp_one(llm, warm, 2)
    result.ttft_basis = "from the start of the request's own generate call (requests served one by one)"
    start = time.perf_counter()
    for prompt in prompts[:spec.sequential_limit]:
        t0 = time.perf_counter()
        tokens, first = _llama_cpp_one(llm, prompt, max_tokens)
        result.ttft_s.append(first - t0)
        result.token_ids.append(tokens)
    result.elapsed_s = time.perf_counter() - start


def _llama_cpp_one(llm, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Greedy-generate exactly ``max_tokens`` tokens (EOS ignored); returns them and the first-token time."""
    tokens: list[int] = []
    first = time.perf_counter()
    for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if not tokens:
            first = time.perf_counter()
        tokens.append(int(token))
        if len(tokens) >= max_tokens:
            break
    return tokens, first


# --------------------------------------------------------------------------------------------
# Our engine
# --------------------------------------------------------------------------------------------


def _engine_run(spec: RunSpec, model: str, prompts: list[list[int]], max_tokens: int, result: RunResult, *, prefix_caching: bool) -> None:
    try:
        from engine import LLM, SamplingParams
    except ImportError as exc:
        raise Unavailable(f"engine.LLM is not importable yet ({exc})") from exc
    start = time.perf_counter()
    llm = LLM(model, enable_prefix_caching=prefix_caching, **spec.engine_args)
    result.load_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([WARMUP_TEXT], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    stats_before = _engine_prefix_counters(llm)
    result.ttft_basis = "all submitted at once; from submission (arrival) to the request's first token"
    start = time.perf_counter()
    outputs = llm.generate([list(p) for p in prompts], params)
    result.elapsed_s = time.perf_counter() - start
    result.ttft_s = [o.metrics.ttft_s for o in outputs]
    result.token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    result.prefix_hit_rate = _prefix_hit_rate(llm, outputs, stats_before)
    if spec.profile:
        result.peak_rss_bytes = peak_rss_bytes()  # before the profiler's own memory
        result.profile_top = _profile(lambda: llm.generate([list(p) for p in prompts], params))


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
    head = (f"profiled run: {wall_s:.2f} s wall, {ops_s:.2f} s self CPU in torch ops "
            f"(the rest, {max(wall_s - ops_s, 0.0):.2f} s, is Python, scheduling and profiler overhead)")
    return head + "\n" + averages.table(sort_by="self_cpu_time_total", row_limit=rows)


def run_engine_prefix_off(spec: RunSpec, prompts, max_tokens, result) -> None:
    """Our engine, fp32 checkpoint, prefix caching off."""
    _engine_run(spec, spec.model, prompts, max_tokens, result, prefix_caching=False)


def run_engine_prefix_on(spec: RunSpec, prompts, max_tokens, result) -> None:
    """Our engine, fp32 checkpoint, prefix caching on."""
    _engine_run(spec, spec.model, prompts, max_tokens, result, prefix_caching=True)


def run_engine_int8(spec: RunSpec, prompts, max_tokens, result) -> None:
    """Our engine on the INT8 checkpoint (``w8a8`` unless ``--int8`` names another), prefix caching on."""
    if spec.int8_model is None:
        raise Unavailable("no INT8 checkpoint: pass --int8 DIR (from `lmforge quantize --method w8a8`)")
    _engine_run(spec, spec.int8_model, prompts, max_tokens, result, prefix_caching=True)


#: Configuration name -> the function that runs it, in table order.
BACKENDS: dict[str, Callable[[RunSpec, list[list[int]], int, RunResult], None]] = {
    "hf_sequential": run_hf_sequential,
    "hf_static": run_hf_static,
    "hf_generate_batch": run_hf_generate_batch,
    "llama_cpp": run_llama_cpp,
    "engine_prefix_off": run_engine_prefix_off,
    "engine_prefix_on": run_engine_prefix_on,
    "engine_int8": run_engine_int8,
}


def peak_rss_bytes() -> int:
    """Peak resident set size of this process, bytes (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_spec(spec: RunSpec) -> RunResult:
    """Run one configuration in this process; failures become a result with a reason."""
    result = RunResult(config=spec.config)
    if spec.config not in BACKENDS:
        return dataclasses.replace(result, status="failed", reason=f"unknown config {spec.config!r}; known: {', '.join(BACKENDS)}")
    if spec.threads:
        import torch

        torch.set_num_threads(spec.threads)
    workload = json.loads(Path(spec.workload_path).read_text())
    try:
        BACKENDS[spec.config](spec, workload["prompts"], int(workload["max_tokens"]), result)
    except NotInstalled as exc:
        result.status, result.reason = "not installed", str(exc)
    except Unavailable as exc:
        result.status, result.reason = "unavailable", str(exc)
    except NotImplementedError as exc:
        result.status, result.reason = "unavailable", f"not implemented yet: {exc}"
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
