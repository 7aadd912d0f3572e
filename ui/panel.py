"""The live engine panel: one background sampler for every open tab (the engine is asked once a
second, whatever the number of viewers), and the HTML / plot data it renders."""
from __future__ import annotations

import colorsys
import hashlib
import html
import threading
import time
from collections import deque

import pandas as pd

from engine.metrics import snapshot

MAX_CELLS = 1536
STATE_NAMES = ("free", "cached", "in use", "shared")


class PanelSampler:
    def __init__(self, llm, interval: float = 1.0, keep: int = 120) -> None:
        self.llm = llm
        self.interval = interval
        self.latest: dict | None = None
        self.history: deque[dict] = deque(maxlen=keep)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def ensure_running(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="panel-sampler", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        previous = None
        while not self._stop.wait(self.interval if previous else 0):
            if not self.llm.ready:
                continue
            try:
                snap = self.llm.call(snapshot, timeout=30)
            except Exception:  # noqa: BLE001 - a missed sample is not worth a crash
                continue
            self.latest = snap
            self.history.append(_point(snap, previous))
            previous = snap


def _point(snap: dict, previous: dict | None) -> dict:
    s = snap["stats"]
    point = {"t": snap["time"], "running": s["num_running"], "waiting": s["num_waiting"],
             "batch": s["last_batch_size"], "prefill": s["last_prefill_tokens"], "decode": s["last_decode_tokens"],
             "hit_rate": 0.0, "tokens_per_s": 0.0, "preemptions": 0}
    if previous is not None:
        p = previous["stats"]
        dt = max(snap["time"] - previous["time"], 1e-6)
        point["tokens_per_s"] = max(s["generation_tokens_total"] - p["generation_tokens_total"], 0) / dt
        queries = s["prefix_cache_queries"] - p["prefix_cache_queries"]
        point["hit_rate"] = (s["prefix_cache_hits"] - p["prefix_cache_hits"]) / queries if queries > 0 else 0.0
        point["preemptions"] = max(s["num_preemptions"] - p["num_preemptions"], 0)
        steps = s["num_steps"] - p["num_steps"]
        if steps <= 0:
            point["batch"] = point["prefill"] = point["decode"] = 0
    return point


def owner_group(request_id: str) -> str:
    """UI requests are named "s:<session>:<n>": colour by session. Others by their own id."""
    parts = request_id.split(":")
    return ":".join(parts[:2]) if len(parts) >= 3 else request_id


def owner_colour(request_id: str) -> str:
    digest = hashlib.sha1(owner_group(request_id).encode()).digest()
    r, g, b = colorsys.hls_to_rgb(digest[0] / 255, 0.5, 0.65)
    return f"rgb({int(r * 255)},{int(g * 255)},{int(b * 255)})"


def page_map_html(snap: dict | None) -> str:
    if snap is None:
        return "<div id='kv-map'>waiting for the engine…</div>"
    states, owners = snap["block_states"], snap["block_owners"]
    n = len(states)
    per_cell = max(1, -(-n // MAX_CELLS))
    cells = []
    for start in range(0, n, per_cell):
        group = range(start, min(start + per_cell, n))
        state = max(states[i] for i in group)
        owner = next((owners[i] for i in group if i in owners), None)
        colour = {0: "#e5e7eb", 1: "#93c5fd"}.get(state) or owner_colour(owner or "")
        border = "outline:1px solid #111;" if state == 3 else ""
        title = f"block {start}" + (f"-{group[-1]}" if per_cell > 1 else "") + f": {STATE_NAMES[state]}"
        if owner:
            title += f", {owner}"
        cells.append(f"<i title='{html.escape(title)}' style='background:{colour};{border}'></i>")
    s = snap["stats"]
    counts = {name: sum(1 for x in states if x == code) for code, name in enumerate(STATE_NAMES)}
    note = f" (each cell is {per_cell} blocks)" if per_cell > 1 else ""
    return (
        "<style>#kv-grid{display:grid;grid-template-columns:repeat(auto-fill,9px);gap:1px}"
        "#kv-grid i{display:block;width:9px;height:9px;border-radius:1px}</style>"
        f"<div id='kv-map'><div id='kv-counts'>KV pages: <b>{n}</b> total · "
        f"<b id='kv-used'>{counts['in use'] + counts['shared']}</b> in use ({counts['shared']} shared) · "
        f"<b>{counts['cached']}</b> cached · <b>{counts['free']}</b> free · {s['block_size']} tokens each{note}"
        f"</div><div id='kv-grid'>{''.join(cells)}</div>"
        f"<div id='engine-counts'>running <b id='num-running'>{s['num_running']}</b> · waiting "
        f"<b>{s['num_waiting']}</b> · preemptions {s['num_preemptions']} · prefix hits "
        f"{s['prefix_cache_hits']}/{s['prefix_cache_queries']} tokens · "
        f"generated <b id='gen-total'>{s['generation_tokens_total']}</b> tokens</div></div>")


def memory_html(snap: dict | None) -> str:
    if snap is None:
        return ""
    m = snap["memory"]
    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    parts = [f"model <b>{html.escape(snap['model'])}</b> on {snap['device']} ({snap['dtype']})",
             f"weights {mib(m['weights'])}", f"KV pool {mib(m['kv_cache'])}", f"process RSS {mib(m['rss'])}"]
    if "cuda_allocated" in m:
        parts += [f"CUDA allocated {mib(m['cuda_allocated'])}", f"reserved {mib(m['cuda_reserved'])}",
                  f"device free {mib(m['cuda_free'])} of {mib(m['cuda_total'])}"]
    return "<div id='memory'>" + " · ".join(parts) + "</div>"


def series(history, names: list[str]) -> pd.DataFrame:
    """Long-format frame for a gr.LinePlot: seconds ago, value, series name."""
    now = time.time()
    rows = [{"seconds": round(p["t"] - now, 1), "value": float(p[name]), "series": name}
            for p in history for name in names]
    return pd.DataFrame(rows or [{"seconds": 0.0, "value": 0.0, "series": names[0]}])
