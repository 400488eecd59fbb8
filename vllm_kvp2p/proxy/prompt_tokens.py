"""A request's prompt tokens, for routing by cached prefix: taken from the request, or asked of a P's ``/tokenize``.

Token-id prompts are used as they are. Text and chat prompts are tokenized by one P (vLLM's ``/tokenize``: the
engine's own tokenizer and chat template, so the tokens are those the engines will hash). Requests whose blocks
vLLM hashes with extra keys (a cache salt, a LoRA adapter), several prompts, or none, get no tokens: they are
routed by load.
"""

from __future__ import annotations

from typing import Any

import anyio
import httpx

from vllm_kvp2p.proxy.upstream import describe

# What vLLM's /tokenize takes of a completion or chat request (vLLM's TokenizeCompletionRequest and
# TokenizeChatRequest): the same tokens the engines will hash.
_TOKENIZE_COMPLETION_FIELDS: tuple[str, ...] = ("model", "prompt", "add_special_tokens")
_TOKENIZE_CHAT_FIELDS: tuple[str, ...] = (
    "model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "tools",
)
# Request fields that make vLLM hash blocks with extra keys (per-request cache isolation, adapters).
_PER_REQUEST_HASH_KEYS: tuple[str, ...] = ("cache_salt", "lora_request")


def is_token_list(value: object) -> bool:
    """A non-empty list of plain ints (``bool`` excluded)."""
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def tokenize_request(path: str, body: dict[str, Any]) -> list[int] | dict[str, Any] | None:
    """The prompt's token ids when the request carries them, else the body to send to ``/tokenize``, else None."""
    if path.endswith("chat/completions"):
        if not isinstance(body.get("messages"), list):
            return None
        tok_body = {k: body[k] for k in _TOKENIZE_CHAT_FIELDS if k in body}
    else:
        prompt = body.get("prompt")
        if is_token_list(prompt):
            return prompt  # type: ignore[return-value]
        if not isinstance(prompt, str):
            return None  # several prompts, or none: vLLM answers that itself
        tok_body = {k: body[k] for k in _TOKENIZE_COMPLETION_FIELDS if k in body}
    if any(body.get(k) for k in _PER_REQUEST_HASH_KEYS):
        return None  # hashed with extra keys the proxy does not reproduce
    return tok_body


async def fetch_tokens(
    client: httpx.AsyncClient, url: str, tok_body: dict[str, Any], headers: dict[str, str], timeout_s: float
) -> tuple[list[int] | None, str]:
    """``url``'s ``/tokenize`` answer for ``tok_body`` within ``timeout_s``: the tokens, or None and why not."""
    try:
        with anyio.fail_after(timeout_s):
            resp = await client.post(url + "/tokenize", json=tok_body, headers=headers)
        tokens = resp.json().get("tokens") if resp.status_code == 200 else None
    except (TimeoutError, httpx.HTTPError, ValueError, AttributeError) as exc:
        return None, describe(exc)
    if not is_token_list(tokens):
        return None, f"HTTP {resp.status_code}" if resp.status_code != 200 else "no token list"
    return tokens, ""
