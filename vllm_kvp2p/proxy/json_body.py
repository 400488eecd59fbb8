"""A request body's JSON, parsed within bounds that keep one request's share of the proxy's event loop small (pure).

The proxy parses every body on its event loop (and the flow re-serialises P's and D's copies there), so what one
body costs the loop is what every other client waits. Parsing in a thread would not help: ``json.loads`` is one C
call that holds the GIL from the first byte to the last. So the cost is bounded instead (issue 45, item 8; before,
one 62 MiB body held the loop 2.3 s and a 1,000,000-deep one got a 500 with a ``RecursionError`` traceback):

* **size**: ``--max-body-bytes`` (:data:`~vllm_kvp2p.proxy.validation.DEFAULT_MAX_BODY_BYTES`, 8 MiB), enforced while
  the body is read (:mod:`asgi`): a 413 naming the setting;
* **arrays and objects**: at most :data:`MAX_CONTAINERS` in one body, counted on its bytes before it is parsed.
  Building containers is what makes JSON expensive per byte (8 MiB of ``[],`` took 2.5 s to parse, 8 MiB of token
  ids 0.19 s), and a real request has a few thousand at most (a chat's messages and their parts, tool schemas, a
  batch's 1,024 token lists);
* **nesting**: at most :data:`MAX_NESTING` levels (real requests: a dozen or so; a JSON schema a few dozen). Deeper
  than Python's recursion limit the parser itself fails; between the two the body would parse and fail later, where
  the flow re-serialises it.

Each is a 4xx that says what is wrong, before any P is asked.
"""

from __future__ import annotations

import json
from itertools import compress
from typing import Any

from vllm_kvp2p.proxy.upstream import ProxyError

#: JSON arrays and objects one request body may hold.
MAX_CONTAINERS = 65_536
#: How deep they may nest (the body's own object is level 1).
MAX_NESTING = 128

_is_container = frozenset({list, dict}).__contains__


def _invalid(message: str) -> ProxyError:
    return ProxyError(400, message, "invalid_request_error")


def containers_in(raw: bytes) -> int:
    """The JSON arrays and objects in ``raw``: its ``[`` and ``{`` outside strings. Bytes operations only (in C):
    the plain count is exact unless strings hold brackets, and then escapes are removed and the text between each
    pair of quotes is left out. (Of a malformed body, a count the parser will not need.)"""
    count = raw.count(b"[") + raw.count(b"{")
    if count <= MAX_CONTAINERS:
        return count
    # A JSON string escapes every quote and backslash it holds: without `\\` and `\"` (in that order, as the parser
    # pairs them), every quote left opens or closes a string, so the even pieces between quotes are the rest.
    outside = b"".join(raw.replace(b"\\\\", b"").replace(b'\\"', b"").split(b'"')[::2])
    return outside.count(b"[") + outside.count(b"{")


def deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) nests arrays and objects more than ``limit`` levels deep. Walks containers
    level by level, each one's members sorted out in C, so a long list of scalars (token ids) costs little."""
    level = [value] if _is_container(type(value)) and value else []
    for depth in range(1, limit + 1):
        below: list[Any] = []
        for container in level:
            members = container.values() if type(container) is dict else container
            inner = list(compress(members, map(_is_container, map(type, members))))
            if inner:
                if depth == limit:
                    return True
                below.extend(filter(None, inner))  # an empty one adds its level and nothing under it
        if not below:
            return False
        level = below
    return False


def parse_body(raw: bytes) -> dict[str, Any]:
    """A completion, chat or responses request's body: a JSON object within the bounds above, else a 400 saying
    what is wrong (its size is bounded where it is read)."""
    containers = containers_in(raw)
    if containers > MAX_CONTAINERS:
        raise _invalid(f"request body holds {containers} JSON arrays and objects: the P/D proxy takes at most "
                       f"{MAX_CONTAINERS} in one request")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _invalid(f"request body nests JSON arrays and objects too deeply: the P/D proxy takes at most "
                       f"{MAX_NESTING} levels") from None
    except ValueError as exc:
        raise _invalid(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise _invalid("request body must be a JSON object")
    if deeper_than(body, MAX_NESTING):
        raise _invalid(f"request body nests JSON arrays and objects more than {MAX_NESTING} levels deep: the P/D "
                       f"proxy takes at most {MAX_NESTING} levels")
    return body
