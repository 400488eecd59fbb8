"""Run a model runner's KV-cache allocation method inside the active MooncakeP2PConnector's arena scope.

Several workers allocate their KV cache without ever calling the connector's ``get_mem_pool_context()``:
vllm-ascend's ``NPUModelRunner`` (platform/ascend_hook.py) and vLLM 0.23 to 0.28's ``GPUModelRunner``, which the
CPU runner inherits (vllm_kvp2p/connector/compat.py), allocate every KV tensor in ``_allocate_kv_cache_tensors(self,
kv_cache_config)``; vLLM 0.29 and 0.30 moved that into a module function, ``allocate_kv_cache(kv_cache_config,
...)``, which the runner module imports by name. Either runs after the connector exists, so wrapping that one
method or that one name gives the arena the whole KV cache.

The wrap is guarded by the method's signature, not a version list: when it is not there in the expected form,
nothing is changed and the caller is told why (the connector then registers vLLM's tensors one by one, merged
where they touch, with the platform's region limit checked up front).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any

#: Parameters of the wrapped method in both vllm-ascend 0.23 and vLLM 0.23.
EXPECTED_PARAMS = ("self", "kv_cache_config")
#: Name of the connector-facade method the wrapper asks for an arena scope (absent on other connectors).
ARENA_CONTEXT_METHOD = "kvp2p_arena_context"

_WRAPPED_FLAG = "__kvp2p_arena_wrapped__"

SizeOf = Callable[[Any], int]


def wrap_allocation_method(module: ModuleType, class_name: str, method_name: str, size_of: SizeOf | None) -> str:
    """Wrap ``module.class_name.method_name``; returns what happened, for the caller's log line: "wrapped X.y"
    (now or before) or "none (<why>)". ``size_of(kv_cache_config)`` sizes the arena (None: the connector sizes it
    from vLLM's own KVCacheConfig)."""
    cls = getattr(module, class_name, None)
    method = getattr(cls, method_name, None) if cls is not None else None
    where = f"{class_name}.{method_name}"
    found = _found(method, where, f"{module.__name__} has no {where}", lambda p: p == EXPECTED_PARAMS,
                   str(EXPECTED_PARAMS))
    if found is not None:
        return found
    setattr(cls, method_name, _wrap(method, size_of))
    return f"wrapped {where}"


def wrap_allocation_function(module: ModuleType, function_name: str) -> str:
    """Wrap the module-level function ``module.function_name``, whose first parameter is the KVCacheConfig, where
    ``module`` looks it up (the caller's module, which imported it by name); returns what happened, as
    :func:`wrap_allocation_method` does. The arena is sized by the connector from vLLM's own KVCacheConfig."""
    function = getattr(module, function_name, None)
    where = f"{module.__name__.rpartition('.')[2]}.{function_name}"
    found = _found(function, where, f"{module.__name__} has no {function_name}",
                   lambda p: p[:1] == ("kv_cache_config",), "kv_cache_config first")
    if found is not None:
        return found

    @functools.wraps(function)
    def allocate_in_arena(kv_cache_config: Any, *args: Any, **kwargs: Any) -> Any:
        with _arena_scope(kv_cache_config, None):
            return function(kv_cache_config, *args, **kwargs)

    setattr(allocate_in_arena, _WRAPPED_FLAG, True)
    setattr(module, function_name, allocate_in_arena)
    return f"wrapped {where}"


def _found(target: Any, where: str, missing: str, params_ok: Callable[[tuple[str, ...]], bool],
           expected: str) -> str | None:
    """What to report instead of wrapping ``target`` (None: wrap it): missing, already wrapped, or another
    signature than the one the wrapper passes on."""
    if target is None or not callable(target):
        return f"none ({missing})"
    if is_wrapped(target):
        return f"wrapped {where}"
    params = param_names(target)
    return None if params_ok(params) else f"none ({where} takes {params}, expected {expected})"


def _arena_scope(kv_cache_config: Any, size_of: SizeOf | None) -> AbstractContextManager[Any]:
    return connector_arena_scope(kv_cache_config, size_of) or contextlib.nullcontext()


def is_wrapped(method: Any) -> bool:
    return bool(getattr(method, _WRAPPED_FLAG, False))


def _wrap(original: Callable[[Any, Any], Any], size_of: SizeOf | None) -> Callable[[Any, Any], Any]:
    @functools.wraps(original)
    def allocate_in_arena(self: Any, kv_cache_config: Any) -> Any:
        with _arena_scope(kv_cache_config, size_of):
            return original(self, kv_cache_config)

    setattr(allocate_in_arena, _WRAPPED_FLAG, True)
    return allocate_in_arena


def connector_arena_scope(kv_cache_config: Any, size_of: SizeOf | None) -> AbstractContextManager[Any] | None:
    """The active MooncakeP2PConnector's arena scope, or None (another connector, none, or no arena on this build:
    the runner then allocates as usual)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    make_scope = getattr(get_kv_transfer_group(), ARENA_CONTEXT_METHOD, None)
    if make_scope is None:
        return None
    return make_scope(size_of(kv_cache_config) if size_of is not None else None)


def param_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()
