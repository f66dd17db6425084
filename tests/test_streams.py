"""LaunchThread: calls run in order on their own thread, errors come back to the caller, pending bytes are bounded."""
import threading
import time

import pytest
import torch

from offload_trainer.streams import LaunchThread


def test_calls_run_in_order_and_drain_waits_for_them():
    t = LaunchThread(torch.device("cpu"), limit_bytes=1 << 30)
    seen = []
    for i in range(200):
        t.submit(lambda i=i: (time.sleep(0.0005) if i % 50 == 0 else None, seen.append(i)))
    t.drain()
    assert seen == list(range(200))
    t.close()
    t._thread.join(timeout=10)
    assert not t._thread.is_alive()


def test_an_error_is_raised_by_the_next_drain_and_later_calls_are_dropped():
    t = LaunchThread(torch.device("cpu"), limit_bytes=1 << 30)
    gate, seen = threading.Event(), []
    t.submit(gate.wait)
    t.submit(lambda: 1 / 0)
    t.submit(seen.append, "after the error")
    gate.set()
    with pytest.raises(RuntimeError, match="launch thread failed") as e:
        t.drain()
    assert isinstance(e.value.__cause__, ZeroDivisionError) and seen == []
    t.submit(seen.append, "again")  # usable afterwards
    t.drain()
    assert seen == ["again"]
    t.close()


def test_submit_waits_while_too_many_bytes_are_pending():
    t = LaunchThread(torch.device("cpu"), limit_bytes=10)
    gate = threading.Event()
    t.submit(gate.wait, nbytes=8)
    t.submit(lambda: None, nbytes=8)  # 16 pending > 10: the next submit must wait for the first call
    returned = threading.Event()
    caller = threading.Thread(target=lambda: (t.submit(lambda: None, nbytes=1), returned.set()))
    caller.start()
    assert not returned.wait(0.3)
    gate.set()
    assert returned.wait(10)
    t.drain()
    assert t._pending_bytes == 0
    t.close()
