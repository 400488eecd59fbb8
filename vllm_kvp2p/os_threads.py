"""Operating-system names for the connector's threads: what ``top -H``, ``ps -L``, ``py-spy`` and
``/proc/<pid>/task/*/comm`` show.

Python 3.11 names its threads for Python only; the kernel sees every thread of an engine process as
``VLLM::EngineCore`` (or ``VLLM::Worker``), so an operator cannot tell the side channel, the pull threads or
Mooncake's transport from vLLM's own threads when a core is busy. Each thread of the connector names itself as it
starts, and Mooncake's engine is started under a temporary name: Linux gives a new thread its creator's name, so
the threads Mooncake starts then are ``kvp2p-mooncake``. Names are cut to the kernel's 15 bytes. Where ``prctl``
is missing (not Linux) every call does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Callable, Iterator
from typing import Any

_PR_SET_NAME = 15
_PR_GET_NAME = 16
_MAX = 15  # TASK_COMM_LEN - 1

SIDE_CHANNEL = "kvp2p-side"
PULL = "kvp2p-pull"
DIGEST = "kvp2p-digest"
MOONCAKE = "kvp2p-mooncake"


def _load_prctl() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()


def current_name() -> str:
    """This thread's kernel name ("" where it cannot be read)."""
    if _prctl is None:
        return ""
    buf = ctypes.create_string_buffer(_MAX + 1)
    if _prctl(_PR_GET_NAME, buf, 0, 0, 0) != 0:
        return ""
    return buf.value.decode(errors="replace")


def set_name(name: str) -> None:
    """Name this thread for the kernel (the first 15 bytes)."""
    if _prctl is not None:
        _prctl(_PR_SET_NAME, name.encode()[:_MAX], 0, 0, 0)


@contextlib.contextmanager
def named(name: str) -> Iterator[None]:
    """This thread carries ``name`` inside the block (so do the threads it starts there), its own name after."""
    before = current_name()
    set_name(name)
    try:
        yield
    finally:
        if before:
            set_name(before)


def run_named(name: str, target: Callable[..., None]) -> Callable[..., None]:
    """``target`` wrapped to name its thread first: ``threading.Thread(target=run_named(PULL, f), ...)``."""

    def run(*args: Any, **kwargs: Any) -> None:
        set_name(name)
        target(*args, **kwargs)

    return run
