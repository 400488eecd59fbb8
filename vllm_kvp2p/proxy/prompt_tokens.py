"""A request's prompt tokens, for routing by cached prefix: taken from the request, computed by the proxy's own
tokenizer (``--tokenizer``, :mod:`local_tokenizer`), or asked of a P's ``/tokenize``.

First :func:`why_not_hashed` decides whether the prompt may be hashed at all: not when vLLM hashes its blocks with
extra keys the proxy does not reproduce (a ``cache_salt``, a LoRA adapter, multimodal content, prompt embeddings):
those requests are routed by load, whatever form their prompt takes (text, token ids, chat). Then token-id prompts
are used as they are; text completion prompts are tokenized in the proxy when it has the engines' tokenizer; chat
prompts, and text without it, by one P (vLLM's ``/tokenize``: the engine's own tokenizer and chat template, so the
tokens are those the engines will hash). Several prompts, or none, and ``/v1/responses`` requests get no tokens
either: routed by load. :class:`PromptReader` does all this per request, and counts what happened.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
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
# Request fields that make vLLM hash blocks with extra keys: per-request cache isolation, an adapter (vLLM's Python
# API; the OpenAI server names it by ``model``), prompt embeddings (a completion's prompt, hashed as embeddings).
_PER_REQUEST_HASH_KEYS: tuple[str, ...] = ("cache_salt", "lora_request", "prompt_embeds")
# Chat content parts that are text: any other part (image_url, input_audio, video_url, image_embeds, ...) is
# multimodal, and vLLM hashes the blocks it fills with its media hash.
_TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal"})
#: How long a failed ``/v1/models`` (the base model names, for telling a LoRA adapter's requests) is not asked again.
MODELS_RETRY_S = 30.0


def is_token_list(value: object) -> bool:
    """A non-empty list of plain ints (``bool`` excluded)."""
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _is_text_part(part: object) -> bool:
    if not isinstance(part, dict):
        return False
    kind = part.get("type")
    return kind in _TEXT_PARTS if kind is not None else set(part) == {"text"}  # vLLM reads a bare {"text": ...}


def _multimodal(messages: object) -> bool:
    """Whether chat ``messages`` carry anything but text (anything unusual counts: routed by load costs nothing)."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and not all(_is_text_part(p) for p in content):
            return True
        if content is not None and not isinstance(content, (str, list)):
            return True
    return False


def why_not_hashed(body: dict[str, Any], base_models: Collection[str] | None = None) -> str | None:
    """Why the prompt of request ``body`` may not be hashed for routing (it is routed by load), or None if it may.

    vLLM hashes a block with extra keys when the request has a ``cache_salt`` (the first block), a LoRA adapter,
    multimodal content or prompt embeddings; the proxy reproduces none of them, so such a prompt would be looked up
    under the unsalted, base-model, text-only hashes: other users' blocks, which it shares nothing with. ``model``
    names a LoRA adapter when it is not one of ``base_models`` (the engines' served model names, from their
    ``/v1/models``; None when unknown: only the body's own fields count). Pure: the one place this is decided."""
    for key in _PER_REQUEST_HASH_KEYS:
        if body.get(key) is not None:
            return key
    if _multimodal(body.get("messages")):
        return "multimodal content"
    model = body.get("model")
    if base_models is not None and model is not None and (not isinstance(model, str) or model not in base_models):
        return "a LoRA adapter (model is not a base model)"
    return None


def tokenize_request(
    path: str, body: dict[str, Any], base_models: Collection[str] | None = None
) -> list[int] | dict[str, Any] | None:
    """The prompt's token ids when the request carries them, else the body to send to ``/tokenize``, else None
    (routed by load: :func:`why_not_hashed` says no, whatever form the prompt has, or there is no one prompt).

    Which body field holds the prompt is the route's (:data:`~vllm_kvp2p.proxy.endpoints.ENDPOINTS`): none for
    ``/v1/responses`` (vLLM's ``/tokenize`` does not take its ``input`` and ``instructions``), routed by load."""
    if why_not_hashed(body, base_models) is not None:
        return None  # hashed by vLLM with extra keys the proxy does not reproduce
    source = ENDPOINTS[path].prompt if path in ENDPOINTS else "prompt"
    if source is None:
        return None
    if source == "messages":
        if not isinstance(body.get("messages"), list):
            return None
        return {k: body[k] for k in _TOKENIZE_CHAT_FIELDS if k in body}
    prompt = body.get("prompt")
    if is_token_list(prompt):
        return prompt  # type: ignore[return-value]
    if not isinstance(prompt, str):
        return None  # several prompts, or none: vLLM answers that itself
    return {k: body[k] for k in _TOKENIZE_COMPLETION_FIELDS if k in body}


def base_model_names(models: object) -> frozenset[str] | None:
    """The base models of a ``/v1/models`` answer (vLLM lists each LoRA adapter with its ``parent``), or None."""
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list):
        return None
    names = frozenset(m["id"] for m in data
                      if isinstance(m, dict) and isinstance(m.get("id"), str) and m.get("parent") is None)
    return names or None


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
        #: The engines' base model names, from a P's ``/v1/models`` when a request first names a model: a request
        #: naming another (a LoRA adapter) is routed by load. None until a P has told (then only the body counts).
        self.base_models: frozenset[str] | None = None
        self._models_failed_at: float | None = None

    async def blocks(
        self, client: Upstream, tokenize_url: Callable[[], str], path: str, body: dict[str, Any],
        headers: dict[str, str], remaining_s: float, rid: str,
    ) -> PromptBlocks | None:
        """The prompt's blocks, or None (route by load). ``tokenize_url`` picks the P to ask when the proxy cannot
        tokenize the prompt itself (only then); ``remaining_s`` is what is left of the request's deadline."""
        if self.base_models is None and body.get("model") is not None:
            await self._learn_models(client, tokenize_url(), headers, min(self.timeout_s, remaining_s))
        request = tokenize_request(path, body, self.base_models)
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

    async def _learn_models(self, client: Upstream, url: str, headers: dict[str, str], timeout_s: float) -> None:
        """Ask ``url``'s ``/v1/models`` for the base model names (once; after a failure, again in
        :data:`MODELS_RETRY_S`)."""
        now = time.monotonic()
        if self._models_failed_at is not None and now - self._models_failed_at < MODELS_RETRY_S:
            return
        try:
            resp = await client.request("GET", url + "/v1/models", timeout_s, headers=headers)
            names = base_model_names(resp.json()) if resp.status == 200 else None
            why = "no model listed" if resp.status == 200 else f"HTTP {resp.status}"
        except (*TRANSPORT_ERRORS, ValueError) as exc:
            names, why = None, describe(exc)
        if names is None:
            self._models_failed_at = now
            logger.warning("no base model names from %s/v1/models (%s): a request naming a LoRA adapter is hashed as "
                           "the base model's until a P tells (asked again in %.0f s)", url, why, MODELS_RETRY_S)
            return
        self.base_models = names
        logger.info("base models %s (%s/v1/models): a request naming another model (a LoRA adapter) is routed by "
                    "load", sorted(names), url)


#: What :class:`PromptReader` counts, as ``/health`` shows it.
COUNTERS = ("tokenize_failures", "tokenized_locally", "tokenized_by_p")


def reader_snapshot(reader: PromptReader | None) -> dict[str, Any]:
    """``/health``'s view of the prompt reader; a proxy without one (no KV events to route by) shows zeros."""
    tokenizer = reader.local_tokenizer if reader is not None else None
    return {**{k: getattr(reader, k) if reader is not None else 0 for k in COUNTERS},
            "tokenizer": tokenizer.name if tokenizer is not None else None}
