"""Per-user fairness: at most N requests in flight per user (a login, an API key's name, a visitor,
or a client address), shared by the API and the chat page so that one user cannot starve the rest."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class TooManyRequestsError(RuntimeError):
    """Over the per-user cap; `retry_after` is a hint in seconds."""

    def __init__(self, message: str, retry_after: int = 2) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class UserLimiter:
    """`limit` 0 means no cap. `exempt` names (operators: load tests, a UI tier's key) are never capped."""

    def __init__(self, limit: int, exempt: frozenset[str] = frozenset()) -> None:
        if limit < 0:
            raise ValueError(f"the per-user limit must be 0 (none) or more, got {limit}")
        self.limit, self.exempt = limit, exempt
        self._in_flight: dict[str, int] = {}
        self._lock = threading.Lock()

    def in_flight(self, user: str) -> int:
        return self._in_flight.get(user, 0)

    def acquire(self, user: str, name: str | None = None) -> None:
        """Take a slot or raise TooManyRequestsError. `name` (a login or key name) decides exemption."""
        with self._lock:
            held = self._in_flight.get(user, 0)
            if self.limit and name not in self.exempt and held >= self.limit:
                raise TooManyRequestsError(f"you already have {held} request{'s' * (held != 1)} in progress (the "
                                           f"limit per user is {self.limit}); wait for one to finish")
            self._in_flight[user] = held + 1

    def release(self, user: str) -> None:
        with self._lock:
            held = self._in_flight.get(user, 0) - 1
            if held > 0:
                self._in_flight[user] = held
            else:
                self._in_flight.pop(user, None)

    @contextmanager
    def slot(self, user: str, name: str | None = None) -> Iterator[None]:
        self.acquire(user, name)
        try:
            yield
        finally:
            self.release(user)
