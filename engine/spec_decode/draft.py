"""``DraftProposer``: a small checkpoint with the target's tokenizer proposes the next k tokens.

The draft runs in the engine's own machinery: a ``ModelRunner`` over its own paged KV cache with
its own ``BlockManager`` (no prefix caching). Each request being speculated has a shadow
``Sequence`` in the draft that mirrors the target's tokens; a proposal round first catches the
draft up on the tokens it has not computed (the whole prompt the first time, afterwards the
tokens the target accepted in the last step), then runs ``k - 1`` single-token decodes, all
requests of the round batched together in every forward. Proposals the target rejects are rolled
back by lowering the shadow's ``num_computed_tokens`` to the prefix it shares with the target.

``lmforge distill`` output is the default draft of its teacher (``find_distilled_draft``). Its
``token_frequencies.json`` (``compress.train.distill.write_token_frequencies``) lets the draft
compute logits for the ``speculative_draft_vocab_size`` most frequent tokens only: with a small
model the vocabulary head is a large part of a draft forward (SmolLM2: 49152 x 576 weights, more
than six of its layers), and a proposal outside that set would rarely be the target's choice.
The target still verifies over the whole vocabulary, so output is unchanged; a sampling draft's
``q`` is zero outside the set, which rejection sampling allows. An INT8 draft (``lmforge quantize
--method int8-weight-only`` of the student) keeps its reduced head in INT8 (``reduced_head``), so
every draft forward reads half the bytes of a bf16 one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

from engine import cpu_ops
from engine.block_manager import BlockManager
from engine.checkpoint.store import (
    MANIFEST_NAME,
    TOKEN_FREQUENCIES_NAME,
    CheckpointError,
    read_manifest,
    resolve_checkpoint,
)
from engine.config import resolve_dtype
from engine.model import Linear, packed_rows, read_model_spec, rms_norm
from engine.model_runner import ModelRunner
from engine.quant.int8 import WEIGHT_ONLY_MAX_ROWS
from engine.sampler import Sampler
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence
from engine.spec_decode.proposer import Proposal


def find_distilled_draft(teacher: Path, search_dirs: list[Path]) -> Path | None:
    """The newest ``lmforge distill`` output whose manifest names ``teacher`` as its parent.

    Looks at checkpoint directories up to three levels below each of ``search_dirs`` (e.g.
    ``runs/distill/final``); unreadable manifests are skipped.
    """
    teacher = teacher.resolve()
    found: list[tuple[float, Path]] = []
    for root in search_dirs:
        if not root.is_dir():
            continue
        for pattern in (MANIFEST_NAME, f"*/{MANIFEST_NAME}", f"*/*/{MANIFEST_NAME}", f"*/*/*/{MANIFEST_NAME}"):
            for manifest_path in root.glob(pattern):
                try:
                    manifest = read_manifest(manifest_path.parent)
                except CheckpointError:
                    continue
                if manifest.method == "distill" and manifest.parent and Path(manifest.parent).resolve() == teacher:
                    found.append((manifest.created_at, manifest_path.parent.resolve()))
    return max(found)[1] if found else None


def check_same_tokenizer(target_dir: Path, draft_dir: Path, target_tokenizer, target_vocab_size: int) -> None:
    """Refuse a draft whose tokenizer or vocabulary differs from the target's.

    Raises:
        ValueError: different vocabulary sizes or token-to-id maps (both paths are named).
    """
    draft_vocab_size = read_model_spec(draft_dir).vocab_size
    if draft_vocab_size != target_vocab_size:
        raise ValueError(
            f"speculative_model {draft_dir} has vocab_size={draft_vocab_size} but the target {target_dir} has "
            f"{target_vocab_size}; the draft must share the target's tokenizer and vocabulary"
        )
    draft_tokenizer = AutoTokenizer.from_pretrained(draft_dir)
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(
            f"speculative_model {draft_dir} has another tokenizer than the target {target_dir} (their token-to-id "
            "maps differ); use a draft distilled from the target, which keeps its tokenizer"
        )


def read_draft_vocab(draft_dir: Path, size: int | None, vocab_size: int) -> torch.Tensor | None:
    """``[size]`` sorted token ids of the draft's reduced head, or ``None`` (whole vocabulary).

    The special ids, then the ids of ``token_frequencies.json`` most frequent first, then the
    lowest ids not yet taken (byte-pair merges are numbered in the order they were learned, so
    low ids are the common ones) until ``size``. ``None`` when ``size`` is ``None``, covers the
    vocabulary, or the draft has no such file.

    Raises:
        CheckpointError: the file exists but is not valid (its path is named).
    """
    path = draft_dir / TOKEN_FREQUENCIES_NAME
    if size is None or size >= vocab_size or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        ranked = [int(t) for t in data.get("special_ids", [])] + [int(t) for t in data["token_ids"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"{path}: not a valid token frequency file ({exc}); delete it (the draft then uses its whole vocabulary)"
        ) from exc
    chosen = dict.fromkeys(t for t in ranked if 0 <= t < vocab_size)
    for t in range(vocab_size):
        if len(chosen) >= size:
            break
        chosen.setdefault(t)
    return torch.tensor(sorted(list(chosen)[:size]), dtype=torch.long)


def reduced_head(lm_head: Linear, head_ids: torch.Tensor, device: str, dtype: torch.dtype) -> Linear:
    """The rows ``head_ids`` (``[V']``) of a float or CPU INT8 lm head: a ``[V', hidden]`` layer of the same kind.

    An INT8 head (``lmforge quantize``) keeps its stored INT8 rows, per-row scales and (``w8a8``)
    outlier input channels, so a quantized draft's reduced head reads a quarter of the bytes of a
    float32 one. A float head follows the engine's packing rule (``engine.model.packed_rows``).
    """
    int8 = lm_head.int8_layer
    if int8 is None:
        weight = lm_head.weight.index_select(0, head_ids.to(lm_head.weight.device)).contiguous()
        rows = packed_rows(device, dtype)
        return Linear(weight, pack=rows is not None, pack_rows=rows)
    rows = head_ids.to(int8.weight_int8.device)
    bias = None if int8.bias is None else int8.bias.index_select(0, rows)
    args = (int8.weight_int8.index_select(0, rows), int8.weight_scale.index_select(0, rows), bias)
    outliers = getattr(int8, "outlier_channels", None)  # input channels: the same for every output row
    layer = type(int8)(*args) if outliers is None else type(int8)(*args, outlier_channels=outliers)
    return Linear(None, int8_layer=layer, dtype=dtype)


class DraftProposer:
    """Proposes with a small model; one shadow sequence per request in its own KV cache.

    Args:
        draft_dir: the draft checkpoint (resolved directory).
        dtype: the draft's dtype (``EngineConfig.speculative_draft_dtype``, resolved).
        device, block_size, max_model_len: as the target engine's.
        num_blocks: blocks in the draft's KV pool.
        vocab_size: logits for this many frequent tokens only (``read_draft_vocab``); ``None``: all.
        min_confidence: stop a request's proposals after a token of lower draft probability (0: never).
        kv_cache_dtype: the draft's KV cache dtype (``"int8"`` when the target's is); ``None``: ``dtype``.

    Raises:
        ValueError: the draft's context is shorter than ``max_model_len``.
        engine.checkpoint.store.CheckpointError: the draft checkpoint is missing or unsupported.
    """

    def __init__(
        self,
        draft_dir: Path,
        dtype: str,
        device: str,
        block_size: int,
        max_model_len: int,
        num_blocks: int,
        vocab_size: int | None = None,
        min_confidence: float = 0.0,
        kv_cache_dtype: str | None = None,
    ) -> None:
        spec = read_model_spec(draft_dir)
        if spec.max_position_embeddings < max_model_len:
            raise ValueError(
                f"speculative_model {draft_dir} has max_position_embeddings={spec.max_position_embeddings} < "
                f"max_model_len={max_model_len}; decrease max_model_len or use a draft with a longer context"
            )
        self.path = draft_dir
        self.min_confidence = min_confidence
        self.runner = ModelRunner(draft_dir, dtype, device, block_size, max_model_len, kv_cache_dtype=kv_cache_dtype)
        self.runner.allocate_kv_cache(num_blocks)
        self.head_ids = read_draft_vocab(draft_dir, vocab_size, spec.vocab_size)  # [V'] or None
        self.head = None
        if self.head_ids is not None:
            self.head_ids = self.head_ids.to(device)
            self.head = reduced_head(self.runner.model.lm_head, self.head_ids, device, self.runner.dtype)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.shadows: dict[str, Sequence] = {}
        self._synced: dict[str, int] = {}  # request id -> target tokens the shadow last copied
        self.last_catch_up = 0  # most tokens a shadow caught up on in the last round's first forward

    @classmethod
    def for_target(
        cls, config, target_dir: Path, target_tokenizer, target_vocab_size: int, search_dirs: list[Path]
    ) -> "DraftProposer":
        """The draft of an engine: ``config.speculative_model`` or the distilled student of the target.

        Raises:
            ValueError: no draft given or found, or one with another tokenizer.
        """
        if config.speculative_model is not None:
            draft_dir = resolve_checkpoint(config.speculative_model)
        else:
            draft_dir = find_distilled_draft(target_dir, search_dirs)
            if draft_dir is None:
                where = ", ".join(str(d) for d in search_dirs)
                raise ValueError(
                    f"speculative_method='draft' without speculative_model, and no `lmforge distill` output of "
                    f"{target_dir} was found under {where}; set speculative_model or distill a student first"
                )
        check_same_tokenizer(target_dir, draft_dir, target_tokenizer, target_vocab_size)

        dtype = resolve_dtype(config.speculative_draft_dtype, config.device)
        return cls(
            draft_dir,
            dtype,
            config.device,
            config.block_size,
            config.max_model_len,
            config.num_kv_blocks,
            config.speculative_draft_vocab_size,
            config.speculative_draft_confidence_threshold,
            "int8" if config.kv_cache_dtype == "int8" else None,  # an int8 target cache: the draft's too
        )

    @property
    def stops_itself(self) -> bool:
        """A confidence threshold ends a request's proposals after a token the draft is unsure of."""
        return self.min_confidence > 0.0

    # ---------------------------------------------------------------- proposals

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """Draft ``ks[i]`` tokens after each of ``seqs`` (fewer, or none, when the draft pool is full)."""
        active: list[tuple[int, Sequence]] = []
        proposals = [Proposal([]) for _ in seqs]
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            shadow = self._sync(seq)
            if k > 0 and self.block_manager.allocate_slots(shadow, shadow.num_uncomputed_tokens + k - 1):
                active.append((i, shadow))
            elif k > 0:
                self.free(seq.request_id)  # start over later rather than hold a pool that is full
        # tokens of the first forward (the speculator does not time a round that prefilled a prompt)
        self.last_catch_up = max((shadow.num_uncomputed_tokens for _, shadow in active), default=0)
        first = True
        while active:
            items = [ScheduledSequence(sh, sh.num_uncomputed_tokens if first else 1) for _, sh in active]
            logits = self._logits(SchedulerOutput(items, sum(it.num_new_tokens for it in items), []))  # [S, V']
            for item in items:
                item.seq.num_computed_tokens += item.num_new_tokens
            still = []
            greedy = self._greedy_picks(logits) if any(seqs[i].params.greedy for i, _ in active) else None
            for row, (i, shadow) in enumerate(active):
                proposal = proposals[i]
                if seqs[i].params.greedy:
                    token, confidence = greedy[0][row], greedy[1][row]
                else:
                    token, probs = self._sample(logits[row], seqs[i])
                    confidence = float(probs[token])
                    proposal.probs = probs[None] if proposal.probs is None else torch.cat((proposal.probs, probs[None]))
                proposal.token_ids.append(token)
                shadow.token_ids.append(token)
                if len(proposal.token_ids) < ks[i] and confidence >= self.min_confidence:
                    still.append((i, shadow))
            active, first = still, False
        return proposals

    @torch.inference_mode()
    def _logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Float32 logits ``[S, V']`` of the sampled rows: the whole vocabulary, or ``head_ids`` only."""
        r = self.runner
        fused = self._fused_hidden(out)
        if fused is not None:
            hidden = fused  # [S, hidden]
        elif self.head is None:
            return r.execute(out)
        else:
            inputs = r.prepare(out)
            hidden = r.model.forward(inputs.input_ids, inputs.positions, r.kv_cache, r.attn, inputs.attn_metadata)
            hidden = hidden[inputs.logits_index]  # [S, hidden]
        if self.head is None:
            return r.model.compute_logits(hidden)
        return self.head(rms_norm(hidden, r.model.norm, r.spec.rms_norm_eps)).float()

    def _fused_hidden(self, out: SchedulerOutput) -> torch.Tensor | None:
        """Last hidden states ``[S, hidden]`` of the sampled rows from ``cpu_ops.decode_layers``, or ``None``
        where it does not run (a float or ``w8a8`` draft, not bf16 on CPU, more than ``WEIGHT_ONLY_MAX_ROWS``
        tokens, e.g. a prompt's first catch-up).

        A steady round's forwards hold one to three tokens per request: the whole decoder runs in one C++
        call, each token attending as a row of the decode kernel, with inputs built here from the block
        tables (no attention metadata): a draft position then costs about its weight bytes, not the
        Python and op dispatch of a forward (docs/speculative-decoding.md).
        """
        if (
            out.num_batched_tokens > WEIGHT_ONLY_MAX_ROWS
            or out.kv_copies
            or any(i.spec_token_ids for i in out.scheduled)
        ):
            return None  # (no copies or proposals in a draft's own steps: the op-by-op path would handle them)
        model = self.runner.model
        weights = model.int8_decode_weights()
        if weights is None:
            return None
        bs = self.runner.block_size
        ids, positions, slots, tables, lens, last = [], [], [], [], [], []
        width = max(len(item.seq.block_table) for item in out.scheduled)
        for item in out.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            table = seq.block_table
            padded = table + [0] * (width - len(table))
            for pos in range(start, start + item.num_new_tokens):
                ids.append(seq.token_ids[pos])
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
                tables.append(padded)
                lens.append(pos + 1)
            if item.samples:  # the draft's items carry no proposals: one sampled row, the last token's
                last.append(len(ids) - 1)
        device = self.runner.device
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        spec = model.spec
        hidden = cpu_ops.decode_layers(
            model.embed[torch.tensor(ids, dtype=torch.long, device=device)],
            *weights,
            self.runner.kv_cache,
            model.rope_cos[pos],
            model.rope_signed_sin[pos],
            torch.tensor(slots, dtype=torch.long, device=device),
            torch.tensor(tables, dtype=torch.long, device=device),
            torch.tensor(lens, dtype=torch.long, device=device),
            spec.num_attention_heads,
            spec.num_key_value_heads,
            spec.rms_norm_eps,
            float_aten=True,  # a float-kept layer as the draft's unpacked op-by-op path runs it
        )  # [N, hidden]
        return hidden if len(last) == len(ids) else hidden[torch.tensor(last, device=device)]

    def _greedy_picks(self, logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Per row of ``[S, V']`` float32 logits: the draft's greedy token (a vocabulary id; the first maximum)
        and its softmax probability, for the confidence stop. All rows at once: two host copies per forward."""
        best, index = logits.max(-1)  # [S], [S]
        top = torch.exp(logits - best[:, None]).sum(-1).reciprocal()  # [S]: softmax at the argmax
        ids = index if self.head_ids is None else self.head_ids[index]
        return ids.tolist(), top.tolist()

    def _sample(self, row: torch.Tensor, seq: Sequence) -> tuple[int, torch.Tensor]:
        """One draft token of a sampled request drawn from ``q`` of its ``[V']`` logits; ``q`` is returned over the
        whole vocabulary (zero outside ``head_ids``)."""
        p = seq.params
        q = Sampler._probs(row, p.temperature, p.top_k, p.top_p)
        index = int(torch.multinomial(q, 1, generator=seq.generator))
        if self.head_ids is None:
            return index, q
        full = torch.zeros(self.runner.spec.vocab_size, dtype=q.dtype, device=q.device)
        full[self.head_ids] = q
        return int(self.head_ids[index]), full

    def _sync(self, seq: Sequence) -> Sequence:
        """The shadow of ``seq`` holding its current tokens; its computed tokens cut to the common prefix."""
        shadow = self.shadows.get(seq.request_id)
        if shadow is None:
            shadow = Sequence(seq.request_id, None, seq.prompt_token_ids, seq.params, None, None)
            self.shadows[seq.request_id] = shadow
            self._synced[seq.request_id] = 0
        old, new = shadow.token_ids, seq.token_ids
        limit = min(shadow.num_computed_tokens, len(new))
        i = min(self._synced[seq.request_id], limit)  # target tokens only grow: old[:synced] == new[:synced]
        while i < limit and old[i] == new[i]:
            i += 1
        shadow.num_computed_tokens = i
        shadow.token_ids = list(new)
        self._synced[seq.request_id] = len(new)
        return shadow

    def free(self, request_id: str) -> None:
        """Release the draft's blocks of a request (finished, aborted or dropped)."""
        shadow = self.shadows.pop(request_id, None)
        self._synced.pop(request_id, None)
        if shadow is not None:
            self.block_manager.free(shadow)

    def check_invariants(self) -> None:
        """The draft pool's block bookkeeping is consistent (``KVCacheInvariantError`` if not)."""
        self.block_manager.check_invariants(list(self.shadows.values()))
