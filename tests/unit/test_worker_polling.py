"""vLLM's shared-memory readers spin 1 s after each message; the connector bounds that window
(vllm_kvp2p/platform/worker_polling.py). Checked on vLLM's real SpinCondition, in a fresh interpreter because the
bound is process-wide."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCENARIO = textwrap.dedent('''
    import sys, time, zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    from vllm_kvp2p.platform import worker_polling

    ctx = zmq.Context()
    writer = SpinCondition(is_reader=False, context=ctx, notify_address="inproc://kvp2p-spin")
    reader = SpinCondition(is_reader=True, context=ctx, notify_address="inproc://kvp2p-spin")

    def wait_ms():
        reader.record_read()  # a message just arrived
        time.sleep(0.05)      # 50 ms later the reader waits for the next one, which never comes
        t0 = time.perf_counter()
        reader.wait(timeout_ms=200)
        return (time.perf_counter() - t0) * 1e3

    spinning = wait_ms()  # still inside vLLM's 1 s window: yields and returns at once (the caller loops)
    if sys.argv[1] == "bound":
        assert worker_polling.limit_busy_poll(0.002)
        assert worker_polling.limit_busy_poll(0.5)  # idempotent; the smallest window wins
    bounded = wait_ms()
    print("BUSY_LOOP_S", reader.busy_loop_s)
    print("SPINNING_MS %.1f BOUNDED_MS %.1f" % (spinning, bounded))
''')


def _run(mode: str) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", SCENARIO, mode], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    values: dict[str, float] = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if parts and parts[0] in ("BUSY_LOOP_S", "SPINNING_MS"):
            values.update({parts[i]: float(parts[i + 1]) for i in range(0, len(parts), 2)})
    return values


def test_bounded_reader_sleeps_on_its_socket_instead_of_spinning() -> None:
    v = _run("bound")
    assert v["SPINNING_MS"] < 20  # vLLM's behaviour: 50 ms after a message it is still spinning
    assert v["BUSY_LOOP_S"] == 0.002  # the existing reader was clamped
    assert v["BOUNDED_MS"] >= 150  # it now waits on its notify socket (200 ms timeout, nothing sent)


def test_without_the_bound_the_reader_keeps_spinning() -> None:
    v = _run("unbound")
    assert v["BUSY_LOOP_S"] == 1
    assert v["BOUNDED_MS"] < 20
