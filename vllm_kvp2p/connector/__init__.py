"""The vLLM adapters: everything vLLM calls, and the one module that knows how vLLM versions differ.

- ``facade.py``: ``MooncakeP2PConnector``, the class vLLM instantiates; it only forwards by role.
- ``scheduler.py``: the scheduler half (vLLM's EngineCore process).
- ``worker.py``: the worker half (each vLLM worker process).
- ``metadata.py``: what the two halves tell each other once per step.
- ``compat.py``: the vLLM-version seam. ``metrics.py``: the stats vLLM carries for us.
  ``lora_weights.py``, ``step_wakeup.py``: the scheduler's LoRA identity and its idle-step wake-up.

``vllm_kvp2p.connector.MooncakeP2PConnector`` stays importable (the module path older deploy files name); it is
resolved lazily so that importing ``vllm_kvp2p.connector.compat`` does not import the whole connector.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "MooncakeP2PConnector":
        from vllm_kvp2p.connector.facade import MooncakeP2PConnector

        return MooncakeP2PConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
