"""The Gradio 6 app: sessions sidebar, chat pane, live engine panel, model switcher, demo load."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import uuid

import gradio as gr

from bench.workload import SYSTEM_PROMPT, user_turns
from engine import SamplingParams
from engine.llm_engine import pick_device, pick_dtype
from engine.quant.gptq import quantize_checkpoint
from ui.chat import ChatService, display
from ui.conversation import CUSTOMER_SERVICE_PRESET
from ui.panel import PanelSampler, memory_html, page_map_html, series

NO_QUANT = "none"
MAKE_GPTQ = "gptq (quantize now)"
LIVE = dict(concurrency_limit=None, show_progress="hidden")


def quantization_choices(model: str | None, dtype) -> list[str]:
    """Modes valid for a model: its checkpoint's own 4-bit format, or what on-the-fly quantization,
    GGUF packing and our GPTQ producer allow in this dtype."""
    import json

    from engine.loader import resolve_model
    from engine.quant import valid_modes

    try:
        src = resolve_model(model)
    except ValueError:
        return [NO_QUANT]
    if src.kind == "folder":
        with open(os.path.join(src.path, "config.json")) as f:
            method = (json.load(f).get("quantization_config") or {}).get("quant_method")
        if method:
            return [method]
    return valid_modes(src.kind, dtype) + [MAKE_GPTQ]


def gptq_folder(model: str | None) -> str:
    """Where our GPTQ producer writes a model's 4-bit checkpoint (reused on the next switch)."""
    key = hashlib.sha256(str(model).encode()).hexdigest()[:12]
    return os.path.join(os.environ.get("PAGEDCHAT_CACHE", os.path.expanduser("~/.cache/pagedchat")), "gptq", key)


def build_ui(llm, store, *, models: dict[str, str | None], secret: str) -> gr.Blocks:
    """models: label -> model argument (None = the embedded default)."""
    service = ChatService(llm, store)
    sampler = PanelSampler(llm)
    current_model = next(iter(models))
    dtype = pick_dtype(llm.config.dtype, pick_device(llm.config.device))
    current_quant = (llm.config.quantization or
                     ("gguf" if "gguf" in quantization_choices(models[current_model], dtype) else NO_QUANT))

    def who(known, request: gr.Request) -> str:
        """Logged-in name if there is a login, else the browser's id (or, for API clients that never
        ran the page's load event, their connection)."""
        name = getattr(request, "username", None)
        if name:
            return f"login:{name}"
        return known or f"tab:{request.session_hash}"

    def current(uid, sid, request: gr.Request) -> tuple[str, str]:
        uid = who(uid, request)
        if not sid or store.session(uid, sid) is None:
            existing = store.sessions(uid)
            sid = existing[0]["id"] if existing else store.create_session(
                uid, system_prompt=CUSTOMER_SERVICE_PRESET, model=llm.model_name)
        return uid, sid

    def session_choices(user: str, query: str = "") -> list[tuple[str, str]]:
        return [(s["title"] or "Untitled", s["id"]) for s in store.sessions(user, query)]

    with gr.Blocks(title="pagedchat") as demo:
        browser_id = gr.BrowserState(None, storage_key="pagedchat-user", secret=secret)
        user = gr.State(None)
        session = gr.State(None)
        with gr.Sidebar(label="Chats", open=True):
            new_btn = gr.Button("New chat", variant="primary", elem_id="new-chat")
            search = gr.Textbox(placeholder="Search chats", show_label=False, elem_id="search")
            sessions = gr.Radio(choices=[], label="Your chats", elem_id="sessions")
            title = gr.Textbox(label="Title", elem_id="title")
            with gr.Row():
                rename_btn = gr.Button("Rename", size="sm", elem_id="rename")
                delete_btn = gr.Button("Delete", size="sm", variant="stop", elem_id="delete")
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(elem_id="chatbot", height=520, sanitize_html=True, buttons=["copy"],
                                     placeholder="Ask the support assistant anything.")
                msg = gr.Textbox(placeholder="Type a message and press Enter", show_label=False, elem_id="msg",
                                 lines=2, max_lines=8, submit_btn=False)
                with gr.Row():
                    send_btn = gr.Button("Send", variant="primary", elem_id="send")
                    stop_btn = gr.Button("Stop", elem_id="stop")
                    regen_btn = gr.Button("Regenerate", elem_id="regenerate")
                    edit_btn = gr.Button("Edit last message", elem_id="edit")
                with gr.Accordion("System prompt", open=False):
                    system = gr.Textbox(lines=4, show_label=False, elem_id="system")
                    with gr.Row():
                        preset_btn = gr.Button("Customer-service preset", size="sm")
                        save_system_btn = gr.Button("Save for this chat", size="sm", elem_id="save-system")
                with gr.Accordion("Sampling", open=False):
                    temperature = gr.Slider(0, 2, value=0.7, step=0.05, label="Temperature", elem_id="temperature")
                    top_p = gr.Slider(0.05, 1, value=0.95, step=0.05, label="Top-p")
                    max_tokens = gr.Slider(16, 1024, value=256, step=16, label="Max new tokens", elem_id="max-tokens")
            with gr.Column(scale=2):
                panel = gr.HTML(page_map_html(None), elem_id="panel")
                memory = gr.HTML()
                plot_requests = gr.LinePlot(x="seconds", y="value", color="series", title="Requests and preemptions", height=200)
                plot_batch = gr.LinePlot(x="seconds", y="value", color="series", title="Tokens per step", height=200)
                plot_speed = gr.LinePlot(x="seconds", y="value", color="series", title="Generated tok/s",
                                         height=200)
                plot_hits = gr.LinePlot(x="seconds", y="value", color="series", title="Prefix-cache hit rate",
                                        height=200)
                with gr.Accordion("Model", open=False):
                    model_dd = gr.Dropdown(list(models), value=current_model, label="Model", elem_id="model")
                    quant_dd = gr.Dropdown(quantization_choices(models[current_model], dtype), value=current_quant,
                                           label="Quantization", elem_id="quantization")
                    switch_btn = gr.Button("Load model", elem_id="switch")
                    switch_status = gr.Markdown(elem_id="switch-status")
                with gr.Accordion("Simulate customers", open=False):
                    sim_n = gr.Number(16, precision=0, minimum=1, maximum=64, label="Chats")
                    sim_btn = gr.Button("Start simulated chats", elem_id="simulate")
                    sim_status = gr.Markdown(elem_id="sim-status")
        timer = gr.Timer(1.0)

        # ---- identity and sessions ----------------------------------------------------------
        def init(browser_value, request: gr.Request):
            browser_value = browser_value or uuid.uuid4().hex
            uid, sid = current(browser_value, None, request)
            s = store.session(uid, sid)
            return (browser_value, uid, gr.update(choices=session_choices(uid), value=sid), sid,
                    display(store.messages(uid, sid)), s["system_prompt"], s["title"])

        demo.load(init, [browser_id], [browser_id, user, sessions, session, chatbot, system, title])

        def open_session(uid, sid, request: gr.Request):
            uid = who(uid, request)
            s = store.session(uid, sid) if sid else None
            if s is None:
                return gr.update(), gr.update(), gr.update(), gr.update()
            return sid, display(store.messages(uid, sid)), s["system_prompt"], s["title"]

        sessions.input(open_session, [user, sessions], [session, chatbot, system, title])

        def new_chat(uid, system_text, request: gr.Request):
            uid = who(uid, request)
            sid = store.create_session(uid, system_prompt=system_text or CUSTOMER_SERVICE_PRESET, model=llm.model_name)
            return gr.update(choices=session_choices(uid), value=sid), sid, [], "New chat"

        new_btn.click(new_chat, [user, system], [sessions, session, chatbot, title])

        def rename(uid, sid, text, request: gr.Request):
            uid, sid = current(uid, sid, request)
            store.update_session(uid, sid, title=(text or "Untitled")[:80])
            return gr.update(choices=session_choices(uid), value=sid)

        rename_btn.click(rename, [user, session, title], [sessions])
        title.submit(rename, [user, session, title], [sessions])

        def delete(uid, sid, request: gr.Request):
            uid, sid = current(uid, sid, request)
            store.delete_session(uid, sid)
            left = store.sessions(uid)
            sid = left[0]["id"] if left else store.create_session(uid, system_prompt=CUSTOMER_SERVICE_PRESET,
                                                                  model=llm.model_name)
            s = store.session(uid, sid)
            return (gr.update(choices=session_choices(uid), value=sid), sid, display(store.messages(uid, sid)),
                    s["system_prompt"], s["title"])

        delete_btn.click(delete, [user, session], [sessions, session, chatbot, system, title])
        def find(uid, query, request: gr.Request):
            return gr.update(choices=session_choices(who(uid, request), query))

        search.change(find, [user, search], [sessions])

        def save_system(uid, sid, text, request: gr.Request):
            uid, sid = current(uid, sid, request)
            store.update_session(uid, sid, system_prompt=text)
            gr.Info("System prompt saved for this chat.")

        save_system_btn.click(save_system, [user, session, system], None)
        preset_btn.click(lambda: CUSTOMER_SERVICE_PRESET, None, [system])

        # ---- chat turns -------------------------------------------------------------------
        async def send(uid, sid, text, temp, p, max_new, request: gr.Request):
            uid, sid = current(uid, sid, request)
            raw, text = text, (text or "").strip()
            if not text:
                yield gr.update(), gr.update()
                return
            try:
                params = SamplingParams(temperature=temp, top_p=p, max_tokens=int(max_new))
                async with contextlib.aclosing(service.turn(uid, sid, text, params, request.session_hash)) as turn:
                    async for shown, _ in turn:
                        yield shown, ""
            except ValueError as e:
                gr.Warning(str(e))
                yield display(store.messages(uid, sid)), raw  # the message stays in the box, as typed

        async def regenerate(uid, sid, temp, p, max_new, request: gr.Request):
            uid, sid = current(uid, sid, request)
            history = store.messages(uid, sid)
            if history and history[-1]["role"] == "assistant":
                store.delete_messages_from(uid, sid, history[-1]["id"])
            try:
                params = SamplingParams(temperature=temp, top_p=p, max_tokens=int(max_new))
                turn = service.turn(uid, sid, "", params, request.session_hash, regenerate=True)
                async with contextlib.aclosing(turn):
                    async for shown, _ in turn:
                        yield shown
            except ValueError as e:
                gr.Warning(str(e))
                yield display(store.messages(uid, sid))

        def refresh(uid, sid, request: gr.Request):
            uid, sid = current(uid, sid, request)
            return gr.update(choices=session_choices(uid), value=sid), sid

        inputs = [user, session, msg, temperature, top_p, max_tokens]
        send_event = send_btn.click(send, inputs, [chatbot, msg], concurrency_limit=None)
        submit_event = msg.submit(send, inputs, [chatbot, msg], concurrency_limit=None)
        for event in (send_event, submit_event):
            event.then(refresh, [user, session], [sessions, session], show_progress="hidden")
        regen_event = regen_btn.click(regenerate, [user, session, temperature, top_p, max_tokens], [chatbot],
                                      concurrency_limit=None)
        stop_btn.click(None, None, None, cancels=[send_event, submit_event, regen_event])

        def edit_last(uid, sid, request: gr.Request):
            uid, sid = current(uid, sid, request)
            history = store.messages(uid, sid)
            users = [m for m in history if m["role"] == "user"]
            if not users:
                return gr.update(), gr.update()
            store.delete_messages_from(uid, sid, users[-1]["id"])
            return display(store.messages(uid, sid)), users[-1]["content"]

        edit_btn.click(edit_last, [user, session], [chatbot, msg])
        def tab_closed(request: gr.Request):
            service.abort_tab(request.session_hash)

        demo.unload(tab_closed)

        # ---- live panel ---------------------------------------------------------------------
        def tick():
            remote = getattr(llm, "remote_url", None)
            if remote:
                note = (f"<div id='kv-map'>The engine runs in other pods behind <code>{remote}</code>: "
                        "its KV pages and batches are on their <code>/metrics</code> and dashboards.</div>")
                return note, "", *(series([], [n]) for n in ("running", "prefill", "tokens_per_s", "hit_rate"))
            sampler.ensure_running()
            snap, hist = sampler.latest, list(sampler.history)
            return (page_map_html(snap), memory_html(snap), series(hist, ["running", "waiting", "preemptions"]),
                    series(hist, ["prefill", "decode"]), series(hist, ["tokens_per_s"]), series(hist, ["hit_rate"]))

        timer.tick(tick, None, [panel, memory, plot_requests, plot_batch, plot_speed, plot_hits], **LIVE)

        # ---- model switching ----------------------------------------------------------------
        def quant_options(label):
            choices = quantization_choices(models[label], dtype)
            return gr.update(choices=choices, value=choices[-1] if len(choices) == 1 or "gguf" in choices else NO_QUANT)

        model_dd.change(quant_options, [model_dd], [quant_dd])

        async def switch(label, quant):
            model = models[label]
            if quant == MAKE_GPTQ:
                folder = gptq_folder(model)
                if not os.path.isfile(os.path.join(folder, "config.json")):
                    yield f"Quantizing **{label}** with our GPTQ (group 64; about a minute for SmolLM2)…"
                    try:
                        await asyncio.to_thread(quantize_checkpoint, model, folder, 64)
                    except Exception as e:  # noqa: BLE001 - shown to the operator, old model keeps serving
                        yield f"❌ GPTQ failed: {e}. Still serving **{llm.model_name}**."
                        return
                model, quant = folder, "gptq"
            yield f"Loading **{label}** ({quant})… in-flight requests will be aborted."
            config = dataclasses.replace(llm.config, model=model,
                                         quantization=None if quant in ("gptq", "awq", "compressed-tensors") else quant)
            try:
                result = await asyncio.to_thread(llm.switch_model, config)
            except ValueError as e:
                yield f"❌ {e}. Still serving **{llm.model_name}**."
                return
            yield f"✅ {result}. Sessions keep their history; their next turn re-reads it once."

        switch_btn.click(switch, [model_dd, quant_dd], [switch_status])

        # ---- demo load ----------------------------------------------------------------------
        async def simulate(n):
            n = max(1, min(int(n or 16), 64))
            tasks = [asyncio.create_task(_simulated_chat(llm, i)) for i in range(n)]
            _background.update(tasks)
            for t in tasks:
                t.add_done_callback(_background.discard)
            return f"Started {n} simulated chats (3 turns each, then they stop). Watch the panel."

        sim_btn.click(simulate, [sim_n], [sim_status])
    return demo


_background: set = set()


async def _simulated_chat(llm, index: int, turns: int = 3) -> None:
    """A bounded customer chat straight into the engine: shared system prompt, growing history."""
    tok = llm.engine.tokenizer
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    params = SamplingParams(temperature=0.7, max_tokens=64, seed=index)
    for turn, text in enumerate(user_turns(index, turns, seed=int(uuid.uuid4().int % 1000))):
        messages.append({"role": "user", "content": text})
        ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)
        reply = ""
        try:
            async for out in llm.generate(ids, params, request_id=f"sim:{index}:{turn}-{uuid.uuid4().hex[:6]}"):
                reply = out.outputs[0].text
        except Exception:  # noqa: BLE001 - a simulated customer just leaves
            return
        messages.append({"role": "assistant", "content": reply})
