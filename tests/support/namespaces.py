"""Network namespaces for a test package (vllm_kvp2p/testing/netns.py): made once, deleted after, skipped with
the reason where they cannot be made. Used by tests/e2e_netns and tests/e2e_multinode."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Sequence

from tests.support.ci_mode import lacks
from vllm_kvp2p.testing.netns import Network, create_network, unavailable_reason

#: Nothing that names an address: the connector must find it itself.
NO_HOST_SETTINGS: dict[str, str | None] = {"VLLM_KVP2P_HOST": None, "VLLM_HOST_IP": None,
                                           "VLLM_KVP2P_BIND_HOST": None}


def namespaces(roles: Sequence[str]) -> Iterator[Network]:
    """For a fixture: ``yield from namespaces(("prefill", "decode"))``."""
    reason = unavailable_reason()
    if reason is not None:
        lacks(reason)  # CI runs as root: there it fails
    try:
        net = create_network(roles)
    except subprocess.CalledProcessError as exc:
        lacks(f"cannot create network namespaces here: {' '.join(exc.cmd)}: {exc.stderr.strip()}")
    try:
        yield net
    finally:
        net.teardown()
