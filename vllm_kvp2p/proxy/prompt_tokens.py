"""A request's prompt tokens, for routing by cached prefix: taken from the request, computed by the proxy's own
tokenizer (``--tokenizer``, :mod:`local_tokenizer`), or asked of a P's ``/tokenize``.

Token-id prompts are used as they are. Text completion prompts are tokenized in the proxy when it has the
engines' tokenizer; chat prompts, and text without it, by one P (vLLM's ``/tokenize``: the engine's own tokenizer
and chat template, so the tokens are those the engines will hash). Requests whose blocks vLLM hashes with extra
keys (a cache salt, a LoRA adapter), several prompts, or none, and ``/v1/responses`` requests, get no tokens: they
are routed by load. :class:`PromptReader` is the one place that decides which, and counts what happened.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from vllm_kvp2p.proxy.block_hashes import PromptHasher
from vllm_kvp2p.proxy.endpoints import ENDPOINTS
from vllm_kvp2p.proxy.instances import PromptBlocks
from vllm_kvp2p.proxy.local_tokenizer import LocalTokenizer
from vllm_kvp2p.proxy.upstream import TRANSPORT_ERRORS, Upstream, describe

logger = logging.getLogger("vllm_kvp2p.proxy")

#: Limit on a P's /tokenize answer (``--tokenize-timeout``).
DEFAULT_TOKENIZE_TIMEOUT_S = 2.0

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
    """The prompt's token ids when the request carries them, else the body to send to ``/tokenize``, else None.

    Which body field holds the prompt is the route's (:data:`~vllm_kvp2p.proxy.endpoints.ENDPOINTS`): none for
    ``/v1/responses`` (vLLM's ``/tokenize`` does not take its ``input`` and ``instructions``), routed by load."""
    source = ENDPOINTS[path].prompt if path in ENDPOINTS else "prompt"
    if source is None:
        return None
    if source == "messages":
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
    client: Upstream, url: str, tok_body: dict[str, Any], headers: dict[str, str], timeout_s: float
) -> tuple[list[int] | None, str]:
    """``url``'s ``/tokenize`` answer for ``tok_body`` within ``timeout_s``: the tokens, or None and why not."""
    try:
        resp = await client.request("POST", url + "/tokenize", timeout_s, body=tok_body, headers=headers)
        tokens = resp.json().get("tokens") if resp.status == 200 else None
    except (*TRANSPORT_ERRORS, ValueError, AttributeError) as exc:
        return None, describe(exc)
    if not is_token_list(tokens):
        return None, f"HTTP {resp.status}" if resp.status != 200 else "no token list"
    return tokens, ""


class PromptReader:
    """Reads each request's prompt into :class:`PromptBlocks` for routing, and counts where the tokens came from."""

    def __init__(self, hasher: PromptHasher, *, timeout_s: float, local_tokenizer: LocalTokenizer | None) -> None:
        self.hasher = hasher
        self.timeout_s = timeout_s
        self.local_tokenizer = local_tokenizer
        self.tokenized_locally = 0  # text prompts tokenized in the proxy
        self.tokenized_by_p = 0  # ... and by a P's /tokenize
        self.tokenize_failures = 0  # prompts whose tokens could not be had (routed by load only)

    async def blocks(
        self, client: Upstream, tokenize_url: Callable[[], str], path: str, body: dict[str, Any],
        headers: dict[str, str], remaining_s: float, rid: str,
    ) -> PromptBlocks | None:
        """The prompt's blocks, or None (route by load). ``tokenize_url`` picks the P to ask when the proxy cannot
        tokenize the prompt itself (only then); ``remaining_s`` is what is left of the request's deadline."""
        request = tokenize_request(path, body)
        if request is None or isinstance(request, list):
            return None if request is None else PromptBlocks(request, self.hasher)
        if self.local_tokenizer is not None and "prompt" in request:
            # A worker thread: a long prompt must not stall the event loop that relays every other request.
            local = await asyncio.to_thread(self.local_tokenizer.tokens, request)
            if local is not None:
                self.tokenized_locally += 1
                return PromptBlocks(local, self.hasher)
        url = tokenize_url()
        tokens, why = await fetch_tokens(client, url, request, headers, min(self.timeout_s, remaining_s))
        if tokens is None:
            self.tokenize_failures += 1
            logger.info("request %s: no tokens from %s/tokenize (%s); routed by load", rid, url, why)
            return None
        self.tokenized_by_p += 1
        return PromptBlocks(tokens, self.hasher)



#: What :class:`PromptReader` counts, as ``/health`` shows it.
COUNTERS = ("tokenize_failures", "tokenized_locally", "tokenized_by_p")


def reader_snapshot(reader: PromptReader | None) -> dict[str, Any]:
    """``/health``'s view of the prompt reader; a proxy without one (no KV events to route by) shows zeros."""
    tokenizer = reader.local_tokenizer if reader is not None else None
    return {**{k: getattr(reader, k) if reader is not None else 0 for k in COUNTERS},
            "tokenizer": tokenizer.name if tokenizer is not None else None}
