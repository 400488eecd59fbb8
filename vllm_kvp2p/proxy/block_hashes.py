"""A prompt's prefix-cache block hashes, computed the way the engines compute them. No I/O.

vLLM hashes each full block of ``block_size`` tokens as ``H((parent_hash, tuple(block_tokens), extra_keys))``,
the first block's parent being ``NONE_HASH = H(seed)``, with ``H`` the ``--prefix-caching-hash-algo`` (``sha256``:
SHA-256 of the pickled tuple, the default; ``sha256_cbor``: of its canonical CBOR) and the seed
``PYTHONHASHSEED`` when set, else a fixed ``"vllm-none-hash"`` for these algorithms on vLLM 0.32 (on earlier
releases and for ``xxhash`` a random per-process seed: those engines need ``PYTHONHASHSEED`` set for anyone,
the proxy included, to match them). ``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens``, ``init_none_hash``.

Routing by hashes that do not match the engines' would send every prompt to the least-loaded instance while
claiming prefix hits; so the proxy checks its hashes against each instance's own ``BlockStored`` events
(:meth:`PromptHasher.check`, a first block recomputed from the tokens the event carries) and routes by an
instance's cache only once they agree. :func:`make_hasher` refuses what can never match (an unknown algorithm,
``xxhash`` without the package, a non-cryptographic hash without a seed).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from vllm_kvp2p.proxy.kv_events import BlockKey, BlocksStored, block_key

ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_ALGORITHM = "sha256"
#: vLLM 0.32's seed for cryptographic algorithms when PYTHONHASHSEED is unset (``DEFAULT_NONE_HASH_SEED``).
VLLM_DEFAULT_SEED = "vllm-none-hash"
#: Prompts longer than this many blocks are hashed only this far (routing needs the prefix, not the tail).
MAX_PROMPT_BLOCKS = 8192


class HashSettingsError(ValueError):
    """Hash settings under which the proxy could never match the engines' hashes."""


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _cbor_dumps() -> Callable[[Any], bytes]:
    try:
        import cbor2
    except ImportError as exc:
        raise HashSettingsError("hash algorithms *_cbor need the cbor2 package (pip install cbor2)") from exc
    return lambda obj: cbor2.dumps(obj, canonical=True)


def _hash_function(algorithm: str) -> Callable[[Any], bytes]:
    if algorithm == "sha256":
        return _sha256
    if algorithm == "sha256_cbor":
        dumps = _cbor_dumps()
        return lambda obj: hashlib.sha256(dumps(obj)).digest()
    if algorithm in ("xxhash", "xxhash_cbor"):
        try:
            import xxhash
        except ImportError as exc:
            raise HashSettingsError(f"prefix-caching hash algorithm {algorithm} needs the xxhash package") from exc
        serialize = _cbor_dumps() if algorithm == "xxhash_cbor" else (
            lambda obj: pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        return lambda obj: xxhash.xxh3_128_digest(serialize(obj))
    raise HashSettingsError(f"prefix-caching hash algorithm {algorithm!r}: known are {', '.join(ALGORITHMS)}")


class PromptHasher:
    """The block keys of token-id prompts, for one algorithm and seed."""

    def __init__(self, algorithm: str, seed: str) -> None:
        self.algorithm = algorithm
        self.seed = seed
        self._hash = _hash_function(algorithm)
        self._none_hash = self._hash(seed)

    def block_hashes(self, token_ids: Sequence[int], block_size: int) -> list[bytes]:
        """The raw hashes of the prompt's full blocks (at most :data:`MAX_PROMPT_BLOCKS`)."""
        if block_size < 1:
            raise ValueError(f"block_size={block_size}")
        parent = self._none_hash
        out: list[bytes] = []
        full = min(len(token_ids) // block_size, MAX_PROMPT_BLOCKS)
        for b in range(full):
            parent = self._hash((parent, tuple(token_ids[b * block_size : (b + 1) * block_size]), None))
            out.append(parent)
        return out

    def keys(self, token_ids: Sequence[int], block_size: int) -> tuple[BlockKey, ...]:
        return tuple(block_key(h) for h in self.block_hashes(token_ids, block_size))

    def check(self, event: BlocksStored) -> bool | None:
        """Do this hasher's hashes equal the engine's for the event's first block? ``None``: cannot tell.

        Only a first block of a prompt (no parent) checks the seed as well as the algorithm; blocks hashed with
        extra keys (LoRA, images, a cache salt) are not comparable.
        """
        if event.raw_parent is not None or event.has_extra_keys or len(event.token_ids) < event.block_size:
            return None
        ours = self._hash((self._none_hash, tuple(event.token_ids[: event.block_size]), None))
        return block_key(ours) == event.keys[0]


def make_hasher(algorithm: str = DEFAULT_ALGORITHM, seed: str | None = None) -> PromptHasher:
    """The hasher for the engines' ``--prefix-caching-hash-algo`` and ``PYTHONHASHSEED`` (``None``: unset).

    Raises :class:`HashSettingsError` where no seed could match: a non-cryptographic algorithm whose engines, without
    ``PYTHONHASHSEED``, draw a random seed per process.
    """
    if seed is None and algorithm.startswith("xxhash"):
        raise HashSettingsError(
            f"--prefix-caching-hash-algo {algorithm} without PYTHONHASHSEED gives every engine process a random "
            "seed, so no router can match its block hashes: set PYTHONHASHSEED to one value on every engine and "
            "give the proxy the same value (--hash-seed)"
        )
    return PromptHasher(algorithm, VLLM_DEFAULT_SEED if seed is None else seed)
