"""``LLMEngine`` (add requests, step, abort) and the offline ``LLM.generate`` front end.

One step = schedule (scheduler + block manager) -> run the model on the flattened batch (model
runner) -> sample (sampler) -> append tokens, detokenize, check stop conditions, free the blocks
of finished requests. The data flow follows nano-vllm and vLLM's v1 engine core.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC
from pathlib import Path

import torch
from tqdm import tqdm

from engine.block_manager import BlockManager
from engine.checkpoint.store import resolve_checkpoint
from engine.config import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineConfig, resolve_dtype, resolve_kv_cache_dtype
from engine.cuda_graphs import StaticDecodeModelRunner
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import EngineDeadError, InvalidRequestError
from engine.inputs import check_prompt_token_ids
from engine.lora import LoRAError, LoRARequest, adapter_cache_key
from engine.model import read_model_spec
from engine.model_runner import ModelRunner
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.platform import reuse_freed_tensor_memory
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.spec_decode.speculator import Speculator
from engine.stats import EngineStats
from engine.structured_output import GrammarCompiler, SequenceGrammar, wait_any
from engine.threads import ThreadGovernor, proc_stat_readable

#: Longest default context when the checkpoint allows more (bounds rotary tables and KV needs).
DEFAULT_MAX_MODEL_LEN_CAP = 8192
#: Steps failing in a row (none succeeding in between) after which the engine gives up.
MAX_CONSECUTIVE_FAILED_STEPS = 8

logger = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Args:
        config: an ``EngineConfig`` (its ``model`` names the checkpoint).

    Raises:
        ValueError: an inconsistent configuration (also once the checkpoint's limits are known).
        engine.checkpoint.store.CheckpointError: the checkpoint is missing, corrupt or unsupported.
    """

    def __init__(self, config: EngineConfig) -> None:
        # optional or heavy dependency: imported only on the path that needs it
        from transformers import AutoTokenizer

        if config.num_threads is not None and config.device == "cpu":
            torch.set_num_threads(config.num_threads)
        if config.device == "cpu":
            reuse_freed_tensor_memory()
        self.thread_governor = (
            ThreadGovernor(torch.get_num_threads())
            if config.device == "cpu" and config.adaptive_threads and proc_stat_readable()
            else None
        )
        self.path = resolve_checkpoint(config.model)
        spec = read_model_spec(self.path)
        max_model_len = config.max_model_len or min(spec.max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP)
        if max_model_len > spec.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} > the checkpoint's max_position_embeddings="
                f"{spec.max_position_embeddings}; decrease max_model_len"
            )
        dtype = resolve_dtype(config.dtype, config.device)
        config = config.replace(dtype=dtype, kv_cache_dtype=resolve_kv_cache_dtype(config.kv_cache_dtype, dtype))
        self.runner = make_model_runner(config, self.path, max_model_len)
        self.lora_manager = (
            self.runner.enable_lora(config.max_loras, config.max_lora_rank, config.max_cpu_loras)
            if config.enable_lora
            else None
        )
        num_blocks = config.num_kv_blocks or self._blocks_from_budget(config, max_model_len)
        self.config = config = config.replace(
            max_model_len=max_model_len, num_kv_blocks=num_blocks, kv_cache_memory_bytes=None
        )
        self.runner.allocate_kv_cache(num_blocks)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.eos_token_ids = read_eos_token_ids(self.path, self.tokenizer)
        self.sampler = Sampler(self.eos_token_ids)
        self.speculator = Speculator.build(config, self.path, self.tokenizer, spec.vocab_size)
        self.grammar_compiler = GrammarCompiler(self.tokenizer, spec.vocab_size, self.eos_token_ids)
        self._grammar_waiting: list[Sequence] = []  # sequences whose grammar is compiling
        self.requests: dict[str, Sequence] = {}  # unfinished sequences by sequence id
        self.groups: dict[str, list[Sequence]] = {}  # request id -> its ``n`` sequences
        self._seed_rng = random.Random(config.seed)
        self._next_id = 0
        self.num_steps_total = 0
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.num_requests_finished_total = 0
        self.num_failed_steps_total = 0
        self.num_consecutive_failed_steps = 0

    def _blocks_from_budget(self, config: EngineConfig, max_model_len: int) -> int:
        budget = config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES
        per_block = self.runner.kv_bytes_per_block()
        blocks_per_seq = -(-max_model_len // config.block_size)
        num_blocks = min(budget // per_block, config.max_num_seqs * blocks_per_seq)
        if num_blocks * config.block_size < max_model_len:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} holds {num_blocks} blocks of {per_block} bytes = "
                f"{num_blocks * config.block_size} tokens < max_model_len={max_model_len}; "
                "increase kv_cache_memory_bytes or decrease max_model_len"
            )
        return int(num_blocks)

    # ---------------------------------------------------------------- requests

    def new_request_id(self) -> str:
        self._next_id += 1
        return f"req-{self._next_id}"

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request (``params.n`` sequences); returns its id.

        Args:
            request_id: unique among unfinished requests; ``None`` picks one.
            prompt: text, token ids, ``{"prompt_token_ids": [...]}`` or ``{"prompt": text}``.
            params: ``SamplingParams`` (default: ``SamplingParams()``).
            lora_request: the LoRA adapter it runs with (``enable_lora``); ``None``: the base.

        With ``n`` > 1 the completions are sequences ``{request_id}-{i}`` that share the
        prompt's full KV blocks through the prefix cache (the scheduler lets the first compute
        them); their outputs come back together under ``request_id``.

        Raises:
            ValueError: empty prompt, prompt too long for ``max_model_len``, token ids out of the
                vocabulary, a bad sampling parameter, a duplicate ``request_id``, or a LoRA adapter the
                engine cannot serve (``engine.lora.LoRAError``); nothing is queued.
        """
        request_id = self.new_request_id() if request_id is None else str(request_id)
        if isinstance(params, SamplingParams):
            self.config.limits.check_params(params)  # n bounds the ids below
        self._sequence_ids(
            request_id, params.n if isinstance(params, SamplingParams) else 1
        )  # a duplicate fails before tokenizing
        params, text, token_ids = self.validate_request(prompt, params, lora_request)
        return self.add_validated_request(request_id, text, token_ids, params, arrival_time, lora_request)

    def add_validated_request(
        self,
        request_id: str | None,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request that ``validate_request`` accepted (its prompt is not tokenized again); returns its id.

        ``params.n`` sequences, as in ``add_request``.

        Raises:
            ValueError: a duplicate ``request_id``, or a ``lora_request`` on an engine without LoRA; nothing is
                queued.
        """
        request_id = self.new_request_id() if request_id is None else str(request_id)
        n = params.n
        seq_ids = self._sequence_ids(request_id, n)
        lora_hash = None if lora_request is None else self._lora_key(lora_request)
        base_seed = params.seed
        if base_seed is None and not params.greedy:
            base_seed = self._seed_rng.getrandbits(62)
        group = []
        for index, seq_id in enumerate(seq_ids):
            child = (
                params
                if n == 1
                else dataclasses.replace(params, n=1, seed=None if base_seed is None else base_seed + index)
            )
            generator = None
            if not params.greedy:
                generator = torch.Generator(device=self.config.device).manual_seed(base_seed + index)
            seq = Sequence(
                seq_id,
                text,
                token_ids,
                child,
                IncrementalDetokenizer(self.tokenizer, token_ids),
                generator,
                arrival_time,
            )
            seq.group_id, seq.index = request_id, index
            seq.lora_request, seq.lora_hash = lora_request, lora_hash
            if params.structured_outputs is not None:
                seq.grammar = SequenceGrammar(self.grammar_compiler, params.structured_outputs)
                if seq.waits_for_grammar:
                    self._grammar_waiting.append(seq)
            if params.prompt_logprobs is not None and index == 0:  # the prompt is the same for all n
                seq.prompt_logprobs = [None]
            group.append(seq)
            self.requests[seq_id] = seq
            self.scheduler.add(seq)
        self.groups[request_id] = group
        return request_id

    def _sequence_ids(self, request_id: str, n: int) -> list[str]:
        """The sequence ids of a request of ``n`` completions; ValueError if any is in use."""
        seq_ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
        if request_id in self.groups or any(i in self.requests for i in seq_ids):
            raise ValueError(f"request_id={request_id!r} is already in use by an unfinished request; pick another id")
        return seq_ids

    def validate_request(
        self, prompt: str | list[int] | dict, params: SamplingParams | None, lora_request: LoRARequest | None = None
    ) -> tuple[SamplingParams, str | None, list[int]]:
        """Check a request against the limits and the model without queueing it (safe from any thread).

        The cheap checks run first: ``EngineConfig.limits`` on the parameters and the prompt text
        (``engine.limits.RequestLimits``), then the prompt is tokenized and its length and the
        model-dependent fields are checked (``SamplingParams.check_for_model``).

        A ``lora_request``'s adapter is read and checked against the base here (and kept loaded).

        Returns:
            (a private copy of ``params``, the prompt text or ``None``, the prompt token ids).

        Raises:
            InvalidRequestError (a ValueError): a bad prompt, a limit exceeded, a sampling parameter out of
                range for this model, or a LoRA adapter the engine cannot serve (``engine.lora.LoRAError``); the
                message names the field and the fix, ``param`` the field.
        """
        params = self._check_params(params)
        self.config.limits.check_params(params)
        self._check_lora(lora_request)
        text, token_ids = self._tokenize(prompt)
        params.check_for_model(self.runner.spec.vocab_size, self.config.max_model_len, len(token_ids))
        return params, text, token_ids

    def _check_lora(self, lora_request: LoRARequest | None) -> int | None:
        """Load and check the adapter (``LoRAManager.check``); its prefix-cache key (``None`` for the base).

        Raises:
            LoRAError: a bad adapter, or the engine runs without LoRA.
        """
        if lora_request is None:
            return None
        self._lora_key(lora_request)
        return self.lora_manager.check(lora_request)

    def _lora_key(self, lora_request: LoRARequest) -> int:
        """The adapter's prefix-cache key, without loading it (it was checked by ``validate_request``)."""
        if self.lora_manager is None:
            raise LoRAError(
                f"lora_request={lora_request!r} but the engine runs without LoRA",
                fix="start it with enable_lora=True (`--enable-lora`)",
            )
        if not isinstance(lora_request, LoRARequest):
            raise LoRAError(f"lora_request={lora_request!r}", fix="pass an engine.lora.LoRARequest")
        return adapter_cache_key(lora_request)

    # ---------------------------------------------------------------- LoRA adapters

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter ahead of its requests (vLLM's ``add_lora``); True once it is in memory.

        Raises:
            LoRAError: see ``engine.lora.load_adapter``; or the engine runs without LoRA.
        """
        self._check_lora(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Drop adapter ``lora_id`` from memory and its slot; True if it was there. Requests still queued
        with it read it from disk again when they run (they fail, naming the file, if it is gone)."""
        return self.lora_manager is not None and self.lora_manager.remove(lora_id)

    def list_loras(self) -> set[int]:
        """Ids of the adapters in memory."""
        return set() if self.lora_manager is None else {r.lora_int_id for r in self.lora_manager.list_loras()}

    @staticmethod
    def _check_params(params: SamplingParams | None) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params={params!r}; pass a SamplingParams")
        return dataclasses.replace(params)  # a private, re-validated copy

    def _tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            prompt = _unwrap_prompt_dict(prompt)
        limits = self.config.limits
        if isinstance(prompt, str):
            limits.check_prompt_text(prompt)
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidRequestError(
                    f"prompt is not valid Unicode text ({exc.reason} at position {exc.start}); send UTF-8 text",
                    param="prompt",
                ) from exc
            token_ids = self.tokenizer(prompt).input_ids
            text: str | None = prompt
        elif isinstance(prompt, SequenceABC) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids, text = list(prompt), None
        else:
            raise InvalidRequestError(
                'prompt must be a string, a list of token ids or {"prompt_token_ids": [...]}, got '
                f"{type(prompt).__name__}",
                param="prompt",
            )
        limits.check_prompt_tokens(len(token_ids), self.config.max_model_len)
        return text, check_prompt_token_ids(token_ids, self.runner.spec.vocab_size, self.config.max_model_len)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort unfinished requests (unknown or finished ids are ignored); their blocks are freed now.

        Returns:
            The final output (``finish_reason="abort"``) of each request aborted.
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for request_id in ids:
            group = self.groups.pop(request_id, None)
            if group is None:
                continue
            for seq in group:
                self.requests.pop(seq.request_id, None)
                if not seq.is_finished:
                    self._finish(seq, SequenceStatus.FINISHED_ABORTED)
                    seq.finished_time = time.monotonic()
                    self.num_requests_finished_total += 1
            outputs.append(self._output(group))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------- one step

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return outputs of requests that got a token or finished.

        An exception in the model, the sampler or the detokenizer fails only the requests it
        touched: they finish with ``finish_reason="error"`` (``CompletionOutput.error`` says
        why), their blocks are freed, and the engine goes on with the others.

        Raises:
            EngineDeadError: the KV bookkeeping is broken after a failure, or
                ``MAX_CONSECUTIVE_FAILED_STEPS`` steps failed in a row.
        """
        if self.thread_governor is not None:
            self.thread_governor.maybe_adjust()
        touched = self._poll_grammars()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, num_waiting=len(self.scheduler.waiting))
        out = self.scheduler.schedule()
        self._activate_loras(out, touched)
        if out.is_empty:
            return self._group_outputs(touched)
        self.num_steps_total += 1
        try:
            sampled, new_tokens, new_logprobs = self._run_batch(out)
        except Exception as exc:  # noqa: BLE001 - fails this step's requests, not the engine
            return self._group_outputs(touched) + self._fail_step([item.seq for item in out.scheduled], exc)
        self.num_consecutive_failed_steps = 0
        now = time.monotonic()
        for seq, tokens, logprobs in zip(sampled, new_tokens, new_logprobs):
            try:
                self._process_tokens(seq, tokens, logprobs, now)
            except Exception as exc:  # noqa: BLE001 - e.g. the detokenizer: this request only
                logger.exception("request %s failed after its step", seq.request_id)
                if not seq.is_finished:
                    self._finish_with_error(seq, exc)
            if seq.is_finished:
                self.requests.pop(seq.request_id, None)
            touched.setdefault(seq.group_id, self.groups[seq.group_id])
        return self._group_outputs(touched)

    def _activate_loras(self, out, touched: dict[str, list[Sequence]]) -> None:
        """Put the step's adapters into LoRA slots (reading one from disk again if it left memory).

        A request whose adapter cannot be loaded (its files were removed or damaged since it was
        queued) finishes with ``"error"`` naming the file and leaves the step (its group joins
        ``touched``); the others run.
        """
        if self.lora_manager is None:
            return
        needed = {item.seq.lora_request for item in out.scheduled if item.seq.lora_request is not None}
        failed: dict[LoRARequest, Exception] = {}
        for lora in sorted(needed, key=lambda r: r.lora_int_id):
            try:
                self.lora_manager.activate(lora, needed)
            except Exception as exc:  # noqa: BLE001 - fails this adapter's requests only
                failed[lora] = exc
        if not failed:
            return
        dropped = [item for item in out.scheduled if item.seq.lora_request in failed]
        out.scheduled = [item for item in out.scheduled if item.seq.lora_request not in failed]
        out.num_batched_tokens -= sum(item.num_new_tokens for item in dropped)
        dropped_blocks = {block for item in dropped for block in item.seq.block_table}
        out.kv_copies = [copy for copy in out.kv_copies if copy[1] not in dropped_blocks]
        for item in dropped:
            seq = item.seq
            logger.error("request %s: its LoRA adapter cannot be loaded: %s", seq.request_id, failed[seq.lora_request])
            if not seq.is_finished:
                self._finish_with_error(seq, failed[seq.lora_request])
            self.requests.pop(seq.request_id, None)
            touched.setdefault(seq.group_id, self.groups[seq.group_id])

    def _poll_grammars(self) -> dict[str, list[Sequence]]:
        """Requests whose structured-output grammar finished compiling become schedulable; those whose
        compile failed or timed out finish with ``"error"`` (returned as touched groups). When nothing
        else can run, wait for the first compile to end (or the earliest compile deadline)."""
        touched: dict[str, list[Sequence]] = {}
        if not self._grammar_waiting:
            return touched
        if not self.scheduler.running and all(s.waits_for_grammar for s in self.scheduler.waiting):
            wait_any([s.grammar for s in self._grammar_waiting if not s.is_finished])
        waiting = []
        for seq in self._grammar_waiting:
            if seq.is_finished:
                continue
            error = seq.grammar.poll()
            if error is not None:
                self._finish_with_error(seq, error)
                self.requests.pop(seq.request_id, None)
                touched.setdefault(seq.group_id, self.groups[seq.group_id])
            elif seq.waits_for_grammar:
                waiting.append(seq)
        self._grammar_waiting = waiting
        return touched

    def _group_outputs(self, touched: dict[str, list[Sequence]]) -> list[RequestOutput]:
        """One output per request touched; finished requests leave ``groups``."""
        outputs = []
        for request_id, group in touched.items():
            output = self._output(group)
            if output.finished:
                self.groups.pop(request_id, None)
            outputs.append(output)
        return outputs

    def _run_batch(self, out) -> tuple[list[Sequence], list[list[int]], list[list]]:
        """Model forward + sampling (or verification) + KV bookkeeping of one scheduled batch.

        Returns:
            The sequences that sampled, their new tokens (already appended by the scheduler)
            and the logprobs entries of those tokens.
        """
        start = time.perf_counter()
        items = [item for item in out.scheduled if item.samples]
        # Plain greedy rows (verified ones too: an argmax match) take the argmax of the model-dtype
        # logits, with or without speculation, so a speculative engine picks exactly the tokens of a
        # plain one wherever the forward is the same (the float32 copy is exact, but costs a pass).
        scoring = any(item.prompt_logprob_positions for item in out.scheduled)
        seqs = [item.seq for item in items]
        greedy = Sampler.is_plain_greedy(seqs) and not scoring
        # Greedy rows under grammars: masked before the bf16 refinement, so they stay on the argmax path
        # (no float32 copy of every row) and the refined winner is an allowed token.
        masked = not greedy and not scoring and self.speculator is None and Sampler.is_masked_greedy(seqs)
        pending = self._start_masks(seqs) if masked else None  # filled on the mask thread during the forward
        try:
            logits = self.runner.execute(
                out, float_logits=not (greedy or masked), mask=None if pending is None else pending.apply
            )  # [R + P, vocab]: 1 row per sampling item, 1 + m per speculative one, then the prompt-logprob rows
        finally:
            if pending is not None:
                pending.wait()  # the matchers are this thread's again, even when the forward failed
        if self.speculator is not None:
            self.speculator.observe_step(out, time.perf_counter() - start)
        num_rows = sum(item.num_sampled_rows for item in items)
        if scoring:
            self._score_prompts(out, logits[num_rows:])
        logits = logits[:num_rows]
        if self.speculator is not None:
            new_tokens, new_logprobs = self.speculator.sample(self.sampler, logits, items)
        else:
            result = self.sampler(logits, seqs, masked=masked)
            new_tokens, new_logprobs = [[t] for t in result.token_ids], [[lp] for lp in result.logprobs]
        for i, item in enumerate(items):
            if item.seq.params.max_tokens == 0:  # scores its prompt only: nothing is generated
                new_tokens[i], new_logprobs[i] = [], []
        self.scheduler.update_from_output(out, new_tokens)
        return [item.seq for item in items], new_tokens, new_logprobs

    def _start_masks(self, seqs: list[Sequence]):
        """Start filling the grammar bitmasks of ``seqs``' constrained rows (``GrammarCompiler.start_masks``);
        ``None`` when no row has a grammar."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return None
        return self.grammar_compiler.start_masks([seqs[i].grammar for i in rows], rows, len(seqs))

    def _score_prompts(self, out, logits: torch.Tensor) -> None:
        """Append the prompt logprobs of this step's prompt positions (``[P, vocab]`` logits, in
        ``ScheduledSequence.prompt_logprob_positions`` order) to their sequences: per token, its
        log-probability and those of the ``prompt_logprobs`` most likely tokens there (log-softmax
        in float32, as vLLM)."""
        row = 0
        for item in out.scheduled:
            positions = item.prompt_logprob_positions
            if not positions:
                continue
            seq, k = item.seq, item.seq.params.prompt_logprobs
            logprobs = torch.log_softmax(logits[row : row + len(positions)].float(), dim=-1)  # [p, vocab]
            row += len(positions)
            next_ids = seq.token_ids[positions.start + 1 : positions.stop + 1]
            index = torch.tensor(next_ids, dtype=torch.long, device=logprobs.device)
            chosen = logprobs.gather(1, index[:, None]).squeeze(1).tolist()
            top = torch.topk(logprobs, k, dim=-1) if k else None
            for j, token in enumerate(next_ids):
                entry = {token: chosen[j]}
                if top is not None:
                    entry.update(zip(top.indices[j].tolist(), top.values[j].tolist()))
                seq.prompt_logprobs.append(entry)

    def _process_tokens(self, seq: Sequence, tokens: list[int], logprobs: list, now: float) -> None:
        """Stop checks, text and stats of a step's new tokens, one at a time; tokens after a stop are dropped."""
        if not tokens and seq.params.max_tokens == 0:  # a prompt-scoring request is done once its prompt ran
            self.num_prompt_tokens_total += seq.num_prompt_tokens
            self._finish(seq, SequenceStatus.FINISHED_LENGTH)
            seq.finished_time = now
            self.num_requests_finished_total += 1
            return
        del seq.token_ids[len(seq.token_ids) - len(tokens) :]
        for token, entry in zip(tokens, logprobs):
            seq.token_ids.append(token)
            self._process_token(seq, token, entry, now)
            if seq.is_finished:
                break

    def _fail_step(self, seqs: list[Sequence], exc: Exception) -> list[RequestOutput]:
        """Finish every request of a failed step with ``"error"``; raise if the engine cannot go on."""
        self.num_failed_steps_total += 1
        self.num_consecutive_failed_steps += 1
        logger.error("engine step failed; failing its %d request(s)", len(seqs), exc_info=exc)
        touched: dict[str, list[Sequence]] = {}
        for seq in seqs:
            if not seq.is_finished:
                self._finish_with_error(seq, exc)
                self.requests.pop(seq.request_id, None)
                touched.setdefault(seq.group_id, self.groups[seq.group_id])
        outputs = self._group_outputs(touched)
        try:
            self.check_invariants()
        except Exception as broken:
            raise EngineDeadError(
                f"KV cache bookkeeping is broken after a failed step ({broken}); restart the engine"
            ) from exc
        if self.num_consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
            raise EngineDeadError(
                f"{self.num_consecutive_failed_steps} steps failed in a row (last: {type(exc).__name__}: "
                f"{exc}); restart the engine"
            ) from exc
        return outputs

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Finish ``seq``: out of the queues, its KV blocks (and the draft's) freed."""
        self.scheduler.finish(seq, status)
        if self.speculator is not None:
            self.speculator.free(seq.request_id)

    def _finish_with_error(self, seq: Sequence, exc: Exception) -> None:
        seq.error = f"{type(exc).__name__}: {exc}"
        self._finish(seq, SequenceStatus.FINISHED_ERROR)
        seq.finished_time = time.monotonic()
        self.num_requests_finished_total += 1

    def _process_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None, now: float) -> None:
        """Stats, logprobs, text and stop conditions of ``token``, already appended to ``seq`` by the scheduler."""
        self.num_generation_tokens_total += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.num_prompt_tokens_total += seq.num_prompt_tokens
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        text_before = len(seq.output_text)
        seq.output_text += seq.detokenizer.add_token(token)
        if seq.grammar is not None:
            seq.grammar.accept(token)
            if seq.grammar.error is not None:
                self._finish_with_error(seq, RuntimeError(seq.grammar.error))
                return
        status = self._stop_status(seq, token, text_before)
        if status is not None:
            seq.stop_holdback_chars = 0
            self._finish(seq, status)
            seq.finished_time = now
            self.num_requests_finished_total += 1
        elif seq.params.stop:
            seq.stop_holdback_chars = stop_prefix_length(seq.output_text, seq.params.stop)

    def _stop_status(self, seq: Sequence, token: int, text_before: int) -> SequenceStatus | None:
        p = seq.params
        if seq.grammar is not None and seq.grammar.is_terminated:  # nothing may follow (EOS included)
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens < p.min_tokens:  # the sampler blocked EOS and stop ids
            return SequenceStatus.FINISHED_LENGTH if seq.num_tokens >= self.config.max_model_len else None
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if p.stop:
            longest = max(len(s) for s in p.stop)
            search_from = max(0, text_before - longest + 1)
            hits = [i for i in (seq.output_text.find(s, search_from) for s in p.stop) if i >= 0]
            if hits:
                seq.output_text = seq.output_text[: min(hits)]
                return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _output(self, group: list[Sequence]) -> RequestOutput:
        """The request's state: one ``CompletionOutput`` per sequence (cumulative)."""
        completions = [
            CompletionOutput(
                seq.index,
                seq.output_text[: len(seq.output_text) - seq.stop_holdback_chars],
                seq.output_token_ids,
                seq.status.finish_reason,
                None if seq.logprobs is None else list(seq.logprobs),
                seq.error,
            )
            for seq in group
        ]
        first = group[0]
        first_times = [s.first_token_time for s in group if s.first_token_time is not None]
        finished = all(s.is_finished for s in group)
        metrics = RequestMetrics(
            first.arrival_time,
            min(first_times) if first_times else None,
            max(s.finished_time for s in group) if finished else None,
            first.num_cached_tokens or 0,
            sum(s.num_output_tokens for s in group),
        )
        prompt_logprobs = None if first.prompt_logprobs is None else list(first.prompt_logprobs)
        return RequestOutput(
            first.group_id,
            first.prompt,
            first.prompt_token_ids,
            completions,
            finished,
            metrics,
            prompt_logprobs,
            lora_request=first.lora_request,
        )

    # ---------------------------------------------------------------- introspection

    def get_stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=bm.usage,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            prefix_cache_queries_tokens_total=bm.prefix_cache_queries_tokens,
            prefix_cache_hits_tokens_total=bm.prefix_cache_hits_tokens,
            num_prompt_tokens_total=self.num_prompt_tokens_total,
            num_generation_tokens_total=self.num_generation_tokens_total,
            num_requests_finished_total=self.num_requests_finished_total,
            num_steps_total=self.num_steps_total,
            num_kv_blocks=bm.num_blocks,
            num_free_kv_blocks=len(bm.free_block_ids),
            num_cached_kv_blocks=len(bm.cached_lru),
            **self._spec_stats(),
            **self.grammar_compiler.stats(),
        )

    def _spec_stats(self) -> dict[str, int]:
        sp = self.speculator
        if sp is None:
            return {}
        return dict(
            spec_decode_num_drafts_total=sp.num_drafts,
            spec_decode_num_draft_tokens_total=sp.num_draft_tokens,
            spec_decode_num_accepted_tokens_total=sp.num_accepted_tokens,
        )

    @property
    def proposer(self):
        """The speculative proposer (``None`` without speculation)."""
        return None if self.speculator is None else self.speculator.proposer

    def check_invariants(self) -> None:
        """Raise ``KVCacheInvariantError`` if the KV bookkeeping is inconsistent."""
        self.block_manager.check_invariants(self.scheduler.running)
        check_draft = getattr(self.proposer, "check_invariants", None)
        if check_draft is not None:
            check_draft()


def make_model_runner(config: EngineConfig, path: Path, max_model_len: int) -> ModelRunner:
    """``StaticDecodeModelRunner`` (bucket-padded decode batches, CUDA graphs on CUDA) for the
    ``triton`` attention backend, ``ModelRunner`` otherwise."""
    backend = config.attention_backend or ("triton" if config.device.startswith("cuda") else "torch")
    args = (path, config.dtype, config.device, config.block_size, max_model_len)
    if backend == "triton":
        return StaticDecodeModelRunner(
            *args,
            max_num_seqs=config.max_num_seqs,
            enforce_eager=config.enforce_eager,
            attention_backend=backend,
            kv_cache_dtype=config.kv_cache_dtype,
        )
    return ModelRunner(*args, kv_cache_dtype=config.kv_cache_dtype, batch_invariant=config.batch_invariant)


def read_eos_token_ids(path: Path, tokenizer) -> set[int]:
    """End-of-sequence ids from ``generation_config.json`` / ``config.json`` / the tokenizer."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if file.is_file():
            value = json.loads(file.read_text()).get("eos_token_id")
            if value is not None:
                ids.update(value if isinstance(value, list) else [value])
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


PromptType = str | list[int] | dict | list[dict]


class LLM:
    """Offline batch generation (vLLM's ``LLM``).

    Args:
        model: checkpoint name, ``.gguf`` file or directory.
        **kwargs: ``EngineConfig`` fields.
    """

    def __init__(self, model: str | Path = "smollm2-135m", **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def apply_chat_template(self, prompt: str | list[dict]) -> list[int]:
        """A user message (or a list of messages) -> prompt token ids with the generation prompt."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))

    def generate(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        chat: bool = False,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None | list[LoRARequest | None] = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt, batched by the engine.

        Args:
            prompts: one prompt or a list; a prompt is text, token ids, or (with ``chat``) a
                list of ``{"role", "content"}`` messages.
            sampling_params: one for all, or one per prompt.
            chat: wrap text prompts as a user turn with the checkpoint's chat template.
            use_tqdm: show a progress bar of finished requests.
            lora_request: the LoRA adapter of every prompt, or one per prompt (``None``: the base);
                prompts of different adapters run in the same batches.

        Returns:
            Final ``RequestOutput`` per prompt, in input order.

        Raises:
            ValueError: a bad prompt or parameter (nothing runs).
        """
        prompts = _as_prompt_list(prompts, chat)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"sampling_params has {len(params)} entries for {len(prompts)} prompts; give one or one per prompt"
            )
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(
                f"lora_request has {len(loras)} entries for {len(prompts)} prompts; give one or one per prompt"
            )
        engine = self.engine
        inputs = [self.apply_chat_template(p) if chat and not isinstance(p, dict) else p for p in prompts]
        validated = [
            engine.validate_request(p, sp, lora) for p, sp, lora in zip(inputs, params, loras)
        ]  # all before running any
        ids = [
            engine.add_validated_request(None, text, token_ids, sp, None, lora)
            for (sp, text, token_ids), lora in zip(validated, loras)
        ]
        finals: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            progress = tqdm(total=len(ids), desc="requests", unit="req")
        max_steps = 10 * sum(len(s.token_ids) + s.params.max_tokens for i in ids for s in engine.groups[i]) + 100
        for _ in range(max_steps):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
                    if progress is not None:
                        progress.update(1)
        else:
            raise RuntimeError(f"generation did not finish within {max_steps} steps (engine bug)")
        if progress is not None:
            progress.close()
        return [finals[i] for i in ids]


def _unwrap_prompt_dict(prompt: dict) -> str | list[int]:
    """``{"prompt_token_ids": [...]}`` or ``{"prompt": text}`` (vLLM's prompt dicts) -> the prompt."""
    keys = set(prompt)
    if keys == {"prompt_token_ids"}:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integer token ids")
        return ids
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    raise ValueError(f'prompt dict with keys {sorted(keys)}; give {{"prompt_token_ids": [ids]}} or {{"prompt": text}}')


def _as_prompt_list(prompts, chat: bool) -> list:
    if isinstance(prompts, dict):
        return [prompts]  # one {"prompt_token_ids": ...} prompt
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt of token ids
    if chat and isinstance(prompts, list) and prompts and all(isinstance(m, dict) and "role" in m for m in prompts):
        return [prompts]  # one conversation
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("prompts must be a non-empty string, token-id list, or list of prompts")
    return prompts


def stop_prefix_length(text: str, stops: list[str]) -> int:
    """Length of the longest end of ``text`` that begins one of ``stops`` (0 if none).

    A streamed completion withholds those characters until the next token shows whether the stop
    string completes (then they are cut with it) or not, so a client never receives text that the
    finished completion does not contain (as vLLM holds back possible stop-string prefixes).
    """
    longest = 0
    for stop in stops:
        first = stop[0]
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text[-k] == first and text.endswith(stop[:k]):
                longest = k
                break
    return longest
