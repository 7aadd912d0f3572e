"""Jobs that repeat in the background for as long as the process lives (the retention sweep, the
refresh of fetched pages): each on a daemon thread of its own, a failure logged and retried next time."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger("pagedchat.background")


def repeat(name: str, every_s: float, job: Callable[[], None], first_after_s: float = 0.0) -> threading.Thread:
    """Run `job` after `first_after_s`, then every `every_s` seconds."""
    def run() -> None:
        time.sleep(first_after_s)
        while True:
            try:
                job()
            except Exception:  # noqa: BLE001 - a background job's failure must not end its thread
                log.exception("%s failed; it runs again in %g s", name, every_s)
            time.sleep(every_s)
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
