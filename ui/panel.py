"""The live engine panel: one background sampler for every open tab (the engine client is asked
for a snapshot once a second, whatever the number of viewers, and each sample is rendered once for
all of them), and the HTML / plot data it renders."""
from __future__ import annotations

import colorsys
import functools
import hashlib
import html
import threading
import time
from collections import deque

import pandas as pd

from engine.client import BlockState, EngineClient
from ui.grounding import KNOWLEDGE_BLOCKS

MAX_CELLS = 1536
STATE_NAMES = {BlockState.FREE: "free", BlockState.CACHED: "cached", BlockState.USED: "in use",
               BlockState.SHARED: "shared"}
PLOTS = (["running", "waiting", "preemptions"], ["prefill", "decode"], ["tokens_per_s"], ["hit_rate"],
         ["process RSS", "KV in use", "GPU allocated"])  # memory in MiB; the GPU line only on CUDA


class PanelSampler:
    def __init__(self, client: EngineClient, interval: float = 1.0, keep: int = 120, fleet=None) -> None:
        """fleet: the deployment's engines (engine.fleet.ModelFleet); the panel samples the main one
        (`client`) and names the others on the model line."""
        self.client, self.fleet = client, fleet
        self.interval = interval
        self.latest: dict | None = None
        self.remote = False  # set once the client says it has no engine here to sample
        self.history: deque[dict] = deque(maxlen=keep)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.samples = 0  # samples taken (and the switch to a remote engine): what a rendering is of
        self._rendered: tuple[str, int, tuple] | None = None  # (model line, samples, the outputs)

    def render(self) -> tuple:
        """The model line, the panel's HTML, memory line and plot frames (PLOTS order) as of the
        latest sample. Built once per sample and shared by every open panel until the next: each
        asks every second, and one build took 12 ms on a Zen 3 (a 60 KB page map, five frames)."""
        self.ensure_running()
        line = model_line(self.client) + others_line(self.fleet)
        with self._lock:
            snap, history, remote, samples = self.latest, list(self.history), self.remote, self.samples
            cached = self._rendered
        if cached is not None and cached[:2] == (line, samples):
            return cached[2]
        if remote:
            out = (line, remote_html(self.client), "", *(None for _ in PLOTS))
        else:
            plots = plot_names(self.client)
            frames = [series(history, names) for names in plots] if plots else [None] * len(PLOTS)
            out = (line, page_map_html(snap), memory_html(snap), *frames)
        with self._lock:
            self._rendered = (line, samples, out)
        return out

    def ensure_running(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="panel-sampler", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(self.interval if self.latest else 0.1)
            if self.client.ready and not self.sample():
                return

    def sample(self) -> bool:
        """Takes one snapshot into the history (a failed one is skipped); False once the client says
        the engine runs elsewhere, so there is nothing to sample."""
        try:
            snap = self.client.snapshot()
        except Exception:  # noqa: BLE001 - a missed sample is not worth a crash
            return True
        with self._lock:
            self.samples += 1
            if snap is None:
                self.remote = True
                return False
            self.history.append(_point(snap, self.latest))
            self.latest = snap
        return True


def _point(snap: dict, previous: dict | None) -> dict:
    s = snap["stats"]
    point = {"t": snap["time"], "running": s["num_running"], "waiting": s["num_waiting"], "prefill": 0.0,
             "decode": 0.0, "hit_rate": 0.0, "tokens_per_s": 0.0, "preemptions": 0}
    if previous is not None:
        p = previous["stats"]
        steps = s["num_steps"] - p["num_steps"]
        if steps > 0:  # the steps since the last sample, on average (none: idle, nothing to show)
            point["prefill"] = (s["prefill_tokens_total"] - p["prefill_tokens_total"]) / steps
            point["decode"] = (s["decode_tokens_total"] - p["decode_tokens_total"]) / steps
        dt = max(snap["time"] - previous["time"], 1e-6)
        point["tokens_per_s"] = max(s["generation_tokens_total"] - p["generation_tokens_total"], 0) / dt
        queries = s["prefix_cache_queries"] - p["prefix_cache_queries"]
        point["hit_rate"] = (s["prefix_cache_hits"] - p["prefix_cache_hits"]) / queries if queries > 0 else 0.0
        point["preemptions"] = max(s["num_preemptions"] - p["num_preemptions"], 0)
    m, mib = snap["memory"], 2**20
    point["process RSS"] = m["rss"] / mib
    point["KV in use"] = m["kv_cache"] * s["kv_blocks_used"] / max(s["kv_blocks_total"], 1) / mib
    if "cuda_allocated" in m:
        point["GPU allocated"] = m["cuda_allocated"] / mib
    return point


KNOWLEDGE_COLOUR = "#d97706"  # blocks that hold a retrieved document chunk (ui/grounding.py)


def owner_colour(owner: str) -> str:
    """A stable colour per owner (a chat session, or a request without one)."""
    digest = hashlib.sha1(owner.encode()).digest()
    r, g, b = colorsys.hls_to_rgb(digest[0] / 255, 0.5, 0.65)
    return f"rgb({int(r * 255)},{int(g * 255)},{int(b * 255)})"


def page_map_html(snap: dict | None) -> str:
    if snap is None:
        return "<div id='kv-map'>waiting for the engine…</div>"
    states, owners, positions = snap["block_states"], snap["block_owners"], snap.get("block_positions", {})
    n = len(states)
    per_cell = max(1, -(-n // MAX_CELLS))
    knowledge_blocks = {i for i, owner in owners.items() if positions.get(i) in KNOWLEDGE_BLOCKS.get(owner, ())}
    cells = []
    for start in range(0, n, per_cell):
        group = range(start, min(start + per_cell, n))
        state = max(states[i] for i in group)
        owner = next((owners[i] for i in group if i in owners), None)
        knowledge = any(i in knowledge_blocks for i in group)
        colour = ({BlockState.FREE: "#e5e7eb", BlockState.CACHED: "#93c5fd"}.get(state)
                  or (KNOWLEDGE_COLOUR if knowledge else owner_colour(owner or "")))
        border = "outline:1px solid #111;" if state == BlockState.SHARED else ""
        title = f"block {start}" + (f"-{group[-1]}" if per_cell > 1 else "") + f": {STATE_NAMES[state]}"
        if owner:
            title += f", {owner}" + (", knowledge" if knowledge else "")
        cells.append(f"<i title='{html.escape(title)}' style='background:{colour};{border}'></i>")
    s = snap["stats"]
    counts = {name: sum(1 for x in states if x == code) for code, name in STATE_NAMES.items()}
    note = f" (each cell is {per_cell} blocks)" if per_cell > 1 else ""
    return (
        "<style>#kv-grid{display:grid;grid-template-columns:repeat(auto-fill,9px);gap:1px}"
        "#kv-grid i{display:block;width:9px;height:9px;border-radius:1px}</style>"
        f"<div id='kv-map'><div id='kv-counts'>KV pages: <b>{n}</b> total · "
        f"<b id='kv-used'>{counts['in use'] + counts['shared']}</b> in use ({counts['shared']} shared) · "
        f"<b>{counts['cached']}</b> cached · <b>{counts['free']}</b> free · "
        f"<b id='kv-knowledge'>{len(knowledge_blocks)}</b> <span style='color:{KNOWLEDGE_COLOUR}'>■</span> knowledge · {s['block_size']} tokens each{note}"
        f"</div><div id='kv-grid'>{''.join(cells)}</div>"
        f"<div id='engine-counts'>running <b id='num-running'>{s['num_running']}</b> · waiting "
        f"<b>{s['num_waiting']}</b> · preemptions {s['num_preemptions']} · prefix hits "
        f"{s['prefix_cache_hits']}/{s['prefix_cache_queries']} tokens · "
        f"generated <b id='gen-total'>{s['generation_tokens_total']}</b> tokens</div>{disk_line(s)}"
        f"{spec_line(s, snap.get('speculation'))}</div>")


def spec_line(s: dict, speculation: dict | None) -> str:
    """Prompt-lookup speculation: the share of draft tokens kept since start, and per running chat."""
    if not speculation or not speculation["on"]:
        return "<div id='spec'>speculation off</div>"
    drafted, kept = s.get("spec_decode_num_draft_tokens", 0), s.get("spec_decode_num_accepted_tokens", 0)
    share = f" ({kept / drafted:.0%})" if drafted else ""
    now = sorted(speculation["requests"].items(), key=lambda kv: -kv[1][0])[:4]
    chats = " · ".join(f"{html.escape(owner)} {k}/{d}" for owner, (d, k) in now)
    return (f"<div id='spec'>speculation: kept <b id='spec-kept'>{kept}</b>/{drafted} draft tokens{share}"
            + (f" · now: {chats}" if chats else "") + "</div>")


def disk_line(s: dict) -> str:
    """The KV tier on disk: what it holds and what it has saved us."""
    if not s.get("kv_disk_capacity_bytes"):
        return "<div id='kv-disk'>disk tier off</div>"
    mib = 2**20
    return (f"<div id='kv-disk'>disk tier: <b id='kv-disk-blocks'>{s['kv_disk_blocks']}</b> blocks "
            f"({s['kv_disk_bytes'] / mib:.0f} of {s['kv_disk_capacity_bytes'] / mib:.0f} MiB) · loaded back "
            f"<b id='kv-disk-hits'>{s['kv_disk_hits']}</b>/{s['kv_disk_queries']} tokens · read "
            f"{s['kv_disk_read_bytes'] / mib:.1f} MiB · written {s['kv_disk_written_bytes'] / mib:.1f} MiB"
            + (f" · {s['kv_disk_corrupt_files']} corrupt files dropped" if s["kv_disk_corrupt_files"] else "")
            + "</div>")


SAMPLES = {"English": "Your order will arrive tomorrow. Refunds take five to seven business days after the "
                      "return arrives.",
           "Korean": "주문하신 상품은 내일 도착할 예정입니다. 환불은 반품이 도착한 뒤 영업일 기준 5~7일 걸립니다."}


@functools.lru_cache(maxsize=8)
def tokens_per_char(tokenizer) -> dict[str, float]:
    """Tokens per character of the same customer-service sentence in English and Korean: a model
    whose tokenizer spends several tokens on each Hangul syllable is that much slower (and its
    context that much shorter) for Korean."""
    return {lang: len(tokenizer.encode(text, add_special_tokens=False)) / len(text) for lang, text in SAMPLES.items()}


def model_line(client: EngineClient) -> str:
    """Which model answers, always in view: name, quantization, device, dtype, tokens per character."""
    info = client.info
    if info is None:
        return f"Model: loading… {html.escape(client.error or '')}"
    ratios = " · ".join(f"{lang} {r:.2f}" for lang, r in tokens_per_char(info.tokenizer).items())
    return (f"Model <b id='model-name'>{html.escape(info.name)}</b> · quantization {html.escape(info.quantization)}"
            f" · {html.escape(info.device)} · {html.escape(info.dtype)}"
            f"<span id='tokens-per-char'> · tokens per character: {ratios}</span>")


def others_line(fleet) -> str:
    """The models loaded beside the main one for assistants that name them, and their state."""
    others = fleet.others() if fleet is not None else {}
    if not others:
        return ""
    return " · <span id='other-models'>also serving assistants: " + ", ".join(
        f"{html.escape(label)} ({html.escape(client.state)})" for label, client in others.items()) + "</span>"


def remote_html(client: EngineClient) -> str:
    where = html.escape(client.info.device if client.info else "another process")
    return (f"<div id='kv-map'>The engine runs in other pods, {where}: its KV pages and batches are on "
            "their <code>/metrics</code> and dashboards.</div>")


def memory_html(snap: dict | None) -> str:
    if snap is None:
        return ""
    m = snap["memory"]
    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    parts = [f"model <b>{html.escape(snap['model'])}</b> on {snap['device']} ({snap['dtype']}, "
             f"{html.escape(snap['quantization'])}{'; AMX tiles' if m.get('amx_tiles') else ''})",
             f"weights {mib(m['weights'])}", f"KV pool {mib(m['kv_cache'])}"
             + (" (int8)" if m.get("kv_cache_dtype") == "int8" else ""), f"process RSS {mib(m['rss'])}"]
    if "cuda_allocated" in m:
        parts += [f"CUDA allocated {mib(m['cuda_allocated'])}", f"reserved {mib(m['cuda_reserved'])}",
                  f"device free {mib(m['cuda_free'])} of {mib(m['cuda_total'])}"]
    return "<div id='memory'>" + " · ".join(parts) + "</div>"


def series(history, names: list[str]) -> pd.DataFrame:
    """Long-format frame for a gr.LinePlot: seconds ago, value, series name. Every name has a row
    (0 now if not yet sampled): a plot's legend and colours are those of its first frame, and a
    series first seen later would never be drawn."""
    now = time.time()
    rows = [{"seconds": round(p["t"] - now, 1), "value": float(p[name]), "series": name}
            for p in history for name in names if name in p]
    seen = {row["series"] for row in rows}
    rows += [{"seconds": 0.0, "value": 0.0, "series": name} for name in names if name not in seen]
    return pd.DataFrame(rows)


def plot_names(client: EngineClient) -> list[list[str]] | None:
    """PLOTS for this engine's device (the GPU line only on CUDA); None while it loads, when the
    device is not yet known (an empty plot takes the first real frame's series)."""
    info = client.info
    if info is None:
        return None
    cuda = info.device.startswith("cuda")
    return [[name for name in names if cuda or name != "GPU allocated"] for names in PLOTS]
