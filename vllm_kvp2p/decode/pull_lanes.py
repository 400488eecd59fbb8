"""D's pull threads ("lanes") and the P instances each serves.

``max_threads`` lanes are started with the :class:`~vllm_kvp2p.decode.pull_loop.PullLoop` (so they get the platform's
service-thread placement; idle ones block on their queue). Each P instance (side-channel host and base port) is
assigned up to ``LANES_PER_PEER`` lanes on first use (half the lanes at most), those serving the fewest instances,
and each plan goes to the least busy of its instance's lanes. So a frozen or slow P delays only the P instances on
its lanes (with one thread it delayed every pull of this worker for up to the transfer timeout), and two pulls from
one P overlap their side-channel round trips (a busy P answers claims late: serving runs here showed pulls queued
for 0.3-0.5 s behind one slow claim) but never their reads: one read slot per P instance keeps at most
``max_batch_entries`` Mooncake entries in flight per peer.

The table is bounded (the params a client sends name the P instances, so their number is not ours to trust): it
keeps the ``MAX_PEERS`` most recently used instances.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_kvp2p import os_threads
from vllm_kvp2p.os_threads import run_named

if TYPE_CHECKING:
    from vllm_kvp2p.lifecycle.consumer import PullPlan

#: P instances (lane assignments, suspects) and P ranks (cached registrations) remembered, most recent kept.
MAX_PEERS = 1024
#: Lanes one P instance's pulls may use at once (their round trips overlap; their reads take turns).
LANES_PER_PEER = 2

Instance = tuple[str, int]  # P's side-channel host and base port


class Lane:
    """One pull thread and its queue; serves the P instances assigned to it, one plan at a time."""

    def __init__(self, run: Callable[[Lane], None], name: str) -> None:
        self.plans: queue.Queue[PullPlan | None] = queue.Queue()
        self.instances = 0  # P instances assigned to this lane
        self.busy = 0  # plans queued or in progress (LaneTable.lock)
        self.thread = threading.Thread(target=run_named(os_threads.PULL, run), args=(self,), name=name, daemon=True)
        self.thread.start()


@dataclass
class Peer:
    """One P instance's lanes and its read slot (one Mooncake read from it at a time)."""

    lanes: list[Lane]
    read_slot: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class LaneTable:
    """The lanes, and which of them serve each P instance."""

    def __init__(self, count: int, run: Callable[[Lane], None], name: str) -> None:
        self.lock = threading.Lock()
        self._closed = False
        self._peer_of: OrderedDict[Instance, Peer] = OrderedDict()  # the MAX_PEERS most recent
        self.lanes = [Lane(run, f"{name}.{i}") for i in range(max(1, count))]

    def take(self, instance: Instance) -> Lane:
        """The lane for the next plan of ``instance``, counted busy until :meth:`done`."""
        with self.lock:
            if self._closed:
                raise RuntimeError("PullLoop is closed")
            lane = min(self._peer(instance).lanes, key=lambda ln: ln.busy)
            lane.busy += 1
            return lane

    def done(self, lane: Lane) -> None:
        with self.lock:
            lane.busy -= 1

    def peer(self, instance: Instance) -> Peer:
        with self.lock:
            return self._peer(instance)

    def read_slot(self, instance: Instance) -> threading.Lock:
        return self.peer(instance).read_slot

    def close(self) -> list[Lane]:
        """No more plans; the lanes, to stop."""
        with self.lock:
            self._closed = True
            return list(self.lanes)

    def sizes(self) -> tuple[int, int]:
        """(P instances assigned, plans queued)."""
        with self.lock:
            return len(self._peer_of), sum(lane.plans.qsize() for lane in self.lanes)

    def _peer(self, instance: Instance) -> Peer:
        """The instance's lanes, assigned on first use (call with ``lock`` held)."""
        peer = self._peer_of.get(instance)
        if peer is not None:
            self._peer_of.move_to_end(instance)
            return peer
        if len(self._peer_of) >= MAX_PEERS:
            # The least recently used goes; should it come back it may get other lanes and a new read slot, which
            # only lets its reads overlap with ones still queued on the old lanes (correct, just not serialised).
            _, evicted = self._peer_of.popitem(last=False)
            for lane in evicted.lanes:
                lane.instances -= 1
        count = min(LANES_PER_PEER, max(1, len(self.lanes) // 2))
        lanes = sorted(self.lanes, key=lambda ln: (ln.instances, ln.busy))[:count]
        for lane in lanes:
            lane.instances += 1
        peer = self._peer_of[instance] = Peer(lanes)
        return peer
