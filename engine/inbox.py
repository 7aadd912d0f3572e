"""The engine thread's inbox: commands from other threads, run in order on the engine thread.

Each command may come with the future its caller waits on; when the engine thread ends (a crash,
a failed load, shutdown) the inbox closes and fails those futures, so no caller waits for ever on a
command that will never run."""
from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable

from engine.client import EngineDeadError


class Inbox:
    def __init__(self) -> None:
        self.wake = threading.Event()  # set when a command arrives (or the thread should look again)
        self._lock = threading.Lock()
        self._commands: collections.deque = collections.deque()  # (command, its answer or None)
        self._closed: str | None = None

    def put(self, command: Callable[[], None], answer: concurrent.futures.Future | None = None) -> None:
        """Queues `command`; EngineDeadError at once if the inbox has closed."""
        with self._lock:
            if self._closed is not None:
                raise EngineDeadError(self._closed)
            self._commands.append((command, answer))
        self.wake.set()

    def take(self) -> Callable[[], None] | None:
        """The oldest command, taken off (one at a time, so that if one crashes the engine loop those
        behind it are still here for close()); None, and `wake` cleared, when there is none."""
        with self._lock:
            if not self._commands:
                self.wake.clear()
                return None
            return self._commands.popleft()[0]

    def close(self, error: str) -> None:
        """No command runs from now on: each queued one's answer fails with EngineDeadError(error), and
        put() refuses."""
        with self._lock:
            self._closed = error
            stranded = list(self._commands)
            self._commands.clear()
        for _, answer in stranded:
            if answer is not None and not answer.done():
                answer.set_exception(EngineDeadError(error))
