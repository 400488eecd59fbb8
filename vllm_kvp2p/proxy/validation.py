"""What the proxy checks in a completion, chat or responses request before any P is asked (pure).

P gets a changed copy of the request (``n``, ``max_tokens``, ``stream`` replaced; ``stream_options``, ``min_tokens``,
``min_completion_tokens``, ``best_of``, ``use_beam_search``, ``seed`` dropped: :mod:`~vllm_kvp2p.proxy.endpoints`),
so P never sees those values. Were one of them something D refuses, P would already hold the prompt's KV for a
decoder that never comes (until P's hold timeout). So each value P does not see is checked here, the way vLLM 0.32
checks it (pydantic's lax parsing: ``"3"`` and ``3.0`` are an int, ``"yes"`` a bool), and the whole request is
refused with a 400 naming the field before anything is sent.

Some checks are deliberately stricter than vLLM and bounded by the proxy's own settings: ``n`` (a JSON integer, at
most ``--max-n``: one request may not ask for millions of sequences) and ``prompt`` on ``/v1/completions`` (a
string, a list of token ids, or a batch of at most ``--max-batch-prompts`` of either, never mixed, never bools),
since the proxy splits a batch into one P/D request per prompt; and a list of several ``prompt_embeds``, which it
does not split (P would prefill them as one batch and answer for one prompt only).

``best_of`` is not checked: vLLM 0.32's completion and chat requests have no such field and ignore it whatever its
value, so D cannot refuse it; it is only not sent to P.

A ``/v1/responses`` request (:func:`check_responses`) has ``max_output_tokens``, ``stream``, ``store`` and
``background`` replaced for P, so those are checked the same way; and what the proxy cannot disaggregate is refused
with a 400 naming it rather than answered differently: ``previous_response_id`` (the conversation is in the store of
the one engine that answered it, which P is not) and ``background: true`` (the response would be polled on the one
engine running it, through routes the proxy does not serve).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_kvp2p.proxy.upstream import ProxyError

#: vLLM's own bound on ``n`` (``VLLM_MAX_N_SEQUENCES``' default in vllm/envs.py, 0.32).
DEFAULT_MAX_N = 16384
#: The most prompts one batched ``/v1/completions`` request may carry (``--max-batch-prompts``).
DEFAULT_MAX_BATCH_PROMPTS = 1024
#: The largest request body the proxy reads (``--max-body-bytes``): the largest real prompt, 1,000,000 tokens as
#: token ids (at most 8 bytes each: six digits and ", "). A body holds the proxy's event loop 25-55 ms per MiB of
#: token ids at a time (parsed, then serialised for P and D: docs/performance.md section 19), every client waiting.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024

# vLLM's _SAMPLING_EPS: a temperature below it is greedy sampling.
_GREEDY_TEMPERATURE = 1e-5
# pydantic's lax str -> bool table (case-insensitive), which vLLM's request models use.
_TRUE_STRINGS = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE_STRINGS = frozenset({"0", "off", "f", "false", "n", "no"})


@dataclass(frozen=True)
class Limits:
    """The proxy's bounds on a request (its settings)."""

    #: The most sequences one request may ask for: its ``n`` times its prompts (a batch's).
    max_n: int = DEFAULT_MAX_N
    max_batch_prompts: int = DEFAULT_MAX_BATCH_PROMPTS
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if self.max_n < 1 or self.max_batch_prompts < 1 or self.max_body_bytes < 1:
            raise ValueError(f"max_n={self.max_n}, max_batch_prompts={self.max_batch_prompts}, max_body_bytes="
                             f"{self.max_body_bytes}: each must be >= 1")


def invalid(param: str, message: str) -> ProxyError:
    """A 400 naming the request field at fault."""
    return ProxyError(400, message, "invalid_request_error", param)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def lax_bool(value: Any) -> bool | None:
    """``value`` as vLLM's pydantic models read a ``bool | None`` field; ``ValueError`` where they refuse it."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        low = value.strip().lower()
        if low in _TRUE_STRINGS:
            return True
        if low in _FALSE_STRINGS:
            return False
    raise ValueError(f"not a boolean: {_shown(value)}")


def lax_int(value: Any) -> int | None:
    """``value`` as vLLM's pydantic models read an ``int | None`` field; ``ValueError`` where they refuse it."""
    if value is None or isinstance(value, int):  # bool included: pydantic reads True as 1
        return None if value is None else int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            number = float(value.strip()) if "." in value else int(value.strip())
        except ValueError:
            pass
        else:
            if float(number).is_integer():
                return int(number)
    raise ValueError(f"not an integer: {_shown(value)}")


def check_request(body: dict[str, Any], *, chat: bool, limits: Limits) -> None:
    """Raise a 400 :class:`ProxyError` (``param`` set) for the first value the proxy refuses, else nothing.

    Where vLLM refuses the same value its message is vLLM's, word for word (a client sees the same error through
    the proxy as from one instance), the proxy's own bound added after it."""
    n = check_n(body, chat=chat, limits=limits)
    _check_greedy(body, n)
    if not chat:
        prompts = check_prompt(body.get("prompt"), limits)
        if n * prompts > limits.max_n:  # a batch multiplies n: one request, n sequences per prompt
            raise invalid("n", f"prompt holds {prompts} prompts and n is {n}: {n * prompts} sequences, more than "
                               f"the proxy takes in one request (at most {limits.max_n}: its --max-n)")
        embeds = body.get("prompt_embeds")
        if isinstance(embeds, list) and len(embeds) > 1:
            # vLLM would prefill them as one batch on P and answer one prompt's kv_transfer_params: not split here.
            raise invalid("prompt_embeds", "the P/D proxy takes one prompt's embeddings per request, not a list of "
                                           f"{len(embeds)}: send one request per prompt")
    _bool_field(body, "stream")
    _check_stream_options(body)
    _check_token_counts(body, chat=chat)
    _check_seed(body)
    if "use_beam_search" in body and body["use_beam_search"] is None:  # vLLM's field is a bool, not Optional
        raise invalid("use_beam_search", "use_beam_search must be a boolean, got None")
    if _bool_field(body, "use_beam_search"):
        # vLLM's beam search runs requests of its own without the prefill's kv_transfer_params: D would compute the
        # prompt itself and P hold it for nobody until its hold timeout.
        raise invalid("use_beam_search", "use_beam_search: the P/D proxy cannot disaggregate a beam search (vLLM "
                                         "runs it as requests of its own, without the prefill's KV); send it to "
                                         "one engine directly")
    _check_raw_readings(body, chat=chat)


def _check_raw_readings(body: dict[str, Any], *, chat: bool) -> None:
    """vLLM's "before" validators that read a field P does not get as the client sent it (``stream``,
    ``stream_options``, ``use_beam_search``, ``max_tokens``), mirrored. They read the raw JSON values with Python's
    truthiness, not pydantic's reading: ``"stream": "false"`` is false for the request (pydantic) and true for
    these checks (a non-empty string), so D refuses ``"false"`` with ``prompt_logprobs: 1`` that P, sent ``stream:
    false``, accepts. Each message is vLLM's (0.23 and 0.32 alike)."""
    if body.get("stream_options") and not body.get("stream"):
        raise invalid("stream_options", "Stream options can only be defined when `stream=True`.")
    prompt_logprobs = body.get("prompt_logprobs")
    if (body.get("stream") and isinstance(prompt_logprobs, (int, float))
            and (prompt_logprobs > 0 or prompt_logprobs == -1)):
        raise invalid("prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`.")
    if body.get("logprob_token_ids") and body.get("use_beam_search"):
        raise invalid("logprob_token_ids", "`logprob_token_ids` is not supported with beam search.")
    if chat:
        return
    if body.get("use_beam_search") and body.get("echo") and body.get("logprobs") is not None:
        raise invalid("echo", "`echo` with `logprobs` is not supported with beam search because beam search does not "
                              "compute prompt logprobs.")
    if body.get("logprob_token_ids") and body.get("echo") and body.get("max_tokens") == 0:
        raise invalid("logprob_token_ids", "`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` "
                                           "because no output tokens are generated.")


def check_n(body: dict[str, Any], *, chat: bool, limits: Limits) -> int:
    """The request's ``n`` (1 when absent, or null on chat, as vLLM reads it); a 400 unless ``1 <= n <= max_n``."""
    if "n" not in body or (chat and body["n"] is None):
        return 1
    n = body["n"]
    if type(n) is not int:
        raise invalid("n", f"n must be an integer, got {_shown(n)} ({type(n).__name__})")
    if n < 1:
        raise invalid("n", f"n must be at least 1, got {n}.")
    if n > limits.max_n:
        raise invalid("n", f"n must be at most {limits.max_n}, got {n}. (The proxy's --max-n.)")
    return n


def _check_greedy(body: dict[str, Any], n: int) -> None:
    """vLLM refuses n > 1 with greedy sampling (an explicit temperature below 1e-5; beam search aside); P, asked for
    one sequence, would not. An absent temperature is the model's default, which the proxy cannot see."""
    try:
        beam_search = lax_bool(body.get("use_beam_search"))
    except ValueError:
        return  # refused as a bool below
    if n == 1 or beam_search:
        return
    temperature = body.get("temperature")
    try:
        value = None if isinstance(temperature, bool) or temperature is None else float(temperature)
    except (TypeError, ValueError):
        return  # P refuses it itself (temperature is sent to P as it is)
    if value is not None and value < _GREEDY_TEMPERATURE:
        raise invalid("n", f"n must be 1 when using greedy sampling, got {n}.")


def _is_token_ids(value: Any) -> bool:
    """A list of integers >= 0 (bools not: their type is not int). In C: a 1,000,000-token prompt costs ~30 ms."""
    return isinstance(value, list) and (not value or (set(map(type, value)) == {int} and min(value) >= 0))


def check_prompt(prompt: Any, limits: Limits) -> int:
    """A completion ``prompt``: a string, token ids, or a batch of at most ``max_batch_prompts`` strings or of
    token-id lists (never both); returns its number of prompts. Anything not a list is left to vLLM
    (``prompt_embeds`` may stand in for it): one prompt."""
    if not isinstance(prompt, list):
        return 1
    if not prompt:
        raise invalid("prompt", "prompt must not be an empty list")
    if all(isinstance(p, str) for p in prompt):
        kind = "strings"
    elif all(isinstance(p, list) for p in prompt):
        kind = "token-id lists"
        for i, ids in enumerate(prompt):
            if not ids or not _is_token_ids(ids):
                raise invalid("prompt", f"prompt[{i}] must be a non-empty list of token ids (integers >= 0), "
                                        f"got {_shown(ids)}")
    elif _is_token_ids(prompt):
        return 1  # one prompt's token ids
    else:
        raise invalid("prompt", "prompt must be a string, a list of token ids (integers >= 0), or a list of "
                                f"strings or of token-id lists, not mixed: got {_shown(prompt)}")
    if len(prompt) > limits.max_batch_prompts:
        raise invalid("prompt", f"prompt holds {len(prompt)} {kind}: the proxy takes at most "
                                f"{limits.max_batch_prompts} per request (--max-batch-prompts)")
    return len(prompt)


def _bool_field(body: dict[str, Any], name: str, where: dict[str, Any] | None = None,
                param: str | None = None) -> bool:
    try:
        return bool(lax_bool((body if where is None else where).get(name)))
    except ValueError as exc:
        raise invalid(param or name, f"{param or name} must be a boolean: {exc}") from exc


def _check_stream_options(body: dict[str, Any]) -> None:
    options = body.get("stream_options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise invalid("stream_options", f"stream_options must be an object, got {_shown(options)}")
    for key in ("include_usage", "continuous_usage_stats"):
        _bool_field(body, key, options, f"stream_options.{key}")


def _int_field(body: dict[str, Any], name: str, minimum: int) -> int | None:
    try:
        value = lax_int(body.get(name))
    except ValueError as exc:
        raise invalid(name, f"{name} must be an integer: {exc}") from exc
    if value is not None and value < minimum:
        raise invalid(name, f"{name} must be greater than or equal to {minimum}, got {value}.")
    return value


#: vLLM's bounds on ``seed`` (its request models: ``Field(None, ge=_INT64_MIN, le=_INT64_MAX)``).
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _check_seed(body: dict[str, Any]) -> None:
    """``seed`` (dropped for P, endpoints.py): an integer within vLLM's 64-bit bounds, or null."""
    try:
        seed = lax_int(body.get("seed"))
    except ValueError as exc:
        raise invalid("seed", f"seed must be an integer: {exc}") from exc
    if seed is not None and not _INT64_MIN <= seed <= _INT64_MAX:
        raise invalid("seed", f"seed must be between {_INT64_MIN} and {_INT64_MAX}, got {seed}.")


#: vLLM's default ``max_tokens`` of a completion request (a null is read as it too).
_COMPLETION_MAX_TOKENS = 16
#: The most tokens vLLM generates whatever the context (its platforms' bound, ``sys.maxsize``): a larger minimum is
#: refused by every D.
_MAX_GENERATED = 2**63 - 1


def _check_token_counts(body: dict[str, Any], *, chat: bool) -> None:
    """``max_tokens`` / ``max_completion_tokens`` (replaced for P) and ``min_tokens`` / ``min_completion_tokens``
    (dropped for P), as vLLM's serving code turns them into ``SamplingParams``: integers, not negative; the maximum
    D would generate at least 1 (a completion's null is its default, 16; ``max_tokens: 0`` with ``echo`` generates
    one token); the minimum within it. Past the room the context leaves after the prompt vLLM clips the maximum,
    which only the engine knows (docs/api.md: what is left to D)."""
    max_tokens = _int_field(body, "max_tokens", 0)
    max_completion = _int_field(body, "max_completion_tokens", 0)
    _int_field(body, "min_completion_tokens", 0)  # not a vLLM 0.32 field (ignored there), still an integer
    if body.get("min_tokens") is None and "min_tokens" in body:
        raise invalid("min_tokens", "min_tokens must be an integer, got None")
    min_tokens = _int_field(body, "min_tokens", 0) or 0
    if chat:
        limit = max_completion if max_completion is not None else max_tokens
    else:
        limit = _COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens
        if limit == 0 and _echo(body):
            limit = 1  # vLLM echoes the prompt and generates one token
    if limit == 0:  # vLLM's message (its SamplingParams' field), the field the client sent named
        raise invalid("max_completion_tokens" if chat and max_completion is not None else "max_tokens",
                      "max_tokens must be at least 1, got 0.")
    if limit is None and min_tokens > _MAX_GENERATED:
        limit = _MAX_GENERATED  # no context leaves room for it
    if limit is not None and min_tokens > limit:
        raise invalid("min_tokens", f"min_tokens must be less than or equal to max_tokens={limit}, got {min_tokens}.")


def _echo(body: dict[str, Any]) -> bool:
    try:
        return bool(lax_bool(body.get("echo")))
    except ValueError:
        return False  # P refuses it (echo is sent to P as it is)


def check_responses(body: dict[str, Any]) -> None:
    """A ``/v1/responses`` request: a 400 :class:`ProxyError` (``param`` set) for the first value the proxy refuses.

    P gets ``max_output_tokens: 1``, ``stream: false``, ``store: false``, ``background: false``; each client value
    of those is checked as vLLM reads it (0.23 and 0.32's ``ResponsesRequest``), and what needs one engine's stored
    state is refused with a message saying to send it to an engine directly."""
    if body.get("previous_response_id") is not None:
        raise invalid("previous_response_id", (
            "previous_response_id is not supported by the P/D proxy: the response it names is stored only on the "
            "engine that answered it, and the prefill instance would not find it. Send the whole conversation as "
            "`input` instead, or send requests that continue a stored response to one engine (a vLLM instance) "
            "directly."))
    if body.get("background") and not body.get("store", True):
        # vLLM's "before" validator reads both raw ("false" is true there); P, sent false and false, accepts them.
        raise invalid("background", "background can only be used when `store` is true")
    if _bool_field(body, "background"):
        raise invalid("background", (
            "background is not supported by the P/D proxy: a background response runs, is stored and is polled "
            "(GET /v1/responses/{id}) on one engine, which the proxy does not route to. Send background requests to "
            "one engine (a vLLM instance) directly."))
    _bool_field(body, "stream")
    _bool_field(body, "store")
    _check_seed(body)
    try:
        max_output = lax_int(body.get("max_output_tokens"))
    except ValueError as exc:
        raise invalid("max_output_tokens", f"max_output_tokens must be an integer: {exc}") from exc
    if max_output is not None and max_output < 1:  # vLLM's SamplingParams check, its message (D would refuse it)
        raise invalid("max_output_tokens", f"max_tokens must be at least 1, got {max_output}.")
