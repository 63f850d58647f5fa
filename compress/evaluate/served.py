"""``lmforge evaluate --served URL``: the held-out perplexity of a served model, through its OpenAI API.

Each record is encoded as ``lmforge evaluate`` encodes it (``engine.records.encode_record``: chat
records through the chat template, the assistant replies scored; text records on every token after
the first) and sent to ``/v1/completions`` as its token ids with ``echo: true``, ``logprobs: 0`` and
``max_tokens: 0``: the answer's ``logprobs.token_logprobs[t]`` is ``log P(token t | tokens < t)``
(``null`` for the first token), the prompt logprobs lm-evaluation-harness reads for its loglikelihood
tasks. Summed over the scored tokens they give the mean negative log-likelihood and the perplexity,
defined as ``compress.evaluate.quality.quality_metrics`` defines them, so a served INT8 model is judged
on the same tokens as the checkpoint in process.

Only perplexity and mean NLL are available served: the API returns the log-probability of the prompt's
own token (and of at most ``logprobs`` alternatives, by text), not the whole next-token distribution,
so KL divergence and same top-1 against a reference need the model in process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import requests

from engine.errors import LmforgeError
from engine.records import encode_record

#: Seconds one scoring request may take.
REQUEST_TIMEOUT_S = 300.0


class ServedScoreError(LmforgeError, RuntimeError):
    """The served model could not be scored: the server refused a request, or answered without prompt logprobs."""


def prompt_logprobs(
    url: str, model: str, ids: list[int], *, api_key: str | None = None, timeout_s: float = REQUEST_TIMEOUT_S
) -> list[float | None]:
    """``log P(ids[t] | ids[:t])`` for every ``t`` (``None`` for ``t = 0``) from the server at ``url``.

    Raises:
        ServedScoreError: the server is unreachable, answers an error (its message quoted), or its answer
            has no ``token_logprobs`` of the prompt's length.
    """
    body = {"model": model, "prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0, "temperature": 0}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    endpoint = f"{url.rstrip('/')}/v1/completions"
    try:
        reply = requests.post(endpoint, json=body, headers=headers, timeout=timeout_s)
    except requests.RequestException as exc:
        raise ServedScoreError(
            f"--served {url}: {type(exc).__name__}: {exc}", fix="start the server or fix the URL"
        ) from exc
    if reply.status_code != 200:
        raise ServedScoreError(
            f"--served {url}: POST /v1/completions answered HTTP {reply.status_code}: {reply.text[:300]}",
            fix="check --served-model and that the server accepts echo with logprobs and max_tokens 0",
        )
    try:
        logprobs = reply.json()["choices"][0]["logprobs"]["token_logprobs"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ServedScoreError(f"--served {url}: the answer has no prompt logprobs: {reply.text[:300]}") from exc
    if not isinstance(logprobs, list) or len(logprobs) != len(ids):
        raise ServedScoreError(
            f"--served {url}: {len(logprobs) if isinstance(logprobs, list) else 'no'} prompt logprobs for a "
            f"{len(ids)}-token prompt; the server must echo the prompt's logprobs"
        )
    return logprobs


def served_model_name(url: str, api_key: str | None = None) -> str:
    """The one model ``GET URL/v1/models`` lists.

    Raises:
        ServedScoreError: the server is unreachable or answers an error, or it lists no model or several
            (named: pick one with ``--served-model``).
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        reply = requests.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=30)
        reply.raise_for_status()
        names = [m["id"] for m in reply.json()["data"]]
    except (requests.RequestException, ValueError, KeyError, TypeError) as exc:
        raise ServedScoreError(
            f"--served {url}: GET /v1/models failed ({exc})", fix="start the server, fix the URL or pass --served-model"
        ) from exc
    if len(names) != 1:
        raise ServedScoreError(f"--served {url} serves {names or 'no model'}", fix="name one with --served-model")
    return names[0]


def served_quality(
    url: str,
    model: str,
    tokenizer,
    records: Sequence[dict[str, Any]],
    *,
    max_length: int = 512,
    api_key: str | None = None,
) -> dict[str, Any]:
    """Perplexity and mean NLL (nats per scored token) of the model served at ``url`` on ``records``.

    ``tokenizer`` must be the served model's (the records are sent as its token ids).

    Returns:
        ``{"perplexity", "mean_nll", "perplexity_tokens"}``.

    Raises:
        ServedScoreError: a request failed (``prompt_logprobs``), a scored token has no logprob, or no
            record has a scored token.
    """
    total_nll, count = 0.0, 0
    for record in records:
        ids, scored = encode_record(tokenizer, record, max_length=max_length)
        positions = [t for t in range(1, len(ids)) if scored[t]]
        if not positions:
            continue
        logprobs = prompt_logprobs(url, model, ids, api_key=api_key)
        for t in positions:
            if logprobs[t] is None:
                raise ServedScoreError(f"--served {url}: no logprob for prompt token {t} of {len(ids)}")
            total_nll -= float(logprobs[t])
        count += len(positions)
    if not count:
        raise ServedScoreError(
            "no scored tokens in the evaluation data (every record is empty or has no assistant reply)"
        )
    mean_nll = total_nll / count
    return {"perplexity": math.exp(mean_nll), "mean_nll": mean_nll, "perplexity_tokens": count}
