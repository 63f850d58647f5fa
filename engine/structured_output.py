"""Structured output: a grammar per request, applied as a token mask at sampling time (llguidance).

``SamplingParams.structured_outputs`` names a JSON schema, a regex, a list of choices, a Lark /
GBNF grammar or "any JSON object". ``GrammarCompiler`` turns it into an llguidance matcher on a
thread pool, off the engine step, and keeps compiled grammars in an LRU keyed by ``grammar_key``
(``StructuredOutputsParams.key`` with a JSON schema's property order kept); a request waits in
the scheduler until its grammar is ready (``Sequence.waits_for_grammar``) and fails alone when
compiling fails or takes longer than ``compile_timeout_s``. Every sequence then owns a copy of
the compiled matcher (``SequenceGrammar``): one bitmask row per constrained sequence is filled and the
logits of disallowed tokens are set to -inf (greedy and sampled rows alike; for a masked-greedy step
the fill runs on a mask thread during the model forward, ``GrammarCompiler.start_masks``); the engine
advances the matcher with every accepted token and finishes the request when nothing can follow.

llguidance (guidance-ai) was chosen over xgrammar on our vocabulary: it compiles a 5-field JSON
schema in about a millisecond where xgrammar takes about a second, and xgrammar's strings with
``maxLength`` admit raw control characters (invalid JSON); docs/serving.md has the figures.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import threading
import time

import torch

from engine import cpu_ops
from engine.errors import UsageError
from engine.sampling_params import StructuredOutputsParams

#: Seconds a grammar may take to compile before its requests fail (llguidance's own fuel limits
#: bound most grammars far below this).
DEFAULT_COMPILE_TIMEOUT_S = 10.0
#: Compiled grammars kept (least recently used dropped first).
DEFAULT_CACHE_SIZE = 128
#: Threads compiling grammars (a compile releases the GIL).
DEFAULT_COMPILE_THREADS = 2
#: Longest grammar error message passed on to the client, in characters.
MAX_ERROR_CHARS = 500


class GrammarError(UsageError):
    """A structured-output constraint that cannot be used (invalid, unsatisfiable or too slow to compile)."""


def byte_level_tokenizer_json(tokenizer) -> str:
    """The ``tokenizer.json`` text of a Hugging Face fast tokenizer, as llguidance should read it.

    A byte-level BPE vocabulary (``ByteLevel`` pre-tokenizer) converted from GGUF gets a decoder
    ``Sequence`` (byte fallback, "▁" replacement, then ``ByteLevel``); llguidance then reads
    tokens such as "Ġ" as their UTF-8 bytes instead of the byte they stand for (a space), and
    masks every token that starts with a space wrongly. The decoder of such a vocabulary is
    replaced by its ``ByteLevel`` step; other tokenizers are passed on unchanged.
    """
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    pre, decoder = data.get("pre_tokenizer") or {}, data.get("decoder") or {}
    pre_types = {pre.get("type")} | {p.get("type") for p in pre.get("pretokenizers", [])}
    if "ByteLevel" in pre_types and decoder.get("type") == "Sequence":
        byte_level = [d for d in decoder.get("decoders", []) if d.get("type") == "ByteLevel"]
        if byte_level:
            data["decoder"] = byte_level[0]
    return json.dumps(data)


def grammar_key(params: StructuredOutputsParams) -> tuple[str, str]:
    """``(kind, spec text)`` compiled and cached for ``params``: ``params.key``, except that a JSON schema
    keeps the order of each ``properties`` map (its other keys sorted).

    llguidance generates an object's properties in the order the schema lists them, so the order is
    part of the constraint: sorted, a tool call's ``arguments`` would come before its ``name``.
    """
    kind, text = params.key
    if kind == "json":
        value = json.loads(params.json) if isinstance(params.json, str) else params.json
        text = json.dumps(_keep_property_order(value), separators=(",", ":"))
    return kind, text


def _keep_property_order(value, in_properties: bool = False):
    """``value`` with dict keys sorted, except those of a ``properties`` map (property names, in schema order)."""
    if isinstance(value, list):
        return [_keep_property_order(v) for v in value]
    if not isinstance(value, dict):
        return value
    names = value if in_properties else sorted(value)
    return {k: _keep_property_order(value[k], not in_properties and k == "properties") for k in names}


class CompiledGrammar:
    """A compiled constraint: an llguidance matcher at its start state (copied per sequence)."""

    def __init__(self, key: tuple[str, str], matcher, compile_s: float) -> None:
        self.key = key
        self._matcher = matcher
        self.compile_s = compile_s

    def new_matcher(self):
        return self._matcher.deep_copy()


class GrammarCompiler:
    """Compiles constraints on a thread pool and caches them (the engine owns one).

    Args:
        tokenizer: the engine's Hugging Face tokenizer (a fast one).
        vocab_size: the model's vocabulary size (logit columns; may exceed the tokenizer's).
        eos_token_ids: ids that end a sequence; allowed only where the output is complete.
        compile_timeout_s: how long a request waits for its grammar before it fails.
        cache_size: compiled grammars kept in the LRU.
        max_workers: compile threads.

    The llguidance tokenizer (one to a few seconds to build) is built on the pool when the first
    constraint arrives, so an engine that never sees one never pays for it; a request's compile
    time bound counts from when that tokenizer is ready (``deadline``).
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: set[int],
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        cache_size: int = DEFAULT_CACHE_SIZE,
        max_workers: int = DEFAULT_COMPILE_THREADS,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self.cache_size = cache_size
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="lmforge-grammar")
        self._cache: collections.OrderedDict[tuple[str, str], concurrent.futures.Future] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._tokenizer_future: concurrent.futures.Future | None = None
        self.tokenizer_ready_at: float | None = None  # time.monotonic() when the llguidance tokenizer was built
        self._mask_thread: concurrent.futures.ThreadPoolExecutor | None = None
        #: Cost counters (``EngineStats.structured_output_*``): compiles done and their seconds, and
        #: the masking of logits: seconds the engine thread spends on it (a fill on the mask thread counts
        #: only where the step waits for it), steps and rows masked (tokens).
        self.num_compiles = 0
        self.compile_s_total = 0.0
        self.mask_s_total = 0.0
        self.num_mask_steps = 0
        self.num_masked_tokens = 0

    def submit(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """The future ``CompiledGrammar`` of ``params``: cached, or compiling now on the pool.

        A failed compile is dropped from the cache (the next request with that key compiles again,
        e.g. after a timeout caused by a busy machine). Thread-safe.
        """
        key = grammar_key(params)
        self.tokenizer_future()  # queued first: a compile waits for it, so it must never queue behind one
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, key)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: self._forget_failed(key, f))
        return future

    def tokenizer_future(self) -> concurrent.futures.Future:
        """The build of the llguidance tokenizer (started on the pool by the first call)."""
        with self._lock:
            if self._tokenizer_future is None:
                self._tokenizer_future = self._pool.submit(self._build_tokenizer)
            return self._tokenizer_future

    def deadline(self, submitted_at: float) -> float | None:
        """When a compile asked for at ``submitted_at`` (``time.monotonic()``) times out: ``compile_timeout_s``
        after the later of that and the tokenizer being ready; ``None`` while the tokenizer is being built."""
        if self.tokenizer_ready_at is None:
            return None
        return max(submitted_at, self.tokenizer_ready_at) + self.compile_timeout_s

    def timeout_error(self, key: tuple[str, str]) -> GrammarError:
        return GrammarError(
            f"structured_outputs.{key[0]}: compiling the grammar took longer than {self.compile_timeout_s:g} s; "
            "simplify the schema, pattern or grammar"
        )

    def _forget_failed(self, key: tuple[str, str], future: concurrent.futures.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            return
        with self._lock:
            if self._cache.get(key) is future:
                del self._cache[key]

    def _build_tokenizer(self):
        # optional dependency: imported on the path that needs it
        import llguidance

        try:
            tokenizer = llguidance.LLTokenizer(
                byte_level_tokenizer_json(self.tokenizer), n_vocab=self.vocab_size, eos_token=self.eos_token_ids
            )
        except Exception as exc:
            raise GrammarError(
                f"structured_outputs: this model's tokenizer cannot be read for grammar masks ({_short(str(exc))})"
            ) from exc
        self.tokenizer_ready_at = time.monotonic()
        return tokenizer

    def _compile(self, key: tuple[str, str]) -> CompiledGrammar:
        """Build the matcher and its first mask (llguidance builds its lexer lazily, on the first mask).

        Raises:
            GrammarError: the constraint is invalid, unsupported, or admits no output at all.
        """
        import llguidance

        start = time.perf_counter()
        kind, spec = key
        try:
            if kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=_JSON_OPTIONS)
            elif kind == "json_object":
                grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(spec)
            elif kind == "choice":
                grammar = llguidance.grammar_from("choice", spec)
            else:
                grammar = llguidance.grammar_from("grammar", spec)
        except ValueError as exc:
            raise GrammarError(f"structured_outputs.{kind}: {_short(str(exc))}") from exc
        limits = llguidance.LLParserLimits(verbose_errors=False)
        tokenizer = self.tokenizer_future().result()  # raises its GrammarError when the build failed
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        mask = b"" if matcher.is_error() else matcher.compute_bitmask()
        error = matcher.get_error() if matcher.is_error() else None  # the first mask can fail too (its lexer)
        # llguidance names an empty start state (a regex such as ``[a&&b]``) by its internal error
        # ``NoExtensionBias``: that is "matches no text", said as below
        if error and "NoExtensionBias" not in error:
            raise GrammarError(f"structured_outputs.{kind}: {_short(error)}; fix the {_WHAT[kind]}")
        if error or not any(mask):
            raise GrammarError(f"structured_outputs.{kind}: the {_WHAT[kind]} matches no text; fix it")
        compile_s = time.perf_counter() - start
        with self._lock:  # compiles finish on several pool threads
            self.num_compiles += 1
            self.compile_s_total += compile_s
        return CompiledGrammar(key, matcher, compile_s)

    # ---------------------------------------------------------------- masks (engine thread)

    def mask_logits(self, logits: torch.Tensor, grammars: list[SequenceGrammar], rows: list[int]) -> None:
        """Set ``logits[rows[j]]`` (``[S, vocab]``, in place) to -inf where ``grammars[j]`` disallows the token
        (other rows: untouched); its wall time and rows go to the cost counters (one ``perf_counter`` pair a step).
        """
        start = time.perf_counter()
        bitmask = torch.full((logits.shape[0], bitmask_words(logits.shape[-1])), -1, dtype=torch.int32)  # [S, words]
        self.fill_bitmask(grammars, rows, bitmask)
        apply_bitmask(logits, bitmask)
        self._count_mask(time.perf_counter() - start, len(rows))

    def start_masks(self, grammars: list[SequenceGrammar], rows: list[int], num_rows: int) -> PendingMasks:
        """Fill the next-token bitmask of ``grammars`` (row ``rows[j]`` of ``num_rows``) on the mask thread, while
        the caller runs the model forward; ``PendingMasks.apply`` then masks the logits.

        The grammars' next tokens depend only on the tokens already accepted, so the fill (native code,
        GIL released) overlaps the forward instead of following it, as SGLang's overlap scheduler fills
        masks on the CPU while the GPU runs the forward. The matchers belong to the mask thread until
        ``PendingMasks.wait`` returns.
        """
        if self._mask_thread is None:
            self._mask_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmforge-mask")
        return PendingMasks(self, rows, self._mask_thread.submit(self._fill_new_bitmask, grammars, rows, num_rows))

    def _fill_new_bitmask(self, grammars: list[SequenceGrammar], rows: list[int], num_rows: int) -> torch.Tensor:
        """The bitmask ``[num_rows, words]`` int32 of ``grammars`` at ``rows``; other rows allow every token."""
        bitmask = torch.full((num_rows, bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
        self.fill_bitmask(grammars, rows, bitmask)
        return bitmask

    def _count_mask(self, seconds: float, num_rows: int) -> None:
        self.mask_s_total += seconds
        self.num_mask_steps += 1
        self.num_masked_tokens += num_rows

    def stats(self) -> dict[str, float]:
        """The cost counters as ``EngineStats`` fields."""
        return dict(
            structured_output_num_compiles_total=self.num_compiles,
            structured_output_compile_seconds_total=self.compile_s_total,
            structured_output_mask_seconds_total=self.mask_s_total,
            structured_output_num_mask_steps_total=self.num_mask_steps,
            structured_output_num_masked_tokens_total=self.num_masked_tokens,
        )

    def fill_bitmask(self, grammars: list[SequenceGrammar], rows: list[int], bitmask: torch.Tensor) -> None:
        """Write row ``rows[i]`` of ``bitmask`` (``[S, ceil(vocab / 32)]`` int32, CPU, contiguous) from
        ``grammars[i]`` (other rows are left as they are).

        One matcher after another on the calling thread (each call releases the GIL): a row costs tens
        of microseconds, less than handing the rows to llguidance's thread pool and waiting for its
        threads, which the forward's own threads (and other processes) keep off the cores. A matcher
        that fails here (a grammar that exceeds llguidance's per-token limits) allows only end-of-sequence;
        its request then finishes with its error (``SequenceGrammar.error``).
        """
        row_bytes = bitmask.shape[1] * bitmask.element_size()
        for g, row in zip(grammars, rows):
            g.matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), row_bytes)
        for g, row in zip(grammars, rows):
            if g.matcher.is_error():
                g.error = f"structured output failed: {_short(g.matcher.get_error())}"
                bitmask[row] = 0
                for t in self.eos_token_ids:
                    bitmask[row, t // 32] |= _bit(t % 32)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._mask_thread is not None:
            self._mask_thread.shutdown(wait=False)


class PendingMasks:
    """The bitmask of one step being filled on the mask thread (``GrammarCompiler.start_masks``)."""

    def __init__(self, compiler: GrammarCompiler, rows: list[int], future: concurrent.futures.Future) -> None:
        self.compiler, self.rows, self.future = compiler, rows, future

    def wait(self) -> None:
        """Return once the fill has ended (the matchers are the engine thread's again); a failed fill raises in
        ``apply``, never here, so it cannot hide the error of a forward that failed first."""
        concurrent.futures.wait([self.future])

    def apply(self, logits: torch.Tensor) -> None:
        """Mask ``logits`` (``[S, vocab]``, in place) once the fill is done. The cost counters get the time the
        engine thread spends here (waiting for the fill, then applying): what the masks add to the step, the
        fill's own time ran beside the forward."""
        start = time.perf_counter()
        apply_bitmask(logits, self.future.result())
        self.compiler._count_mask(time.perf_counter() - start, len(self.rows))


class SequenceGrammar:
    """One sequence's grammar: the compile it waits for, then its own matcher.

    Args:
        compiler: the engine's ``GrammarCompiler``.
        params: the request's constraint.
    """

    def __init__(self, compiler: GrammarCompiler, params: StructuredOutputsParams) -> None:
        self.compiler = compiler
        self.key = grammar_key(params)
        self.submitted_at = time.monotonic()
        self.future = compiler.submit(params)
        self.matcher = None
        self.error: str | None = None  # a failure while generating (the request finishes with it)
        self.poll()

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    @property
    def deadline(self) -> float | None:
        """When its compile times out (``GrammarCompiler.deadline``)."""
        return self.compiler.deadline(self.submitted_at)

    def poll(self) -> GrammarError | None:
        """Take the compiled grammar if it is ready; the error when the compile failed or timed out."""
        if self.matcher is not None:
            return None
        if self.future.done():
            exc = self.future.exception()
            if exc is not None:
                return exc if isinstance(exc, GrammarError) else GrammarError(f"structured_outputs: {exc!r}")
            self.matcher = self.future.result().new_matcher()
            return None
        deadline = self.deadline
        if deadline is not None and time.monotonic() >= deadline:
            return self.compiler.timeout_error(self.key)
        return None

    def accept(self, token_id: int) -> None:
        """Advance the matcher past a sampled token (a token the mask allowed always passes)."""
        if self.error is None and not self.matcher.consume_token(token_id):
            self.error = f"structured output failed: token {token_id} was not allowed by the grammar"

    @property
    def is_terminated(self) -> bool:
        """Nothing more may follow (the output is complete, or end-of-sequence was accepted)."""
        return self.matcher.is_stopped()


def wait_any(grammars: list[SequenceGrammar]) -> None:
    """Block until one of ``grammars``' compiles is done, the earliest deadline passes, or the tokenizer
    they wait for is built (deadlines start then)."""
    futures = [g.future for g in grammars]
    tokenizer = grammars[0].compiler.tokenizer_future()
    if not tokenizer.done():
        futures.append(tokenizer)
    deadlines = [d for d in (g.deadline for g in grammars) if d is not None]
    timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
    concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[i, t]`` to -inf where bit ``t`` of ``bitmask[i]`` is 0, in place
    (``engine.cpu_ops.apply_token_bitmask``: the C++ kernel, or its torch path).

    Args:
        logits: ``[R, vocab]`` float rows.
        bitmask: ``[R, ceil(vocab / 32)]`` int32 on the CPU, token ``t`` at bit ``t % 32`` of word ``t // 32``
            (llguidance's layout; a little-endian host).
    """
    cpu_ops.apply_token_bitmask(logits, bitmask)


def bitmask_words(vocab_size: int) -> int:
    """32-bit words per bitmask row."""
    return (vocab_size + 31) // 32


def _bit(i: int) -> int:
    return -(2**31) if i == 31 else 1 << i  # as a signed int32


def _short(message: str) -> str:
    message = message.replace("<non-verbose/>", "").strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."


#: JSON output without free whitespace: a small model given the choice can emit whitespace forever.
_JSON_OPTIONS = {"whitespace_flexible": False}
_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON schema",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
}
