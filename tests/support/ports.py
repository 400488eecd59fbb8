"""Free TCP ports on 127.0.0.1 for tests (outside the ephemeral range; see vllm_kvp2p.testing.server)."""

from __future__ import annotations

from vllm_kvp2p.testing.server import free_port, free_port_run, free_ports

__all__ = ["free_port", "free_port_run", "free_ports"]
