"""D side at run time: how a finished pull is told to the operator. A failed pull is one WARNING with its kind and a
hint (:data:`~vllm_kvp2p.lifecycle.pull_actions.FAILURE_HINTS`); a good one a DEBUG line; a pull left unverified
because P's integrity sums were too busy to answer within D's budget a WARNING at most once a minute, with the
count of those not logged since (P's question queue full of other readers' questions, or P's sums slow)."""

from __future__ import annotations

import time

from vllm_kvp2p.lifecycle.integrity import NoSums
from vllm_kvp2p.lifecycle.pull_actions import FAILURE_HINTS, PullResult
from vllm_kvp2p.log import WarningPace, get_logger

logger = get_logger(__name__)

#: Seconds between two WARNINGs of pulls left unverified because P was too busy to sum in time.
BUSY_WARNING_INTERVAL_S = 60.0


class PullLog:
    """The log lines of one D rank's finished pulls (pull threads share it: a race costs a line, no more)."""

    def __init__(self) -> None:
        self._pace = WarningPace(BUSY_WARNING_INTERVAL_S)

    def finished(self, result: PullResult) -> None:
        if result.reason:
            kind = result.failure.value if result.failure is not None else "not reported"
            hint = FAILURE_HINTS.get(result.failure) if result.failure is not None else None
            logger.warning("pull of %s failed (%s): %s%s", result.request_id, kind, result.reason,
                           f" [{hint}]" if hint else "")
            return
        logger.debug("pull of %s done (%s): %d blocks, %d bytes%s", result.request_id, result.outcome.value,
                     result.num_blocks, result.num_bytes,
                     f", unverified: {result.unverified_reason}" if result.unverified else "")
        if result.unverified and result.unverified_reason.endswith(f": {NoSums.BUSY.value}"):
            self._warn_busy(result)

    def _warn_busy(self, result: PullResult) -> None:
        unwarned = self._pace.allow("busy", time.monotonic())
        if unwarned is None:
            return
        more = f" ({unwarned} more since the last warning)" if unwarned else ""
        logger.warning("pull of %s counts as unverified: %s (P's integrity sums could not answer within this "
                       "release's budget, side_channel_timeout: P's question queue is busy with other readers' "
                       "questions, or its sums are slow)%s", result.request_id, result.unverified_reason, more)
