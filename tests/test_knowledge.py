"""Fast tier: knowledge. Documents of every kind are read, split and indexed (FTS5 trigram: Korean
and parts of words match); bad files are refused naming the file, one transaction per document;
the prompt layout puts each chunk on a KV block boundary, in canonical order, spliced in the same
way on every turn; a turn stores its sources and the next turn continues token for token."""
import asyncio
import io
import zipfile
from types import SimpleNamespace

import pypdf
import pytest

from storage import Store
from storage.documents import CHUNK_CHARS, DocumentError, read_document, split
from storage.knowledge import Knowledge
from tests.fakes import FakeEngineClient
from tests.pdfs import pdf
from ui.grounding import ground
from ui.handlers import ChatHandlers

RETURNS = """# Returns

Unused items can be returned within thirty days of delivery for a full refund.

## Refunds

Refunds go back to the original payment method within five to seven business days after the return arrives.

# 반품

반품은 배송 후 30일 이내에 가능합니다. 환불은 영업일 기준 5~7일 걸립니다.
""".encode()
SHIPPING = b"<html><head><title>Shipping | Northwind</title></head><body><nav>menu</nav><h1>Shipping</h1><p>Orders ship within two business days.</p>" \
           b"<h2>Express</h2><p>Express delivery takes one to two business days and costs fifteen dollars.</p>" \
           b"<script>alert(1)</script></body></html>"


@pytest.fixture
def kb(tmp_path):
    store = Store(str(tmp_path / "k.db"))
    return Knowledge(store)


def test_each_kind_is_read_by_its_structure():
    assert [h for h, _ in read_document("r.md", RETURNS)] == ["Returns", "Refunds", "반품"]
    html = read_document("s.html", SHIPPING)
    assert [h for h, _ in html] == ["Shipping", "Express"] and "alert" not in str(html) and "menu" not in str(html)
    assert "Northwind" not in str(html)  # the <title> is no text of the page
    assert "two years" in read_document("w.pdf", pdf(["Warranty: two years on tents."]))[0][1]
    assert read_document("n.txt", "plain words\n\nmore".encode("utf-16"))[0][1].startswith("plain")


W = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main" ' \
    'xmlns:r="http://schemas.openxmlformats.org/officeDocument/2006/relationships"'


def docx(body: str, links: dict[str, str] | None = None) -> bytes:
    """A Word document: `body` as w:body's XML, `links` relationship id -> external address; its
    styles as Korean Word names them (style "1" is "heading 1")."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("[Content_Types].xml", "<Types/>")
        z.writestr("word/styles.xml", f'<w:styles {W}><w:style w:type="paragraph" w:styleId="1"><w:name '
                   'w:val="heading 1"/></w:style><w:style w:type="paragraph" w:styleId="a"><w:name w:val="Normal"/>'
                   '</w:style></w:styles>')
        z.writestr("word/document.xml", f"<w:document {W}><w:body>{body}</w:body></w:document>")
        rels = "".join(f'<Relationship Id="{i}" Type="hyperlink" Target="{t}" TargetMode="External"/>'
                       for i, t in (links or {}).items())
        z.writestr("word/_rels/document.xml.rels", '<Relationships xmlns="http://schemas.openxmlformats.org/'
                   f'package/2006/relationships">{rels}</Relationships>')
    return out.getvalue()


def para(text: str, style: str = "") -> str:
    pr = f'<w:pPr><w:pStyle w:val="{style}"/></w:pPr>' if style else ""
    return f"<w:p>{pr}<w:r><w:t xml:space='preserve'>{text}</w:t></w:r></w:p>"


POLICY_DOCX = docx(
    para("Returns", "Heading1") + "<w:p><w:r><w:t xml:space='preserve'>Start a return on </w:t></w:r>"
    "<w:hyperlink r:id='rId5'><w:r><w:t>our returns page</w:t></w:r></w:hyperlink><w:r><w:t>.</w:t></w:r></w:p>"
    "<w:tbl><w:tr><w:tc>" + para("Tents") + "</w:tc><w:tc>" + para("thirty days") + "</w:tc></w:tr></w:tbl>"
    + para("환불", "1") + para("Body text", "a") + "<w:p><w:ins><w:r><w:t>환불은 영업일 기준 5~7일 걸립니다.</w:t></w:r></w:ins></w:p>",
    {"rId5": "https://northwind.example/returns"})


def test_a_word_document_is_read_by_its_headings_with_its_tables_and_links(kb):
    sections = read_document("policy.docx", POLICY_DOCX)
    assert [h for h, _ in sections] == ["Returns", "환불"]
    returns = sections[0][1]
    assert "Start a return on [our returns page](https://northwind.example/returns)." in returns
    assert "Tents" in returns and "thirty days" in returns  # a table's cells
    assert "5~7일" in sections[1][1] and "Body text" in sections[1][1]  # a tracked insertion is text too
    assert kb.add("support", "policy.docx", POLICY_DOCX).endswith("2 chunks")
    assert kb.search("support", "환불")[0].section == "환불"


def test_a_word_document_that_unpacks_too_large_is_refused(kb, monkeypatch):
    from storage import documents

    monkeypatch.setattr(documents, "MAX_XML_BYTES", 200)
    with pytest.raises(DocumentError, match="big.docx: its text unpacks to over"):
        kb.add("support", "big.docx", docx(para("x" * 300)))


def test_long_sections_split_into_bounded_chunks():
    body = " ".join(f"Sentence number {i} about tents and their poles." for i in range(200))
    chunks = split([("Tents", body), ("Short", "One line.")])
    assert len(chunks) > 5 and all(len(t) <= CHUNK_CHARS for _, t in chunks)
    assert chunks[-1] == ("Short", "One line.") and " ".join(t for _, t in chunks[:-1]) == body


def encrypted_pdf() -> bytes:
    writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(io.BytesIO(pdf(["secret"]))))
    writer.encrypt("pw")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


@pytest.mark.parametrize("name, data, says", [
    ("locked.pdf", encrypted_pdf(), "encrypted"),
    ("broken.pdf", b"%PDF-1.4 nothing else", "not a readable PDF"),
    ("photo.md", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(200), "binary"),
    ("latin.txt", "Réglement: retours sous trente jours".encode("cp1252"), "not UTF-8"),
    ("empty.md", b"  \n\n", "empty"),
    ("huge.txt", b"a" * (10 << 20) + b"a", "limit"),
    ("sheet.xlsx", b"PK\x03\x04", "unknown kind"),
    ("broken.docx", b"PK\x03\x04 not really a zip", "not a readable Word document"),
    ("renamed.docx", pdf(["a PDF renamed"]), "not a readable Word document"),
    ("bad-xml.docx", docx("<w:p>unclosed"), "not a readable Word document"),
    ("no-text.docx", docx(para("")), "no text"),
])
def test_a_bad_file_is_refused_naming_it_and_nothing_else_changes(kb, name, data, says):
    kb.add("support", "returns.md", RETURNS)
    before = kb.documents("support")
    with pytest.raises(DocumentError) as e:
        kb.add("support", name, data)
    assert name in str(e.value) and says in str(e.value)
    assert kb.documents("support") == before and kb.search("support", "refund")


def test_a_changed_document_is_indexed_again_and_an_unchanged_one_is_not(kb):
    assert kb.add("support", "returns.md", RETURNS).endswith("3 chunks")
    assert kb.add("support", "returns.md", RETURNS) == "returns.md: unchanged"
    assert "re-indexed" in kb.add("support", "returns.md", b"# Returns\n\nNo returns on sale items.")
    assert kb.search("support", "sale items")[0].text == "No returns on sale items."
    assert not kb.search("support", "thirty days")  # the old chunks are gone from the index too
    assert kb.remove("support", "returns.md") and not kb.search("support", "sale items")


def test_search_ranks_and_matches_korean_and_parts_of_words(kb):
    kb.add("support", "returns.md", RETURNS)
    kb.add("support", "shipping.html", SHIPPING)
    kb.add("other", "secret.md", b"# Refunds\n\nOther shop refunds in one day.")
    assert kb.search("support", "How long do refunds take?")[0].section == "Refunds"
    assert kb.search("support", "반품 가능한가요?")[0].section == "반품"  # a two-syllable word
    assert kb.search("support", "express deliv")[0].section == "Express"  # part of a word
    assert all(c.document != "secret.md" for c in kb.search("support", "refunds one day", k=8))
    assert kb.search("support", "refunds", min_score=1e9) == []


def test_a_folder_indexes_what_it_can_and_names_what_it_cannot(kb, tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "returns.md").write_bytes(RETURNS)
    (folder / "bad.md").write_bytes(bytes(100))
    lines = kb.add_folder("support", str(folder))
    assert any("bad.md" in line and line.startswith("❌") for line in lines)
    assert [d["name"] for d in kb.documents("support")] == ["returns.md"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(DocumentError, match="no files"):
        kb.add_folder("support", str(tmp_path / "empty"))


def test_chunks_start_on_block_boundaries_in_canonical_order(kb, smol_tokenizer):
    kb.add("support", "returns.md", RETURNS)
    kb.add("support", "shipping.html", SHIPPING)
    chunks = kb.search("support", "refund express 반품", k=4)
    for block_size in (16, 32):
        g = ground(smol_tokenizer, "You are Sam.", chunks, block_size)
        assert [c.id for c in g.chunks] == sorted(c.id for c in chunks)  # whatever the ranking said
        assert all(start % block_size == 0 for start, _ in g.spans)
        assert (g.head_len + len(g.ids)) % block_size == 0  # the conversation starts on its own block
        text = smol_tokenizer.apply_chat_template([{"role": "system", "content": "You are Sam." + g.text},
                                                   {"role": "user", "content": "hi"}], tokenize=False)
        ids = g.encode(smol_tokenizer, text)
        assert smol_tokenizer.decode(ids) == text
        for (start, end), chunk in zip(g.spans, g.chunks):
            assert chunk.text.splitlines()[0] in smol_tokenizer.decode(ids[start:end])
    plain = ground(smol_tokenizer, "You are Sam.", chunks, 16, align=False)
    assert len(plain.ids) < len(g.ids) and plain.text.replace("\n", "") == g.text.replace("\n", "")


def tab(name="cara"):
    return SimpleNamespace(username=name, session_hash=f"tab-{name}")


def test_a_turn_carries_its_sources_and_the_next_turn_continues_token_for_token(tmp_path, smol_tokenizer):
    fake = FakeEngineClient(smol_tokenizer, max_model_len=4096)
    chat = ChatHandlers(fake, Store(str(tmp_path / "c.db")), demo=False)
    chat.knowledge.add("support", "returns.md", RETURNS)

    def send(who, text):
        async def run():
            uid, sid = chat.current(None, None, tab(who))
            return uid, sid, [u async for u in chat.send(uid, sid, text, request=tab(who))]
        return asyncio.run(run())

    uid, sid, updates = send("cara", "How long do refunds take?")
    first = fake.requests[-1]["prompt"]
    assert "original payment method" in smol_tokenizer.decode(first)
    reply = chat.store.messages(uid, sid)[-1]
    assert reply["sources"][0]["document"] == "returns.md" and reply["sources"][0]["section"] == "Refunds"
    shown = updates[-1][0][-1]["content"]
    assert "returns.md › Refunds" in shown and f"/knowledge/support/{reply['sources'][0]['id']}" in shown
    send("cara", "Refunds to my card?")  # the same chunks: the prompt goes on from the last one
    assert fake.requests[-1]["prompt"][:len(first) + len(reply["token_ids"])] == first + reply["token_ids"]
    send("dana", "refunds: how many days?")  # another customer citing the same chunk: the same leading blocks
    other = fake.requests[-1]["prompt"]
    knowledge_end = max(s for s in range(0, len(first), 16) if first[:s] == other[:s])
    assert "original payment method" in smol_tokenizer.decode(first[:knowledge_end])


def test_a_korean_word_is_found_without_its_particle_or_ending(kb):
    kb.add("support", "배송.md", "# 해외 배송\n\n캐나다 배송은 5일 걸립니다.\n\n# 교환\n\n사이즈 교환은 무료입니다.".encode())
    assert kb.search("support", "캐나다로 보내 주나요?")[0].section == "해외 배송"  # 캐나다로 -> 캐나다
    assert kb.search("support", "사이즈를 교환하고 싶어요")[0].section == "교환"  # 사이즈를, 교환하고
    assert kb.search("support", "캐나다로")[0].section == "해외 배송"


def test_the_shipped_documents_index_cleanly(kb):
    from bench.knowledge import FOLDER

    lines = kb.add_folder("support", FOLDER)
    assert lines and not any(line.startswith("❌") for line in lines)
    assert kb.search("support", "환불")[0].document == "반품-안내.md"


def test_knowledge_flag_with_a_missing_folder_stops_the_app_with_a_clear_message(tmp_path):
    from app import build_app, parse_args

    args = parse_args(["--db", str(tmp_path / "a.db"), "--knowledge", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match="--knowledge: .*nowhere: not a folder"):
        build_app(args)


def test_the_panel_marks_the_blocks_that_hold_knowledge(kb, smol_tokenizer):
    from engine.client import BlockState
    from ui.grounding import KNOWLEDGE_BLOCKS, mark
    from ui.panel import page_map_html

    kb.add("support", "returns.md", RETURNS)
    g = ground(smol_tokenizer, "You are Sam.", kb.search("support", "refunds"), 16)
    mark("chat-1", g, 16)
    blocks = g.head_len // 16 + len(g.ids) // 16 + 2
    stats = {"block_size": 16, "num_running": 1, "num_waiting": 0, "num_preemptions": 0, "prefix_cache_hits": 0,
             "prefix_cache_queries": 0, "generation_tokens_total": 0}
    snap = {"block_states": bytes([BlockState.USED] * blocks), "block_owners": {i: "chat-1" for i in range(blocks)},
            "block_positions": {i: i for i in range(blocks)}, "stats": stats}
    html = page_map_html(snap)
    marked = html.count(", knowledge'")
    assert marked == len(KNOWLEDGE_BLOCKS["chat-1"]) >= 2 and f"<b id='kv-knowledge'>{marked}</b>" in html
    mark("chat-1", None, 16)
    assert ", knowledge'" not in page_map_html(snap)


def test_the_console_uploads_documents_for_operators_only(tmp_path, smol_tokenizer):
    import gradio as gr

    from ui.console import AssistantEditor
    from ui.operator import OperatorHandlers

    fake = FakeEngineClient(smol_tokenizer)
    chat = ChatHandlers(fake, Store(str(tmp_path / "c.db")), demo=False)
    editor = AssistantEditor(chat.store, OperatorHandlers(fake, chat.store, {"m": None}, None, {"olga"}))
    good, locked = tmp_path / "returns.md", tmp_path / "locked.pdf"
    good.write_bytes(RETURNS)
    locked.write_bytes(encrypted_pdf())
    status, table = editor.upload("support", [str(good), str(locked)], tab("olga"))
    assert "✅ returns.md: indexed, 3 chunks" in status and "❌ locked.pdf: the PDF is encrypted" in status
    assert [row[0] for row in table] == ["returns.md"]
    assert editor.show("support", tab("olga"))[15] == table
    with pytest.raises(gr.Error):
        editor.upload("support", [str(good)], tab("cara"))
    status, table = editor.remove("support", "returns.md", tab("olga"))
    assert table == [] and not chat.knowledge.search("support", "refunds")


def test_exports_and_the_review_carry_the_sources(tmp_path, smol_tokenizer):
    import json

    fake = FakeEngineClient(smol_tokenizer, max_model_len=4096)
    chat = ChatHandlers(fake, Store(str(tmp_path / "c.db")), demo=False)
    chat.knowledge.add("support", "returns.md", RETURNS)

    async def run():
        uid, sid = chat.current(None, None, tab())
        return uid, sid, [u async for u in chat.send(uid, sid, "How long do refunds take?", request=tab())]
    uid, sid, _ = asyncio.run(run())
    exported = json.load(open(chat.export(uid, sid, "json", tab())))
    assert exported["messages"][-1]["sources"][0]["section"] == "Refunds"
    assert "Sources: returns.md › Refunds" in open(chat.export(uid, sid, "md", tab())).read()
    chat.rate(uid, sid, SimpleNamespace(index=1, liked=False), tab())
    assert chat.store.rated_replies()[0]["conversation"][-1]["sources"][0]["document"] == "returns.md"


@pytest.fixture(scope="module")
def site():
    """The shop's site on 127.0.0.1: a Latin-1 page with a link, a redirect to it, a PDF, an image,
    a missing page, and a redirect to a cloud's metadata address."""
    from tests.serving import local_site

    pages = {"/help/returns": ("text/html; charset=iso-8859-1", "<h1>Retours</h1><p>Réglement: trente jours. See "
                               "<a href='https://northwind.example/returns'>the form</a>.</p>".encode("latin-1")),
             "/policy.pdf": ("application/pdf", pdf(["Warranty: two years on tents."])),
             "/logo.png": ("image/png", b"\x89PNG\r\n\x1a\n")}
    moves = {"/old-returns": "/help/returns", "/metadata": "http://169.254.169.254/latest/meta-data/"}

    def answer(request):
        if request.path in moves:
            request.send_response(302)
            request.send_header("Location", moves[request.path])
            request.end_headers()
            return
        kind, body = pages.get(request.path, ("text/plain", None))
        request.send_response(200 if body is not None else 404)
        request.send_header("Content-Type", kind)
        request.end_headers()
        request.wfile.write(body or b"not here")
    with local_site(answer) as url:
        yield url


def test_a_page_of_the_shops_site_is_fetched_and_indexed_by_its_address(site, tmp_path, smol_tokenizer):
    import gradio as gr

    from storage.documents import fetch
    from ui.console import AssistantEditor
    from ui.operator import OperatorHandlers

    store = Store(str(tmp_path / "c.db"))
    ChatHandlers(FakeEngineClient(smol_tokenizer), store, demo=False)  # the default assistant
    editor = AssistantEditor(store, OperatorHandlers(FakeEngineClient(smol_tokenizer), store, {"m": None}, None,
                                                     {"olga"}))
    status, table = editor.add_page("support", f"{site}/old-returns", tab("olga"))  # redirected to the page
    assert status == "✅ 127.0.0.1/help/returns.html: indexed, 1 chunks" and table[0][0] == "127.0.0.1/help/returns.html"
    chunk = editor.knowledge.search("support", "réglement")[0]
    assert chunk.section == "Retours" and "[the form](https://northwind.example/returns)" in chunk.text
    from app import knowledge_page
    shown = knowledge_page(store)("support", chunk.id).body.decode()  # the excerpt a reply's source opens
    assert "<a href='https://northwind.example/returns' rel='noopener'>the form</a>" in shown and "Réglement" in shown
    assert editor.add_page("support", f"{site}/help/returns", tab("olga"))[0].endswith("unchanged")
    assert fetch(f"{site}/policy.pdf")[0] == "127.0.0.1/policy.pdf"
    for address, says in ((f"{site}/logo.png", "gives image/png, not a document"), (f"{site}/gone", "answered 404"),
                          (f"{site}/metadata", "link-local"), ("http://169.254.169.254/latest/", "link-local"),
                          ("file:///etc/passwd", "give an http:// or https:// address"), ("", "give an http"),
                          ("http://[::1", "give an http"), ("http://no-such-host.invalid/", "could not be found")):
        status, _ = editor.add_page("support", address, tab("olga"))
        assert status.startswith("❌") and says in status, (address, status)
    assert [row[0] for row in editor.documents("support")] == ["127.0.0.1/help/returns.html"]  # nothing else changed
    with pytest.raises(gr.Error):
        editor.add_page("support", f"{site}/policy.pdf", tab("cara"))


def test_fetched_pages_are_fetched_again_and_follow_the_site(tmp_path, smol_tokenizer):
    """The shop changes a page: fetching its pages again (the console's button, --refresh-pages-hours)
    indexes the new text; a page that cannot be fetched now keeps its last text; uploaded files stay."""
    from tests.serving import local_site
    from ui.console import AssistantEditor
    from ui.operator import OperatorHandlers

    served = {"/hours": b"<h1>Hours</h1><p>We open at nine.</p>", "/ship": b"<h1>Shipping</h1><p>Five days.</p>"}
    asked = []

    def answer(request):
        asked.append(request.path)
        body = served.get(request.path.partition("?")[0])
        request.send_response(200 if body else 404)
        request.send_header("Content-Type", "text/html; charset=utf-8")
        request.end_headers()
        request.wfile.write(body or b"gone")
    store = Store(str(tmp_path / "c.db"))
    ChatHandlers(FakeEngineClient(smol_tokenizer), store, demo=False)
    editor = AssistantEditor(store, OperatorHandlers(FakeEngineClient(smol_tokenizer), store, {"m": None}, None,
                                                     {"olga"}))
    knowledge = editor.knowledge
    knowledge.add("support", "faq.md", b"# FAQ\nTents are green.")
    with local_site(answer) as site:
        for path in ("/hours", "/ship"):
            assert editor.add_page("support", f"{site}{path}?lang=en", tab("olga"))[0].startswith("✅")
        served["/hours"] = b"<h1>Hours</h1><p>We open at ten from Monday.</p>"
        del served["/ship"]
        status, table = editor.refresh_pages("support", tab("olga"))
        lines = status.splitlines()
        assert lines[0] == "- support: 127.0.0.1/hours.html: re-indexed, 1 chunks"
        assert asked[-2:] == ["/hours?lang=en", "/ship?lang=en"]  # fetched again by its whole address
        assert lines[1].startswith("- ❌ support:") and "404" in lines[1] and "its last text stays" in lines[1]
        assert len(lines) == 2 and sorted(row[0] for row in table) == ["127.0.0.1/hours.html", "127.0.0.1/ship.html",
                                                                        "faq.md"]
        assert "ten from Monday" in knowledge.search("support", "open Monday")[0].text
        assert knowledge.search("support", "Five days")  # the page that failed keeps its last text
        served["/ship"] = b"<h1>Shipping</h1><p>Five days.</p>"
        assert knowledge.refresh_pages() == ["support: 127.0.0.1/hours.html: unchanged",
                                             "support: 127.0.0.1/ship.html: unchanged"]  # every assistant's
    import gradio as gr

    with pytest.raises(gr.Error):
        editor.refresh_pages("support", tab("cara"))
