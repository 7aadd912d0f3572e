"""The Gradio 6 page: sessions sidebar, chat pane, live engine panel, operator controls. Only
components and wiring live here; what the events do is in handlers.py and operator.py."""
from __future__ import annotations

import gradio as gr

from engine.client import EngineClient
from server.auth import Credentials, VisitorCookie
from server.limits import UserLimiter
from ui.handlers import CHAT_REPETITION_PENALTY, ChatHandlers
from ui.operator import FEEDBACK_COLUMNS, OperatorHandlers
from ui.panel import PanelSampler, page_map_html
from ui.simulate import CUSTOMER_SERVICE_PROMPT

LIVE = dict(concurrency_limit=None, show_progress="hidden")
PRIVATE = dict(api_visibility="private")
THEME_TOGGLE = """() => { const dark = document.body.classList.toggle('dark');
  localStorage.setItem('pagedchat-theme', dark ? 'dark' : 'light'); }"""
# On load: the remembered theme; on a narrow screen the chats sidebar starts closed (it would cover the chat).
ON_LOAD = """() => {
  if (localStorage.getItem('pagedchat-theme') === 'dark') document.body.classList.add('dark');
  const sidebar = document.querySelector('.sidebar.open');
  if (sidebar && window.innerWidth < 768) sidebar.querySelector('button[aria-label="Toggle Sidebar"]').click();
}"""
PLOT_TITLES = ("Requests and preemptions", "Tokens per step", "Generated tok/s", "Prefix-cache hit rate",
               "Memory (MiB)")  # one per panel.PLOTS entry


def build_ui(client: EngineClient, store, *, models: dict[str, str | None], quantization: str | None,
             credentials: Credentials, limiter: UserLimiter, visitors: VisitorCookie | None,
             salt_by_user: bool = False) -> gr.Blocks:
    """models: label -> model argument (None = the embedded default); the first is the one loaded.
    credentials.operators: the logins that see and may use the operator controls. visitors: the
    cookie signer when nobody logs in. limiter: the per-user cap shared with the API."""
    chat = ChatHandlers(client, store, visitors, limiter, salt_by_user)
    operator = OperatorHandlers(client, store, models, quantization, set(credentials.operators))
    sampler = PanelSampler(client)
    quant_choices, quant_value = operator.initial_choices()

    with gr.Blocks(title="pagedchat", analytics_enabled=False) as demo:  # no usage pings from a customer-facing app
        user, session, rated = gr.State(None), gr.State(None), gr.State(None)
        with gr.Sidebar(label="Chats", open=True):
            new_btn = gr.Button("New chat", variant="primary", elem_id="new-chat")
            search = gr.Textbox(placeholder="Search chats", show_label=False, elem_id="search")
            sessions = gr.Radio(choices=[], label="Your chats", elem_id="sessions")
            title = gr.Textbox(label="Title", elem_id="title")
            with gr.Row():
                rename_btn = gr.Button("Rename", size="sm", elem_id="rename")
                delete_btn = gr.Button("Delete", size="sm", variant="stop", elem_id="delete")
            with gr.Accordion("Export, import", open=False, elem_id="transfer"):
                with gr.Row():
                    export_md_btn = gr.Button("Export Markdown", size="sm", elem_id="export-md")
                    export_json_btn = gr.Button("Export JSON", size="sm", elem_id="export-json")
                export_file = gr.File(label="Download", interactive=False, elem_id="export-file")
                import_btn = gr.UploadButton("Import a chat (JSON)", file_types=[".json"], size="sm", elem_id="import")
                delete_all_btn = gr.Button("Delete all my chats", size="sm", variant="stop", elem_id="delete-all")
                with gr.Row(visible=False, elem_id="confirm-delete-all") as confirm_row:
                    gr.Markdown("Delete **every** chat of yours? This cannot be undone.")
                    confirm_yes = gr.Button("Yes, delete all", size="sm", variant="stop", elem_id="confirm-yes")
                    confirm_no = gr.Button("Cancel", size="sm", elem_id="confirm-no")
        with gr.Row():
            model_line = gr.HTML("Model: loading…", elem_id="model-line")
            theme_btn = gr.Button("Light / dark", size="sm", scale=0, elem_id="theme-toggle")
        with gr.Row():
            with gr.Column(scale=3, min_width=360):
                chatbot = gr.Chatbot(elem_id="chatbot", height=520, sanitize_html=True, buttons=["copy"],
                                     editable="user", feedback_options=("Like", "Dislike"),
                                     placeholder="Ask the support assistant anything.")
                with gr.Row(visible=False, elem_id="comment-row") as comment_row:
                    comment_box = gr.Textbox(placeholder="What was good or wrong about this reply? (optional)",
                                             show_label=False, scale=4, elem_id="comment")
                    comment_btn = gr.Button("Send feedback", size="sm", scale=1, elem_id="send-comment")
                msg = gr.Textbox(placeholder="Type a message · Enter sends · Shift+Enter starts a new line",
                                 show_label=False, elem_id="msg", lines=1, max_lines=8, autofocus=True,
                                 submit_btn=False)
                pending = gr.Textbox(visible=False)  # the staged message, between showing it and sending it
                with gr.Row():
                    send_btn = gr.Button("Send", variant="primary", elem_id="send")
                    stop_btn = gr.Button("Stop", elem_id="stop")
                    regen_btn = gr.Button("Regenerate", elem_id="regenerate")
                with gr.Accordion("System prompt", open=False):
                    system = gr.Textbox(lines=4, show_label=False, elem_id="system")
                    with gr.Row():
                        preset_btn = gr.Button("Customer-service preset", size="sm")
                        save_system_btn = gr.Button("Save for this chat", size="sm", elem_id="save-system")
                with gr.Accordion("Sampling", open=False):
                    sampling_note = gr.Markdown(elem_id="sampling-note")
                    temperature = gr.Slider(0, 2, value=0.7, step=0.05, label="Temperature", elem_id="temperature")
                    top_p = gr.Slider(0.05, 1, value=0.95, step=0.05, label="Top-p", elem_id="top-p")
                    max_tokens = gr.Slider(16, 1024, value=256, step=16, label="Max new tokens", elem_id="max-tokens")
                    penalty = gr.Slider(1.0, 2.0, value=CHAT_REPETITION_PENALTY, step=0.05,
                                        label="Repetition penalty", elem_id="repetition-penalty")
            with gr.Column(scale=2, min_width=320):
                panel = gr.HTML(page_map_html(None), elem_id="panel")
                memory = gr.HTML()
                plots = [gr.LinePlot(x="seconds", y="value", color="series", title=t, height=200)
                         for t in PLOT_TITLES]
                with gr.Column(visible=False, elem_id="operator") as operator_col:
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
                    with gr.Accordion("Prefix cache", open=False, elem_id="cache-controls"):
                        reset_btn = gr.Button("Reset prefix cache", size="sm", variant="stop", elem_id="reset-cache")
                        reset_status = gr.Markdown(elem_id="reset-status")
                    with gr.Accordion("Rated replies", open=False, elem_id="review"):
                        review_btn = gr.Button("Show rated replies", size="sm", elem_id="review-refresh")
                        review = gr.Dataframe(headers=FEEDBACK_COLUMNS, interactive=False, wrap=True,
                                              elem_id="review-table")
                        with gr.Row():
                            review_csv_btn = gr.Button("Download CSV", size="sm", elem_id="review-csv")
                            review_jsonl_btn = gr.Button("Download JSONL", size="sm", elem_id="review-jsonl")
                        review_file = gr.File(label="Download", interactive=False, elem_id="review-file")
        timer = gr.Timer(1.0)

        def with_marks(event):
            """Thumbs as stored, after an event that shows messages."""
            return event.then(chat.marks, [user, session], [chatbot], show_progress="hidden", **PRIVATE)

        # ---- identity, sessions, files --------------------------------------------------
        shown_session = [sessions, session, chatbot, system, title]
        with_marks(demo.load(chat.init, None, [user, sessions, session, chatbot, system, title]))
        demo.load(None, js=ON_LOAD)
        demo.load(chat.sampling_defaults, None, [temperature, top_p, penalty, sampling_note], **PRIVATE)
        demo.load(operator.show_controls, None, [operator_col], **PRIVATE)
        with_marks(sessions.input(chat.open_session, [user, sessions], [session, chatbot, system, title]))
        new_btn.click(chat.new_chat, [user, system], [sessions, session, chatbot, title])
        chatbot.clear(chat.new_chat, [user, system], [sessions, session, chatbot, title], **PRIVATE)  # kept, not lost
        rename_btn.click(chat.rename, [user, session, title], [sessions])
        title.submit(chat.rename, [user, session, title], [sessions], **PRIVATE)
        with_marks(delete_btn.click(chat.delete, [user, session], shown_session))
        search.change(chat.find, [user, search], [sessions])
        save_system_btn.click(chat.save_system, [user, session, system], None)
        preset_btn.click(lambda: CUSTOMER_SERVICE_PROMPT, None, [system], **PRIVATE)
        export_md_btn.click(chat.export_markdown, [user, session], [export_file])
        export_json_btn.click(chat.export_json, [user, session], [export_file])
        with_marks(import_btn.upload(chat.import_chat, [user, import_btn], shown_session))
        delete_all_btn.click(lambda: gr.update(visible=True), None, [confirm_row], **PRIVATE)
        confirm_no.click(lambda: gr.update(visible=False), None, [confirm_row], **PRIVATE)
        confirm_yes.click(chat.delete_all, [user], [*shown_session, confirm_row])
        theme_btn.click(None, js=THEME_TOGGLE)

        # ---- chat turns: shown at once (unqueued), then sent ------------------------------
        turn_inputs = [user, session, pending, temperature, top_p, max_tokens, penalty]
        stage = dict(fn=chat.stage, inputs=[msg, chatbot], outputs=[msg, chatbot, pending], queue=False, **PRIVATE)
        send_events = [send_btn.click(**stage).then(chat.send, turn_inputs, [chatbot, msg], concurrency_limit=None,
                                                    api_name="send"),
                       msg.submit(**stage).then(chat.send, turn_inputs, [chatbot, msg], concurrency_limit=None,
                                                **PRIVATE)]
        for event in send_events:
            with_marks(event.then(chat.refresh, [user, session], [sessions, session, title], show_progress="hidden",
                                  **PRIVATE))
        regen_event = regen_btn.click(chat.regenerate, [user, session, temperature, top_p, max_tokens, penalty],
                                      [chatbot], concurrency_limit=None)
        edit_event = chatbot.edit(chat.edit_from_here, [user, session, temperature, top_p, max_tokens, penalty],
                                  [chatbot, msg], concurrency_limit=None)
        with_marks(regen_event)
        with_marks(edit_event)
        stop_btn.click(None, None, None, cancels=[*send_events, regen_event, edit_event])
        chatbot.like(chat.rate, [user, session], [rated, comment_row])
        for trigger in (comment_btn.click, comment_box.submit):
            trigger(chat.comment, [user, session, rated, comment_box], [comment_box, comment_row])
        demo.unload(chat.tab_closed)

        # ---- live panel and operator ----------------------------------------------------
        timer.tick(sampler.render, None, [model_line, panel, memory, *plots], **LIVE, **PRIVATE)
        model_dd.change(operator.quant_options, [model_dd], [quant_dd])
        switch_btn.click(operator.switch, [model_dd, quant_dd], [switch_status]).then(
            chat.sampling_defaults, None, [temperature, top_p, penalty, sampling_note], **PRIVATE)
        sim_btn.click(operator.simulate, [sim_n], [sim_status])
        reset_btn.click(operator.reset_prefix_cache, None, [reset_status])
        review_btn.click(operator.feedback_table, None, [review])
        review_csv_btn.click(operator.feedback_csv, None, [review_file])
        review_jsonl_btn.click(operator.feedback_jsonl, None, [review_file])
    return demo
