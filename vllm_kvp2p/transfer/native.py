"""The optional C++ extension ``vllm_kvp2p._C``, behind one import that never fails.

``build_descriptors`` is the C++ descriptor builder taking the same arguments as
:func:`vllm_kvp2p.transfer.descriptors.build_descriptors_py` and returning ``(local_addrs, remote_addrs,
lengths)`` as three lists, or ``None`` when the extension was not built (``VLLM_KVP2P_SKIP_EXT=1``) or does
not load. ``AVAILABLE`` says which.

The C++ code works on 64-bit integers. For inputs outside that domain (a value that is not an integer or not
64-bit, or an address past 2**64 - 1) it raises TypeError/OverflowError; the caller,
:func:`vllm_kvp2p.transfer.descriptors.build_descriptors`, answers with the Python reference then, so its result
is the reference's for every input.

Importing this module imports neither torch nor vllm.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_kvp2p.log import get_logger

logger = get_logger(__name__)

Triple = tuple[list[int], list[int], list[int]]

try:
    from vllm_kvp2p import _C
except ImportError as exc:  # not built, or built for another interpreter
    _C = None
    _import_error: ImportError | None = exc
else:
    _import_error = None

AVAILABLE: bool = _C is not None

build_descriptors: Callable[..., Triple] | None = _C.build_descriptors if _C is not None else None

if AVAILABLE:
    logger.debug("vllm_kvp2p: using the C++ extension %s", getattr(_C, "__file__", "vllm_kvp2p._C"))
else:
    logger.debug("vllm_kvp2p: C++ extension not available (%s); using the pure-Python paths", _import_error)

__all__ = ["AVAILABLE", "build_descriptors"]
