"""The Gradio 6 panels and their wiring, and the demo page built from them (the chat plus a chat's
own system prompt and sampling, the live engine panel, and the operator controls for operators).
Only components and wiring live here; what the events do is in handlers.py and operator.py. The
customer chat is customer.py, the console console.py."""
from __future__ import annotations

from types import SimpleNamespace

import gradio as gr

from engine.client import EngineClient
from server.auth import Credentials, VisitorCookie
from server.limits import UserLimiter
from ui import downloads
from ui.assistants import CHAT_REPETITION_PENALTY
from ui.handlers import DEMO_HINT, ChatHandlers
from ui.i18n import TEXT
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
ENGLISH = TEXT["en"].__getitem__  # the demo page's words
PLOT_TITLES = ("Requests and preemptions", "Tokens per step (mean)", "Generated tok/s", "Prefix-cache hit rate",
               "Memory (MiB)")  # one per panel.PLOTS entry


def build_ui(client: EngineClient, store, *, models: dict[str, str | None], quantization: str | None,
             credentials: Credentials, limiter: UserLimiter, visitors: VisitorCookie | None,
             salt_by_user: bool = False) -> gr.Blocks:
    """The demo page. models: label -> model argument (None = the embedded default); the first is
    the one loaded. credentials.operators: the logins that see and may use the operator controls.
    visitors: the cookie signer when nobody logs in. limiter: the per-user cap shared with the API."""
    chat = ChatHandlers(client, store, visitors, limiter, salt_by_user, demo=True)
    operator = OperatorHandlers(client, store, models, quantization, set(credentials.operators))
    sampler = PanelSampler(client)

    with gr.Blocks(title="pagedchat", analytics_enabled=False) as demo:  # no usage pings from a customer-facing app
        state = SimpleNamespace(user=gr.State(None), session=gr.State(None), rated=gr.State(None))
        side = chats_sidebar()
        gr.HTML("<h1 class='page-title'>pagedchat demo</h1>")
        with gr.Row():
            header = SimpleNamespace(model_line=gr.HTML("Model: loading…", elem_id="model-line"),
                                     theme_btn=gr.Button("Light / dark", size="sm", scale=0, elem_id="theme-toggle"))
        with gr.Row():
            with gr.Column(scale=3, min_width=360):
                pane = chat_pane()
            with gr.Column(scale=2, min_width=320):
                live = engine_panel()
                ops = operator_controls(models, *operator.initial_choices())
        timer = gr.Timer(1.0)

        def demo_loads():
            demo.load(chat.sampling_defaults, None, [pane.temperature, pane.top_p, pane.penalty, pane.sampling_note],
                      **PRIVATE)
            demo.load(operator.show_controls, None, [ops.column], **PRIVATE)
            demo.load(operator.in_force, None, [ops.model_dd, ops.quant_dd], **PRIVATE)
            demo.load(chat.greeting, None, [pane.chatbot], concurrency_limit=None, **PRIVATE)
        wire_sessions(demo, chat, state, side, pane, header, demo_loads)
        wire_turns(demo, chat, state, side, pane)
        wire_panel(timer, chat, operator, sampler, header, pane, live, ops)
    return demo


def chats_sidebar(t=ENGLISH) -> SimpleNamespace:
    """New chat, search, the list of chats, rename / delete, export / import / delete all. `t`: key ->
    text (i18n.text on the customer chat)."""
    with gr.Sidebar(label=t("chats"), open=True):
        new_btn = gr.Button(t("new_chat"), variant="primary", elem_id="new-chat")
        search = gr.Textbox(placeholder=t("search"), show_label=False, elem_id="search")
        sessions = gr.Radio(choices=[], label=t("your_chats"), elem_id="sessions")
        title = gr.Textbox(label=t("title"), elem_id="title")
        with gr.Row():
            rename_btn = gr.Button(t("rename"), size="sm", elem_id="rename")
            delete_btn = gr.Button(t("delete"), size="sm", variant="stop", elem_id="delete")
        with gr.Row(visible=False, elem_id="confirm-delete") as confirm_delete_row:
            gr.Markdown(t("confirm_delete"))
            confirm_delete_yes = gr.Button(t("confirm_delete_yes"), size="sm", variant="stop", elem_id="confirm-delete-yes")
            confirm_delete_no = gr.Button(t("cancel"), size="sm", elem_id="confirm-delete-no")
        with gr.Accordion(t("transfer"), open=False, elem_id="transfer"):
            with gr.Row():
                export_md_btn = gr.Button(t("export_md"), size="sm", elem_id="export-md")
                export_json_btn = gr.Button(t("export_json"), size="sm", elem_id="export-json")
            export_file = gr.File(label=t("download"), interactive=False, elem_id="export-file")
            import_btn = gr.UploadButton(t("import"), file_types=[".json"], size="sm", elem_id="import")
            delete_all_btn = gr.Button(t("delete_all"), size="sm", variant="stop", elem_id="delete-all")
            with gr.Row(visible=False, elem_id="confirm-delete-all") as confirm_row:
                gr.Markdown(t("confirm_delete_all"))
                confirm_yes = gr.Button(t("confirm_yes"), size="sm", variant="stop", elem_id="confirm-yes")
                confirm_no = gr.Button(t("cancel"), size="sm", elem_id="confirm-no")
    return SimpleNamespace(**locals())


def chat_pane(demo: bool = True, t=ENGLISH, staffed: bool = True) -> SimpleNamespace:
    """The conversation, feedback, the input and its buttons; on the demo page also a chat's system
    prompt and sampling. staffed: the customer chat offers a person."""
    chatbot = gr.Chatbot(elem_id="chatbot", height=520, sanitize_html=True, buttons=["copy"],
                         editable="user", feedback_options=("Like", "Dislike"),
                         placeholder=DEMO_HINT, **({} if demo else {"label": t("chat")}))
    with gr.Row(visible=False, elem_id="comment-row") as comment_row:
        comment_box = gr.Textbox(placeholder=t("comment"),
                                 show_label=False, scale=4, elem_id="comment")
        comment_btn = gr.Button(t("send_feedback"), size="sm", scale=1, elem_id="send-comment")
    if not demo:  # where the chat stands with a person, just above the input
        status = gr.Markdown(visible=False, elem_id="person-status")
    msg = gr.Textbox(placeholder=t("message"),
                     show_label=False, elem_id="msg", lines=1, max_lines=8, autofocus=True, submit_btn=False)
    pending = gr.Textbox(visible=False)  # the staged message, between showing it and sending it
    with gr.Row():
        send_btn = gr.Button(t("send"), variant="primary", elem_id="send")
        stop_btn = gr.Button(t("stop"), elem_id="stop")
        regen_btn = gr.Button(t("regenerate"), elem_id="regenerate")
    if not demo:
        with gr.Row():
            person_btn = gr.Button(t("person"), size="sm", elem_id="talk-to-person", visible=staffed)
            back_btn = gr.Button(t("back_to_assistant"), size="sm", elem_id="back-to-assistant", visible=False)
        poll = gr.Timer(1.0, active=False)  # runs while a person is involved: their replies show by themselves
        seen = gr.State(0)  # messages the tab shows, so a poll re-renders only when one came
        return SimpleNamespace(**locals())
    with gr.Accordion("System prompt", open=False):
        system = gr.Textbox(lines=4, show_label=False, elem_id="system")
        with gr.Row():
            preset_btn = gr.Button("Customer-service preset", size="sm")
            save_system_btn = gr.Button("Save for this chat", size="sm", elem_id="save-system")
    with gr.Accordion("Sampling", open=False, elem_id="sampling"):
        sampling_note = gr.Markdown(elem_id="sampling-note")
        temperature = gr.Slider(0, 2, value=0.7, step=0.05, label="Temperature", elem_id="temperature")
        top_p = gr.Slider(0.05, 1, value=0.95, step=0.05, label="Top-p", elem_id="top-p")
        max_tokens = gr.Slider(16, 1024, value=256, step=16, label="Max new tokens", elem_id="max-tokens")
        penalty = gr.Slider(1.0, 2.0, value=CHAT_REPETITION_PENALTY, step=0.05,
                            label="Repetition penalty", elem_id="repetition-penalty")
    return SimpleNamespace(**locals())


def engine_panel() -> SimpleNamespace:
    """The live engine panel: KV page map, memory, the time series."""
    panel = gr.HTML(page_map_html(None), elem_id="panel")
    memory = gr.HTML()
    plots = [time_plot(t) for t in PLOT_TITLES]
    return SimpleNamespace(**locals())


def time_plot(title: str) -> gr.LinePlot:
    """One of the panel's series over the last samples. Every series is a count, a rate or MiB, never
    below 0; the hit rate is a share of the prompt tokens (Vega's own ticks print an all-zero series as
    0.000000)."""
    y_lim, y_format = ([0, 1], ".0%") if title == "Prefix-cache hit rate" else ([0, None], ",~r")
    return gr.LinePlot(x="seconds", y="value", color="series", title=title, height=200, y_lim=y_lim,
                       y_axis_format=y_format)


def operator_controls(models: dict[str, str | None], quant_choices: list[str], quant_value: str,
                      visible: bool = False) -> SimpleNamespace:
    """Operators only (hidden until show_controls, or shown in the console, which is theirs as a
    whole): model switch, simulated load, cache reset, ratings."""
    with gr.Column(visible=visible, elem_id="operator") as column:
        with gr.Accordion("Model", open=False):
            model_dd = gr.Dropdown(list(models), value=next(iter(models)), label="Model", elem_id="model")
            quant_dd = gr.Dropdown(quant_choices, value=quant_value, label="Quantization", elem_id="quantization")
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
            review = gr.Dataframe(headers=FEEDBACK_COLUMNS, interactive=False, wrap=True, elem_id="review-table")
            gr.HTML(downloads.links(("Download CSV", "feedback.csv"), ("Download JSONL", "feedback.jsonl")),
                    elem_id="review-downloads")
    return SimpleNamespace(**locals())


# ---- the wiring -----------------------------------------------------------------------------
def _with_marks(chat: ChatHandlers, state: SimpleNamespace, pane: SimpleNamespace, event):
    """Thumbs as stored, after an event that shows messages."""
    return event.then(chat.marks, [state.user, state.session], [pane.chatbot], show_progress="hidden", **PRIVATE)


def wire_sessions(page: gr.Blocks, chat: ChatHandlers, state: SimpleNamespace, side: SimpleNamespace,
                  pane: SimpleNamespace, header: SimpleNamespace, more_loads=None):
    """Identity, the list of chats, files, the theme (`more_loads()` adds the page's own load events
    after the first two). The demo page also shows and saves a chat's system prompt (`pane.system`);
    the customer chat has no such component. Returns the load event that finds the user's chat."""
    user, session = state.user, state.session
    system = [pane.system] if chat.demo else []

    def marks(event):
        return _with_marks(chat, state, pane, event)
    shown_session = [side.sessions, session, pane.chatbot, *system, side.title]
    started = page.load(chat.init, None, [user, *shown_session])
    marks(started)
    page.load(None, js=ON_LOAD)
    if more_loads is not None:
        more_loads()
    marks(side.sessions.input(chat.open_session, [user, side.sessions], [session, pane.chatbot, *system, side.title]))
    new_chat = [side.sessions, session, pane.chatbot, side.title]
    side.new_btn.click(chat.new_chat, [user, *system], new_chat)
    pane.chatbot.clear(chat.new_chat, [user, *system], new_chat, **PRIVATE)  # kept, not lost
    side.rename_btn.click(chat.rename, [user, session, side.title], [side.sessions])
    side.title.submit(chat.rename, [user, session, side.title], [side.sessions], **PRIVATE)
    side.delete_btn.click(lambda: gr.update(visible=True), None, [side.confirm_delete_row], **PRIVATE)
    side.confirm_delete_no.click(lambda: gr.update(visible=False), None, [side.confirm_delete_row], **PRIVATE)
    marks(side.confirm_delete_yes.click(chat.delete, [user, session], [*shown_session, side.confirm_delete_row]))
    side.search.change(chat.find, [user, side.search], [side.sessions])
    if chat.demo:
        pane.save_system_btn.click(chat.save_system, [user, session, pane.system], None)
        pane.preset_btn.click(lambda: CUSTOMER_SERVICE_PROMPT, None, [pane.system], **PRIVATE)
    side.export_md_btn.click(chat.export_markdown, [user, session], [side.export_file])
    side.export_json_btn.click(chat.export_json, [user, session], [side.export_file])
    marks(side.import_btn.upload(chat.import_chat, [user, side.import_btn], shown_session))
    side.delete_all_btn.click(lambda: gr.update(visible=True), None, [side.confirm_row], **PRIVATE)
    side.confirm_no.click(lambda: gr.update(visible=False), None, [side.confirm_row], **PRIVATE)
    side.confirm_yes.click(chat.delete_all, [user], [*shown_session, side.confirm_row])
    header.theme_btn.click(None, js=THEME_TOGGLE)
    return started


def wire_turns(demo: gr.Blocks, chat: ChatHandlers, state: SimpleNamespace, side: SimpleNamespace,
               pane: SimpleNamespace) -> list:
    """Chat turns: shown at once (unqueued), then sent; regenerate, edit, stop, thumbs. Returns the
    send events (Send and Enter)."""
    user, session = state.user, state.session
    sampling = [pane.temperature, pane.top_p, pane.max_tokens, pane.penalty] if chat.demo else []

    def marks(event):
        return _with_marks(chat, state, pane, event)
    turn_inputs = [user, session, pane.pending, *sampling]
    stage = dict(fn=chat.stage, inputs=[pane.msg, pane.chatbot, session],
                 outputs=[pane.msg, pane.chatbot, pane.pending], queue=False, **PRIVATE)
    # "multiple": a message sent while the reply streams reaches `send`, which keeps it in the box and
    # says why (Gradio's default drops an event whose last run is still pending, and with it the text)
    send = dict(fn=chat.send, inputs=turn_inputs, outputs=[pane.chatbot, pane.msg], concurrency_limit=None,
                trigger_mode="multiple")
    staged = [pane.send_btn.click(**stage), pane.msg.submit(**stage)]
    if not chat.demo:  # quick-reply chips in an empty chat send their fixed text
        staged.append(pane.chatbot.example_select(chat.stage_quick_reply, [pane.chatbot],
                                                  [pane.msg, pane.chatbot, pane.pending], queue=False, **PRIVATE))
    send_events = [staged[0].then(**send, api_name="send"), *(event.then(**send, **PRIVATE) for event in staged[1:])]
    for event in staged:  # a new chat is named in the list as its first message shows, not after the reply
        event.then(chat.name_at_once, [user, session, pane.pending], [side.sessions, side.title], queue=False,
                   show_progress="hidden", **PRIVATE)
    for event in send_events:
        marks(event.then(chat.refresh, [user, session], [side.sessions, session, side.title], show_progress="hidden",
                         **PRIVATE))
    regen_event = pane.regen_btn.click(chat.regenerate, [user, session, *sampling], [pane.chatbot],
                                       concurrency_limit=None)
    edit_event = pane.chatbot.edit(chat.edit_from_here, [user, session, *sampling], [pane.chatbot, pane.msg],
                                   concurrency_limit=None)
    marks(regen_event)
    marks(edit_event)
    stopped = pane.stop_btn.click(chat.stop, [user, session], [pane.chatbot], cancels=[*send_events, regen_event,
                                  edit_event], concurrency_limit=None, show_progress="hidden", **PRIVATE)
    marks(stopped.then(chat.shown_after_stop, [user, session], [pane.chatbot], show_progress="hidden", **PRIVATE))
    pane.chatbot.like(chat.rate, [user, session], [state.rated, pane.comment_row])
    for trigger in (pane.comment_btn.click, pane.comment_box.submit):
        trigger(chat.comment, [user, session, state.rated, pane.comment_box], [pane.comment_box, pane.comment_row])
    demo.unload(chat.tab_closed)
    return send_events


def wire_panel(timer: gr.Timer, chat: ChatHandlers, operator: OperatorHandlers, sampler: PanelSampler,
               header: SimpleNamespace, pane: SimpleNamespace, live: SimpleNamespace, ops: SimpleNamespace) -> None:
    """The live panel's timer and the operator's controls (a switch refreshes the sliders' defaults)."""
    wire_live(timer, sampler, header.model_line, live)
    wire_operator(operator, ops, lambda switched: switched.then(
        chat.sampling_defaults, None, [pane.temperature, pane.top_p, pane.penalty, pane.sampling_note], **PRIVATE))


def wire_live(timer: gr.Timer, sampler: PanelSampler, model_line: gr.HTML, live: SimpleNamespace,
              allowed=None) -> None:
    """The panel's timer; with `allowed(request)`, only those it allows get the panel's data."""
    outputs = [model_line, live.panel, live.memory, *live.plots]

    def gated(request: gr.Request):
        return sampler.render() if allowed(request) else (gr.update(),) * len(outputs)
    timer.tick(sampler.render if allowed is None else gated, None, outputs, **LIVE, **PRIVATE)


def wire_operator(operator: OperatorHandlers, ops: SimpleNamespace, after_switch=None) -> None:
    """The operator's controls; `after_switch(event)` chains what follows a model switch."""
    ops.model_dd.input(operator.quant_options, [ops.model_dd], [ops.quant_dd])  # the operator's pick, not a load's
    switched = ops.switch_btn.click(operator.switch, [ops.model_dd, ops.quant_dd], [ops.switch_status])
    if after_switch is not None:
        after_switch(switched)
    ops.sim_btn.click(operator.simulate, [ops.sim_n], [ops.sim_status])
    ops.reset_btn.click(operator.reset_prefix_cache, None, [ops.reset_status])
    ops.review_btn.click(operator.feedback_table, None, [ops.review])
