"""One step at a time on the CPU, first come first served, for every engine in this process.

A deployment may hold several models (an assistant can name its own), each with its engine thread.
Two steps at once would each ask torch for every core and oversubscribe them (on this 2-core
machine a matmul beside another busy one ran many times slower); so a step waits its turn. The
turns are FIFO: a plain Lock would let the thread that just released it take it again at once and
starve the other engine."""
from __future__ import annotations

import collections
import contextlib
import threading

_lock = threading.Lock()
_queue: collections.deque[threading.Event] = collections.deque()
_busy = False


@contextlib.contextmanager
def cpu_turn():
    """Hold the CPU for one step; waits behind the steps that asked first."""
    global _busy
    with _lock:
        if _busy or _queue:
            mine = threading.Event()
            _queue.append(mine)
        else:
            mine, _busy = None, True
    if mine is not None:
        mine.wait()  # the step before hands its turn straight to this one (_busy stays True)
    try:
        yield
    finally:
        with _lock:
            if _queue:
                _queue.popleft().set()
            else:
                _busy = False


def waiting() -> int:
    """Steps waiting for their turn now (a gauge for tests and the panel)."""
    with _lock:
        return len(_queue)
