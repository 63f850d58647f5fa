"""``TokensPrompt`` of the fake vLLM (a dict with ``prompt_token_ids``, as vLLM's TypedDict)."""


def TokensPrompt(prompt_token_ids: list[int]) -> dict:
    return {"prompt_token_ids": list(prompt_token_ids)}
