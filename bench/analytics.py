"""The operators' analytics on a large store: 100k messages over 90 days and 3 assistants, the
7-, 30- and 90-day tables timed with the messages' time index and without it (dropped), in one process.
(storage/analytics.py uses the index below INDEX_DAYS only, so from there both columns scan.)

    python -m bench.analytics [--messages 100000]
"""
from __future__ import annotations

import argparse
import random
import sqlite3
import statistics
import tempfile
import time

from storage import Store, analytics


def fill(path: str, messages: int, seed: int = 0) -> None:
    """Sessions of 2-10 turns spread over 90 days, written straight with sqlite3 (fast)."""
    rng, now = random.Random(seed), time.time()
    Store(path)  # the schema
    conn = sqlite3.connect(path)
    conn.execute("insert into users (id, name, created) values ('bench', 'bench', 0)")
    written, n = 0, 0
    while written < messages:
        sid, start, turns = f"s{n}", now - rng.uniform(0, 90 * 86400), rng.randint(2, 10)
        conn.execute("insert into sessions (id, user_id, title, system_prompt, model, created, updated, assistant, "
                     "assistant_version, state, handoff_at) values (?, 'bench', 't', '', 'm', ?, ?, ?, 1, "
                     "'assistant', ?)", [sid, start, start, rng.choice(["support", "sales", "returns"]),
                                         start if rng.random() < 0.1 else None])
        for t in range(turns):
            at = start + 60 * t
            conn.execute("insert into messages (session_id, role, content, token_ids, created) values "
                         "(?, 'user', 'q', '[]', ?)", [sid, at])
            conn.execute("insert into messages (session_id, role, content, token_ids, created, prompt_tokens, "
                         "cached_tokens, generated_tokens, ttft, feedback) values (?, 'assistant', 'a', '[]', ?, "
                         "?, ?, ?, ?, ?)", [sid, at + 1, 400, rng.randint(0, 400), rng.randint(5, 64),
                                            rng.uniform(0.05, 2), rng.choice([None, None, None, 1, -1])])
            written += 2
        n += 1
    conn.commit()
    conn.close()


def timed(store, days: int, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        analytics.daily(store, days)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=100_000)
    args = p.parse_args()
    path = tempfile.mktemp(suffix=".db")
    fill(path, args.messages)
    store = Store(path)
    indexed = {days: timed(store, days) for days in (7, 30, 90)}
    with sqlite3.connect(path) as conn:
        name = conn.execute("select name from sqlite_master where type = 'index' and tbl_name = 'messages' "
                            "and sql like '%(\"created\")%'").fetchone()[0]
        conn.execute(f"drop index {name}")
    for days, with_index in indexed.items():
        plain = timed(store, days)
        print(f"{args.messages} messages over 90 days, the {days}-day table: {with_index * 1000:.0f} ms with the "
              f"time index, {plain * 1000:.0f} ms without ({plain / with_index:.2f}x)")


if __name__ == "__main__":
    main()
