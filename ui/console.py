"""The console (/console): for agents (`--agent NAME`) the handoff inbox; for operators also the
live engine panel, the model switcher and the other operator controls, and the assistants editor.
Anyone else sees one line saying so, and every handler checks again (a visitor calling an
endpoint directly is refused)."""
from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import gradio as gr
import pandas as pd

from engine.client import EngineClient
from engine.fleet import ModelFleet
from server.auth import Credentials
from storage import analytics
from storage.documents import KINDS, MAX_FILE_BYTES, DocumentError
from storage.knowledge import Knowledge
from ui import assistants, downloads
from ui.grounding import DEFAULT_K
from ui.inbox import InboxHandlers, inbox_panel, wire_inbox
from ui.privacy import CustomerDataHandlers, customer_data_panel, wire_customer_data
from ui.layout import PRIVATE, THEME_TOGGLE, engine_panel, operator_controls, wire_live, wire_operator
from ui.operator import OperatorHandlers
from ui.panel import PanelSampler

NEW = "New assistant…"
VERSION_COLUMNS = ["address", "version", "name", "saved", "by"]


class AssistantEditor:
    """The assistants editor's events: show one assistant's latest version, save a new version."""

    def __init__(self, store, operator: OperatorHandlers, fleet: ModelFleet | None = None) -> None:
        """fleet: the engines by model (None: the operator's engine alone)."""
        self.store, self.operator = store, operator
        self.fleet = fleet or ModelFleet(operator.client, operator.models)
        self.knowledge = Knowledge(store)

    def choices(self) -> list[str]:
        return [a["assistant"] for a in self.store.assistants()] + [NEW]

    def show(self, slug: str, request: gr.Request):
        """(address, name, prompt, greeting, temperature, top_p, max tokens, penalty, model, quick
        replies, canned responses, tools, k, least relevance, team hours, documents, versions); nothing
        for anyone but an operator."""
        if not self.operator.is_operator(request):
            return (gr.update(),) * 17
        a = self.store.assistant(slug) if slug and slug != NEW else None
        if a is None:
            return ("", "", "", "", None, None, None, None, "", "", "", "[]", DEFAULT_K, 0.0, "", [],
                    self.versions(request))
        s, k = a["sampling"], a["knowledge"]
        return (a["assistant"], a["name"], a["system_prompt"], a["greeting"], s.get("temperature"), s.get("top_p"),
                s.get("max_tokens"), s.get("repetition_penalty"),
                a["model"] if a["model"] in self.fleet.choices() else "", "\n".join(a["quick_replies"]),
                assistants.format_canned(a["canned"]), json.dumps(a["tools"], indent=1, ensure_ascii=False),
                k.get("k", DEFAULT_K), k.get("min_score", 0.0), a["hours"], self.documents(a["assistant"]),
                self.versions(request))

    def documents(self, slug: str) -> list[list]:
        return [[d["name"], d["chunks"], d["chars"], time.strftime("%Y-%m-%d %H:%M", time.localtime(d["updated"]))]
                for d in self.knowledge.documents(slug)]

    def upload(self, slug, files, request: gr.Request):
        """Documents into the assistant's knowledge, each in its own transaction: one line per file."""
        self.operator._check(request)
        if not slug or self.store.assistant(slug) is None:
            return "❌ Save the assistant first, then add its documents.", gr.update()
        lines = []
        for path in files or []:
            try:
                with open(path, "rb") as f:
                    lines.append("✅ " + self.knowledge.add(slug, os.path.basename(path), f.read(MAX_FILE_BYTES + 1)))
            except (DocumentError, OSError) as e:
                lines.append(f"❌ {e}")
        return "\n\n".join(lines) or "Choose one or more files.", self.documents(slug)

    def add_page(self, slug, url, request: gr.Request):
        """A page of the shop's site into the assistant's knowledge, fetched now (again: updated)."""
        self.operator._check(request)
        if not slug or self.store.assistant(slug) is None:
            return "❌ Save the assistant first, then add its documents.", gr.update()
        try:
            line = "✅ " + self.knowledge.add_page(slug, url)
        except DocumentError as e:
            line = f"❌ {e}"
        return line, self.documents(slug)

    def refresh_pages(self, slug, request: gr.Request):
        """The assistant's fetched pages, fetched again now (as --refresh-pages-hours does)."""
        self.operator._check(request)
        if not slug or self.store.assistant(slug) is None:
            return "❌ Save the assistant first, then add its documents.", gr.update()
        lines = self.knowledge.refresh_pages(slug)
        return "\n".join(f"- {line}" for line in lines) or "This assistant has no pages fetched by address.", \
            self.documents(slug)

    def remove(self, slug, name, request: gr.Request):
        self.operator._check(request)
        done = self.knowledge.remove(slug, (name or "").strip())
        return (f"Removed {name}." if done else f"❌ {slug} has no document {name!r}."), self.documents(slug)

    def save(self, slug, name, prompt, greeting, temperature, top_p, max_tokens, penalty, model, quick="",
             canned="", tools="[]", k=DEFAULT_K, min_score=0.0, team_hours="", request: gr.Request = None):
        """A new version; new chats take it, chats already started keep theirs."""
        self.operator._check(request)
        slug = (slug or "").strip()
        try:
            fields = {"name": name, "system_prompt": prompt, "greeting": greeting, "model": model,
                      "sampling": {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens,
                                   "repetition_penalty": penalty},
                      "quick_replies": (quick or "").splitlines(), "canned": assistants.parse_canned(canned),
                      "tools": tools, "knowledge": {"k": None if k is None else int(k), "min_score": min_score},
                      "hours": team_hours}
            self.fleet.check(model or "")
            version = assistants.save(self.store, slug, fields, getattr(request, "username", None) or "operator")
        except ValueError as e:
            return f"❌ {e}", gr.update(), gr.update()
        client = self.fleet.client_for(model)  # its model starts loading now, if it is not yet
        note = f" Its chats are answered by **{model}** ({client.state})." if client is not self.fleet.main else ""
        return (f"✅ Saved **{slug}** version {version}: new chats at [/chat/{slug}](/chat/{slug}/) use it, chats "
                f"already started keep the version they began with.{note}",
                gr.update(choices=self.choices(), value=slug), self.versions(request))

    def versions(self, request: gr.Request):
        self.operator._check(request)
        return [[v["assistant"], v["version"], v["name"], time.strftime("%Y-%m-%d %H:%M", time.localtime(v["created"])),
                 v["created_by"]] for v in self.store.assistant_versions()]


class AnalyticsHandlers:
    def __init__(self, store, operator: OperatorHandlers) -> None:
        self.store, self.operator = store, operator

    def table(self, days, request: gr.Request):
        """(table rows, the chats-and-turns plot, the questions no document matched) over the last `days` days."""
        self.operator._check(request)
        days = analytics.day_range(days)
        rows = analytics.daily(self.store, days)
        series = pd.DataFrame([{"day": pd.Timestamp(r["day"]), "value": r[k], "series": f"{r['assistant']} {k}"}
                               for r in rows for k in ("chats", "turns")], columns=["day", "value", "series"])
        gaps = [[g[c] for c in analytics.GAP_COLUMNS] for g in analytics.unanswered(self.store, days)]
        return [[r[c] for c in analytics.COLUMNS] for r in rows], series, gaps


def analytics_panel() -> SimpleNamespace:
    with gr.Accordion("Analytics", open=False, elem_id="analytics"):
        with gr.Row():
            days = gr.Number(30, precision=0, minimum=1, maximum=analytics.MAX_DAYS, label="Days", elem_id="analytics-days")
            refresh_btn = gr.Button("Show", size="sm", elem_id="analytics-refresh")
            csv_link = gr.HTML(downloads.analytics_link(30), elem_id="analytics-csv")
        plot = gr.LinePlot(x="day", y="value", color="series", title="Chats and turns per day", height=240)
        table = gr.Dataframe(headers=analytics.COLUMNS, interactive=False, wrap=True, elem_id="analytics-table")
        gaps = gr.Dataframe(headers=analytics.GAP_COLUMNS, interactive=False, wrap=True, elem_id="analytics-gaps",
                            label=f"What customers asked about that no document mentions (of the last "
                                  f"{analytics.SCANNED} questions in the range): a document that covers it closes the "
                                  "gap")
    return SimpleNamespace(**locals())


def build_console(client: EngineClient, store, *, models: dict[str, str | None], quantization: str | None,
                  credentials: Credentials, agents: frozenset[str] = frozenset(),
                  fleet: ModelFleet | None = None) -> gr.Blocks:
    operator = OperatorHandlers(client, store, models, quantization, set(credentials.operators))
    inbox = InboxHandlers(store, set(agents) | set(credentials.operators))
    editor = AssistantEditor(store, operator, fleet)
    numbers = AnalyticsHandlers(store, operator)
    sampler = PanelSampler(client, fleet=editor.fleet)
    with gr.Blocks(title="pagedchat console", analytics_enabled=False) as console:
        gr.HTML("<h1 class='page-title'>pagedchat console</h1>")
        refused = gr.Markdown("The console is for agents and operators: log in with an agent's name (`--agent NAME`) "
                              "or an operator's (`--admin NAME`).", elem_id="console-refused")
        with gr.Column(visible=False, elem_id="agent-console") as agent_body:
            box = inbox_panel()
        with gr.Column(visible=False, elem_id="console") as body:
            with gr.Row():
                model_line = gr.HTML("Model: loading…", elem_id="model-line")
                theme_btn = gr.Button("Light / dark", size="sm", scale=0, elem_id="theme-toggle")
            with gr.Row():
                with gr.Column(scale=3, min_width=360):
                    edit = assistants_editor(editor)
                    stats = analytics_panel()
                    privacy = customer_data_panel()
                with gr.Column(scale=2, min_width=320):
                    live = engine_panel()
                    ops = operator_controls(models, *operator.initial_choices(), visible=True)
        timer, inbox_timer = gr.Timer(1.0), gr.Timer(2.0)

        def face(request: gr.Request):
            """The refusal line for visitors, the inbox for agents, all of it for operators."""
            agent, allowed = inbox.is_agent(request), operator.is_operator(request)
            return gr.update(visible=not agent), gr.update(visible=agent), gr.update(visible=allowed)
        console.load(face, None, [refused, agent_body, body], **PRIVATE)
        wire_inbox(console, inbox_timer, inbox, box)
        fields = [edit.slug, edit.name, edit.prompt, edit.greeting, edit.temperature, edit.top_p, edit.max_tokens,
                  edit.penalty, edit.model, edit.quick, edit.canned, edit.tools, edit.k, edit.min_score, edit.hours]
        console.load(editor.show, [edit.pick], [*fields, edit.documents, edit.versions], **PRIVATE)
        edit.pick.input(editor.show, [edit.pick], [*fields, edit.documents, edit.versions], **PRIVATE)
        edit.upload.upload(editor.upload, [edit.slug, edit.upload], [edit.knowledge_status, edit.documents], **PRIVATE)
        for trigger in (edit.fetch_btn.click, edit.page_url.submit):
            trigger(editor.add_page, [edit.slug, edit.page_url], [edit.knowledge_status, edit.documents], **PRIVATE)
        edit.refetch_btn.click(editor.refresh_pages, [edit.slug], [edit.knowledge_status, edit.documents], **PRIVATE)
        edit.remove_btn.click(editor.remove, [edit.slug, edit.remove_name], [edit.knowledge_status, edit.documents],
                              **PRIVATE)
        edit.save_btn.click(editor.save, fields, [edit.status, edit.pick, edit.versions], **PRIVATE)
        stats.refresh_btn.click(numbers.table, [stats.days], [stats.table, stats.plot, stats.gaps], **PRIVATE)
        stats.days.change(downloads.analytics_link, [stats.days], [stats.csv_link], **PRIVATE)
        theme_btn.click(None, js=THEME_TOGGLE)
        wire_live(timer, sampler, model_line, live, allowed=operator.is_operator)
        wire_operator(operator, ops)
        wire_customer_data(CustomerDataHandlers(store, operator), privacy)
        console.load(operator.in_force, None, [ops.model_dd, ops.quant_dd], **PRIVATE)
    return console


def assistants_editor(editor: AssistantEditor) -> SimpleNamespace:
    """One assistant's fields; saving makes a new version."""
    with gr.Accordion("Assistants", open=True, elem_id="assistants"):
        choices = editor.choices()
        pick = gr.Dropdown(choices, value=choices[0], label="Assistant", elem_id="assistant-pick")
        slug = gr.Textbox(label="Address (the chat is at /chat/<address>)", elem_id="assistant-slug")
        name = gr.Textbox(label="Name (shown to customers)", elem_id="assistant-name-field")
        prompt = gr.Textbox(label="System prompt (persona and policies; never shown to customers)", lines=8,
                            max_lines=30, elem_id="assistant-prompt",
                            info="Name your website here: replies link only to sites named here, in the "
                                 "greeting, replies, tools or documents")
        greeting = gr.Textbox(label="Greeting (shown in an empty chat)", lines=2, elem_id="assistant-greeting")
        with gr.Row():
            temperature = gr.Number(None, label="Temperature (empty: the model's)", minimum=0, maximum=2,
                                    elem_id="assistant-temperature")
            top_p = gr.Number(None, label="Top-p (empty: the model's)", minimum=0.01, maximum=1,
                              elem_id="assistant-top-p")
        with gr.Row():
            max_tokens = gr.Number(None, label="Max reply tokens", precision=0, minimum=1, maximum=4096,
                                   elem_id="assistant-max-tokens")
            penalty = gr.Number(None, label="Repetition penalty", minimum=1, maximum=2, elem_id="assistant-penalty")
        model = gr.Dropdown(editor.fleet.choices(), value="", label="Model (empty: the main model, the one the "
                            "switcher loads; others are offered with --models and load beside it)",
                            elem_id="assistant-model")
        quick = gr.Textbox(label=f"Quick replies for customers, one per line (at most {assistants.MAX_QUICK_REPLIES})",
                           lines=3, elem_id="assistant-quick")
        canned = gr.Textbox(label="Canned responses for agents, `/shortcut: the response` per line", lines=4,
                            elem_id="assistant-canned")
        hours = gr.Textbox(label="Team hours, when people answer chats handed to them (empty: whenever a console is "
                           "open)", placeholder="Mon-Fri 09:00-17:00; Sat 10:00-14:00; Europe/Berlin",
                           elem_id="assistant-hours")
        tools = gr.Code("[]", language="json", label="Tools (JSON): built-ins {\"builtin\": \"lookup_order\" | "
                        "\"handoff\", \"when\": regex}, or HTTP {\"name\", \"description\", \"url\", \"method\", "
                        "\"parameters\", \"timeout_s\", \"secret_file\", \"secret_header\", \"when\"}",
                        elem_id="assistant-tools")
        with gr.Row():
            k = gr.Number(DEFAULT_K, label="Knowledge: excerpts per turn (0: none)", precision=0, minimum=0,
                          maximum=assistants.MAX_CHUNKS, elem_id="assistant-k")
            min_score = gr.Number(0.0, label="Knowledge: least relevance (bm25)", minimum=0,
                                  elem_id="assistant-min-score")
        save_btn = gr.Button("Save as a new version", variant="primary", elem_id="assistant-save")
        status = gr.Markdown(elem_id="assistant-status")
        versions = gr.Dataframe(headers=VERSION_COLUMNS, interactive=False, elem_id="assistant-versions")
        gr.Markdown("**Knowledge**: documents this assistant answers from (Markdown, text, HTML, PDF, Word .docx; a "
                    "file of the same name replaces the old one; each reply shows the excerpts it drew on)")
        upload = gr.File(file_count="multiple", file_types=list(KINDS), label="Add documents",
                         elem_id="knowledge-upload")
        with gr.Row():
            page_url = gr.Textbox(label="Or a page of your site, by its address (fetched again every day, "
                                        "--refresh-pages-hours)", placeholder="https://", elem_id="knowledge-url", scale=3)
            with gr.Column(scale=1, min_width=160):
                fetch_btn = gr.Button("Fetch and index", elem_id="knowledge-fetch")
                refetch_btn = gr.Button("Fetch all its pages again", size="sm", elem_id="knowledge-refetch")
        knowledge_status = gr.Markdown(elem_id="knowledge-status")
        documents = gr.Dataframe(headers=["document", "chunks", "characters", "updated"], interactive=False,
                                 elem_id="knowledge-documents")
        with gr.Row():
            remove_name = gr.Textbox(label="Document to remove", elem_id="knowledge-remove-name")
            remove_btn = gr.Button("Remove", variant="stop", elem_id="knowledge-remove")
    return SimpleNamespace(**locals())
