"""Batched completion prompts (pure): one ``/v1/completions`` request whose ``prompt`` lists several prompts is
split into one request per prompt, and their answers are merged into the answer one vLLM instance gives.

vLLM answers a batch (vllm/entrypoints/openai/completion/serving.py, 0.32) with one id, the choices of prompt ``i``
indexed ``i * n + k`` (``k``: the choice's index within its prompt), and the usage summed over the prompts; a stream
carries every prompt's chunks as they come, with those indices, then one usage chunk (when asked) and one
``data: [DONE]``. :func:`merge_answers` and :class:`StreamMerger` rebuild that shape from the parts' answers, so an
OpenAI client reads the batch as it reads one instance's. A client can still tell the batch was split, and is told:
the answer's id and ``created`` are prompt 0's (whose request id is the batch's with ``-0`` appended, as vLLM numbers
a batch's prompts), ``X-KVP2P-Batch-Prompts`` gives the part count, and ``kv_transfer_params`` lists each part's
(``kvp2p_parts``) and, not streamed, the instances and times of each prompt (``kvp2p_routes``). The I/O (running
the parts, cancelling them) is :mod:`batch_flow`'s.

A batch's head is bounded whatever its size: ``X-Request-Id`` and ``X-KVP2P-Batch-Prompts`` only, never a value per
prompt. (One value per prompt, joined, made the head of a 1,024-prompt batch ~140 KB with 65-character instance
URLs: more than h11, and so httpx and the OpenAI SDK, read (16 KiB), or aiohttp (8 KiB a line): issue 45, item 5.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: An SSE event's end: vLLM ends each with a blank line.
EVENT_END = b"\n\n"
DONE = b"[DONE]"


def batch_prompts(body: dict[str, Any]) -> list[Any] | None:
    """The prompts of a batched completion request (two or more strings, or two or more token-id lists), else
    None: one prompt (a string, token ids, or a one-element list, which vLLM answers as one prompt) is sent whole.

    Call it on a body :func:`~vllm_kvp2p.proxy.validation.check_prompt` accepted."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return list(prompt)
    return None  # token ids of one prompt


def split_body(body: dict[str, Any], prompts: Sequence[Any]) -> list[dict[str, Any]]:
    """One request body per prompt: the client's body with ``prompt`` set to that one prompt."""
    return [{**body, "prompt": prompt} for prompt in prompts]


def sum_usage(usages: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """The prompts' usages summed: tokens, and ``prompt_tokens_details.cached_tokens`` when any part reports it."""
    present = [u for u in usages if isinstance(u, dict)]
    total: dict[str, Any] = {
        key: sum(int(u.get(key) or 0) for u in present) for key in ("prompt_tokens", "total_tokens",
                                                                       "completion_tokens")
    }
    cached = [u["prompt_tokens_details"].get("cached_tokens") for u in present
              if isinstance(u.get("prompt_tokens_details"), dict)]
    if any(c is not None for c in cached):
        total["prompt_tokens_details"] = {"cached_tokens": sum(int(c or 0) for c in cached)}
    return total


def reindex(choices: Any, prompt_idx: int, n: int) -> list[Any]:
    """A part's choices with their indices moved to the batch's: ``prompt_idx * n + index``."""
    if not isinstance(choices, list):
        return []
    out = []
    for choice in choices:
        if isinstance(choice, dict):
            choice = {**choice, "index": prompt_idx * n + int(choice.get("index") or 0)}
        out.append(choice)
    return out


#: The headers a batch's answer sends (the rest of each part's go to the body: :func:`route_of`).
BATCH_HEADERS = ("X-Request-Id", "X-KVP2P-Batch-Prompts")
_PART_HEADER_PREFIX = "x-kvp2p-"


def route_of(headers: Mapping[str, str]) -> dict[str, str]:
    """One part's ``X-KVP2P-*`` headers (its instances and times, and its cached tokens with ``--cache-headers``)
    as the batch's body carries them: ``X-KVP2P-Prefill-Instance`` -> ``prefill_instance``, the values as they are."""
    return {name[len(_PART_HEADER_PREFIX):].lower().replace("-", "_"): value for name, value in headers.items()
            if name.lower().startswith(_PART_HEADER_PREFIX)}


def merge_answers(parts: Sequence[dict[str, Any]], n: int,
                  routes: Sequence[Mapping[str, str]] | None = None) -> dict[str, Any]:
    """The parts' JSON answers (in prompt order) as one: the first part's id, created, model and other fields,
    every part's choices in order and re-indexed, the usage summed, and ``kv_transfer_params`` =
    ``{"kvp2p_parts": [each part's kv_transfer_params], "kvp2p_routes": routes}`` (each part's :func:`route_of`,
    when given). vLLM's per-request ``metrics`` are dropped, as vLLM drops them for a batch (they describe one
    generation)."""
    merged = {k: v for k, v in parts[0].items() if k != "metrics"}
    merged["choices"] = [c for i, part in enumerate(parts) for c in reindex(part.get("choices"), i, n)]
    merged["usage"] = sum_usage([part.get("usage") for part in parts])
    kv: dict[str, Any] = {"kvp2p_parts": [part.get("kv_transfer_params") for part in parts]}
    if routes is not None:
        kv["kvp2p_routes"] = [dict(r) for r in routes]
    merged["kv_transfer_params"] = kv
    return merged


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Whole SSE events in ``buffer`` (each without its blank line) and the incomplete rest."""
    buffer = buffer.replace(b"\r\n", b"\n")
    *events, rest = buffer.split(EVENT_END)
    return [e for e in events if e.strip()], rest


def event_data(event: bytes) -> bytes | None:
    """The ``data:`` payload of an event (its data lines joined), None for an event without one (a comment)."""
    lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def encode_event(data: dict[str, Any]) -> bytes:
    """One ``data:`` event, compact as vLLM writes them."""
    return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + EVENT_END


@dataclass(frozen=True)
class PartError:
    """A part's stream carried an error event (vLLM's own, or the proxy's after D failed mid-stream)."""

    error: dict[str, Any]


@dataclass
class StreamMerger:
    """Rewrites the events of every part's stream into the batch's one stream.

    Each event of part ``i`` goes out as it comes, its choices re-indexed and its id and ``created`` the batch's
    (those of the first chunk seen); each part's ``[DONE]`` and its final usage-only chunk are kept back (the usage
    summed), and :meth:`finish` gives the batch's one usage chunk and its one ``[DONE]``. With
    ``continuous_usage_stats`` each chunk's own usage goes out as it is, as vLLM sends it per prompt.
    """

    n: int
    usages: list[dict[str, Any]] = field(default_factory=list)
    head: dict[str, Any] | None = None  # id, object, created, model of the batch's chunks

    def rewrite(self, prompt_idx: int, event: bytes) -> bytes | PartError | None:
        """Part ``prompt_idx``'s ``event`` as the batch sends it: bytes, None (kept back), or :class:`PartError`."""
        data = event_data(event)
        if data is None:
            return event + EVENT_END  # a comment or other event without data: as it is
        if data.strip() == DONE:
            return None
        try:
            chunk = json.loads(data)
        except ValueError:
            return event + EVENT_END
        if not isinstance(chunk, dict):
            return event + EVENT_END
        if "error" in chunk:
            error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
            return PartError(error)
        if self.head is None:
            self.head = {k: chunk[k] for k in ("id", "object", "created", "model") if k in chunk}
        choices = chunk.get("choices")
        if isinstance(chunk.get("usage"), dict) and not choices:
            self.usages.append(chunk["usage"])  # the part's final usage chunk
            return None
        out = {**chunk, **{k: v for k, v in self.head.items() if k in ("id", "created")}}
        if "choices" in chunk:
            out["choices"] = reindex(choices, prompt_idx, self.n)
        return encode_event(out)

    def finish(self) -> bytes:
        """The batch's last events: the summed usage (when the parts sent usage chunks) and ``[DONE]``."""
        tail = b""
        if self.usages:
            usage_chunk = {**(self.head or {}), "choices": [], "usage": sum_usage(self.usages)}
            usage_chunk.setdefault("object", "text_completion")
            tail = encode_event(usage_chunk)
        return tail + b"data: " + DONE + EVENT_END


def prefixed_error(error: dict[str, Any], prompt_idx: int, status: int) -> dict[str, Any]:
    """A part's OpenAI error, its message saying which prompt of the batch failed."""
    message = str(error.get("message", "")) or "failed"
    return {
        "message": f"prompt {prompt_idx} of the batch failed: {message}",
        "type": error.get("type", "upstream_error"),
        "param": error.get("param"),
        "code": error.get("code", status),
    }
