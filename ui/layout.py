"""The Gradio 6 page: sessions sidebar, chat pane, live engine panel, operator controls. Only
components and wiring live here; what the events do is in handlers.py and operator.py."""
from __future__ import annotations

import gradio as gr

from engine.client import EngineClient
from ui.handlers import ChatHandlers
from ui.operator import OperatorHandlers
from ui.panel import PanelSampler, page_map_html
from ui.simulate import CUSTOMER_SERVICE_PROMPT

LIVE = dict(concurrency_limit=None, show_progress="hidden")


def build_ui(client: EngineClient, store, *, models: dict[str, str | None], quantization: str | None,
             secret: str) -> gr.Blocks:
    """models: label -> model argument (None = the embedded default); the first is the one loaded."""
    chat = ChatHandlers(client, store)
    operator = OperatorHandlers(client, models, quantization)
    sampler = PanelSampler(client)
    quant_choices, quant_value = operator.initial_choices()

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
                plots = [gr.LinePlot(x="seconds", y="value", color="series", title=t, height=200)
                         for t in ("Requests and preemptions", "Tokens per step", "Generated tok/s",
                                   "Prefix-cache hit rate")]
                with gr.Accordion("Model", open=False):
                    model_dd = gr.Dropdown(list(models), value=next(iter(models)), label="Model", elem_id="model")
                    quant_dd = gr.Dropdown(quant_choices, value=quant_value, label="Quantization",
                                           elem_id="quantization")
                    switch_btn = gr.Button("Load model", elem_id="switch")
                    switch_status = gr.Markdown(elem_id="switch-status")
                with gr.Accordion("Simulate customers", open=False):
                    sim_n = gr.Number(16, precision=0, minimum=1, maximum=64, label="Chats")
                    sim_btn = gr.Button("Start simulated chats", elem_id="simulate")
                    sim_status = gr.Markdown(elem_id="sim-status")
        timer = gr.Timer(1.0)

        # ---- identity and sessions ------------------------------------------------------
        demo.load(chat.init, [browser_id], [browser_id, user, sessions, session, chatbot, system, title])
        sessions.input(chat.open_session, [user, sessions], [session, chatbot, system, title])
        new_btn.click(chat.new_chat, [user, system], [sessions, session, chatbot, title])
        rename_btn.click(chat.rename, [user, session, title], [sessions])
        title.submit(chat.rename, [user, session, title], [sessions])
        delete_btn.click(chat.delete, [user, session], [sessions, session, chatbot, system, title])
        search.change(chat.find, [user, search], [sessions])
        save_system_btn.click(chat.save_system, [user, session, system], None)
        preset_btn.click(lambda: CUSTOMER_SERVICE_PROMPT, None, [system], api_visibility="private")

        # ---- chat turns -----------------------------------------------------------------
        inputs = [user, session, msg, temperature, top_p, max_tokens]
        send_event = send_btn.click(chat.send, inputs, [chatbot, msg], concurrency_limit=None)
        submit_event = msg.submit(chat.send, inputs, [chatbot, msg], concurrency_limit=None)
        for event in (send_event, submit_event):
            event.then(chat.refresh, [user, session], [sessions, session], show_progress="hidden")
        regen_event = regen_btn.click(chat.regenerate, [user, session, temperature, top_p, max_tokens], [chatbot],
                                      concurrency_limit=None)
        stop_btn.click(None, None, None, cancels=[send_event, submit_event, regen_event])
        edit_btn.click(chat.edit_last, [user, session], [chatbot, msg])
        demo.unload(chat.tab_closed)

        # ---- live panel and operator ----------------------------------------------------
        timer.tick(sampler.render, None, [panel, memory, *plots], **LIVE)
        model_dd.change(operator.quant_options, [model_dd], [quant_dd])
        switch_btn.click(operator.switch, [model_dd, quant_dd], [switch_status])
        sim_btn.click(operator.simulate, [sim_n], [sim_status])
    return demo
