"""A completion prompt's tokens computed in the proxy, with the tokenizer files the engines serve (``--tokenizer``).

Without it a text prompt costs one ``/tokenize`` round trip to a P before routing, and that P's API server shares
its cores with an engine that may be in the middle of a prefill (benchmarks/bench_routing.py measured the
difference). With it the proxy encodes the prompt the way vLLM's completion endpoint does
(``tokenizer.encode(prompt, add_special_tokens=...)``, special tokens added unless the request says otherwise),
in a worker thread so a long prompt never stalls the event loop.

Only completion prompts: a chat request's tokens depend on the engine's chat template, its tools and its
options, which ``/tokenize`` renders exactly; those still go there. Tokens that differ from the engine's (another
tokenizer revision, say) cost only routing quality, never an answer: their hashes match nothing in the index.
"""

from __future__ import annotations

from typing import Any

#: Longer prompts are routed by load rather than tokenized in the proxy (a bound on the proxy's work per request;
#: about 500,000 tokens of English text, beyond any context length served today).
MAX_PROMPT_CHARS = 2_000_000


class TokenizerSettingsError(ValueError):
    """``--tokenizer`` names nothing that can be loaded."""


class LocalTokenizer:
    """The engines' tokenizer, loaded once (Hugging Face files: a model directory or a hub name in the cache)."""

    def __init__(self, name_or_path: str, *, trust_remote_code: bool = False) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # the proxy alone does not depend on transformers
            raise TokenizerSettingsError(
                f"--tokenizer {name_or_path}: needs the 'transformers' package in the proxy's environment ({exc})"
            ) from exc
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        except Exception as exc:  # transformers raises OSError, ValueError, and others, for a bad name or files
            raise TokenizerSettingsError(
                f"--tokenizer {name_or_path}: cannot load a tokenizer there ({type(exc).__name__}: {exc})"[:500]
            ) from exc
        self.name = name_or_path

    def tokens(self, tokenize_body: dict[str, Any]) -> list[int] | None:
        """The tokens of a completion request's ``/tokenize`` body (``prompt``, ``add_special_tokens``), or None
        when the proxy should not compute them itself (a chat request, a prompt too long, odd field types)."""
        prompt = tokenize_body.get("prompt")
        add_special_tokens = tokenize_body.get("add_special_tokens", True)
        if not isinstance(prompt, str) or type(add_special_tokens) is not bool or len(prompt) > MAX_PROMPT_CHARS:
            return None
        ids = self._tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return [int(t) for t in ids]
