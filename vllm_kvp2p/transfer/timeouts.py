"""What Mooncake's transports are told about time, decided in one place from ``transfer_timeout`` (pure).

The lease timers are checked against ``transfer_timeout`` (config.py): a read must be over, one way or the other,
by then, on whichever transport moves it. Mooncake reads two variables when its engine is constructed:

* ``MC_TRANSFER_TIMEOUT`` (seconds, minimum 5): the wait of a blocking batch read (tcp, rdma);
* ``ASCEND_TRANSFER_TIMEOUT`` (milliseconds, Mooncake's default 3000): how long the ``ascend`` transport (ADXL)
  lets one transfer run. vllm-ascend's own connector fills it with the RoCE retransmission budget + 3 s (≈33 s).

Both come from ``transfer_timeout``; the Ascend one ends a second earlier, so the transport gives up before the
connector's bound and no transfer is still running into blocks D has already given up on. A different value in
the environment is replaced, with a warning naming both. Across nodes an NPU read rides RoCE, whose own
retransmission budget (``4.096 µs × 2^HCCL_RDMA_TIMEOUT × HCCL_RDMA_RETRY_CNT``, HCCL's defaults 20 and 7: 30.1 s)
should fit inside the transport's timeout; on the ``ascend`` protocol a budget that does not fit is warned about,
naming the setting and the value that fits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

MC_MINIMUM_S = 5
#: The Ascend transport gives up this long before the connector's bound.
ASCEND_MARGIN_MS = 1000
#: HCCL's defaults (per vllm-ascend's connector) when the variables are unset.
HCCL_RDMA_TIMEOUT_DEFAULT = 20
HCCL_RDMA_RETRY_CNT_DEFAULT = 7


@dataclass(frozen=True)
class TransportTimeouts:
    env: dict[str, str]  # the variables to set before Mooncake's engine is constructed
    warnings: tuple[str, ...]
    transfer_timeout_s: int  # the bound in force, whole seconds


def roce_budget_ms(environ: Mapping[str, str]) -> float | None:
    """HCCL's RoCE retransmission budget in ms from ``HCCL_RDMA_TIMEOUT`` / ``HCCL_RDMA_RETRY_CNT`` (their defaults
    when unset); None when either is set to something that is not a small non-negative integer."""
    try:
        timeout = int(environ.get("HCCL_RDMA_TIMEOUT", HCCL_RDMA_TIMEOUT_DEFAULT))
        retries = int(environ.get("HCCL_RDMA_RETRY_CNT", HCCL_RDMA_RETRY_CNT_DEFAULT))
    except ValueError:
        return None
    if not (0 <= timeout <= 31 and 0 <= retries <= 255):
        return None
    return 4.096e-3 * 2**timeout * retries


def transport_timeouts(transfer_timeout: float, protocol: str, environ: Mapping[str, str]) -> TransportTimeouts:
    """The environment Mooncake must see for ``transfer_timeout`` on ``protocol``, and what to warn about."""
    seconds = max(MC_MINIMUM_S, int(round(transfer_timeout)))
    env = {"MC_TRANSFER_TIMEOUT": str(seconds),
           "ASCEND_TRANSFER_TIMEOUT": str(seconds * 1000 - ASCEND_MARGIN_MS)}
    warnings: list[str] = []
    for name, value in env.items():
        given = environ.get(name)
        if given is not None and given.strip() != value:
            unit = "s" if name == "MC_TRANSFER_TIMEOUT" else "ms"
            warnings.append(f"{name}={given[:40]!r} in the environment replaced by {value} {unit} from "
                            f"transfer_timeout (VLLM_KVP2P_TRANSFER_TIMEOUT={seconds}), which the lease timers are "
                            f"checked against")
    if protocol == "ascend":
        budget = roce_budget_ms(environ)
        ascend_ms = int(env["ASCEND_TRANSFER_TIMEOUT"])
        if budget is not None and budget >= ascend_ms:
            fits = math.ceil((budget + ASCEND_MARGIN_MS) / 1000) + 1
            warnings.append(f"HCCL's RoCE retransmission budget ({budget / 1000:.1f} s from HCCL_RDMA_TIMEOUT and "
                            f"HCCL_RDMA_RETRY_CNT) exceeds ASCEND_TRANSFER_TIMEOUT ({ascend_ms} ms, from "
                            f"transfer_timeout {seconds} s): a read between nodes that needs retransmission is cut "
                            f"short; set VLLM_KVP2P_TRANSFER_TIMEOUT={fits} or more (and lease_timeout to match)")
    return TransportTimeouts(env, tuple(warnings), seconds)
