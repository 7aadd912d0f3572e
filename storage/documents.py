"""The shop's documents as text: Markdown, plain text, HTML, PDF (pypdf) or Word (.docx), read and
checked in memory, then split by their structure: a section per heading (Markdown `#`, HTML h1-h4,
Word's heading styles), its paragraphs packed into chunks of at most CHUNK_CHARS characters (a
longer paragraph is cut at sentence ends). Links keep their address in the text, as [words](address),
so the model can cite them (ui/links.py lets the customer chat link to them). storage/knowledge.py
indexes what this returns."""
from __future__ import annotations

import html.parser
import io
import ipaddress
import os
import re
import socket
import urllib.error
import urllib.request
import zipfile
from urllib.parse import urlsplit
from xml.etree import ElementTree

CHUNK_CHARS = 700  # ~150-250 tokens: a paragraph or two, a few KV blocks
MAX_FILE_BYTES = 10 << 20
MAX_TEXT_CHARS = 2_000_000
KINDS = {".md": "markdown", ".markdown": "markdown", ".txt": "text", ".html": "html", ".htm": "html", ".pdf": "pdf",
         ".docx": "docx"}
MAX_XML_BYTES = 64 << 20  # a .docx's document.xml, unpacked: a zip bomb stops here
WORD = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
RELATION = "{http://schemas.openxmlformats.org/officeDocument/2006/relationships}"


# A fetched page's kind by its Content-Type, as the extension its name takes
MIME_KINDS = {"text/html": ".html", "application/xhtml+xml": ".html", "text/plain": ".txt", "text/markdown": ".md",
              "application/pdf": ".pdf",
              "application/vnd.openxmlformats-officedocument.wordprocessingml.document": ".docx"}
FETCH_TIMEOUT_S = 15.0


class DocumentError(ValueError):
    """A document that cannot be indexed; the message names the file."""


def read_document(name: str, data: bytes) -> list[tuple[str, str]]:
    """A file's bytes -> its (section, text) blocks; DocumentError saying what is wrong with it."""
    kind = KINDS.get(os.path.splitext(name)[1].lower())
    if kind is None:
        raise DocumentError(f"{name}: unknown kind of file; give Markdown, text, HTML, PDF or Word "
                            f"({', '.join(sorted(KINDS))})")
    if len(data) > MAX_FILE_BYTES:
        raise DocumentError(f"{name}: {len(data) >> 20} MiB is over the {MAX_FILE_BYTES >> 20} MiB limit")
    if not data.strip():
        raise DocumentError(f"{name}: the file is empty")
    if kind == "pdf":
        sections = _pdf(name, data)
    elif kind == "docx":
        sections = _docx(name, data)
    else:
        text = _decode(name, data)
        sections = _html(text) if kind == "html" else _markdown(text)
    sections = [(head, body.strip()) for head, body in sections if body.strip()]
    total = sum(len(body) for _, body in sections)
    if not total:
        raise DocumentError(f"{name}: no text in it")
    if total > MAX_TEXT_CHARS:
        raise DocumentError(f"{name}: {total} characters of text, over the {MAX_TEXT_CHARS} limit")
    return sections


def _decode(name: str, data: bytes) -> str:
    if b"\x00" in data[:8192] and not data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise DocumentError(f"{name}: this is a binary file, not text (renamed?)")
    for encoding in ("utf-8-sig", "utf-16"):
        try:
            if encoding == "utf-16" and not data.startswith((b"\xff\xfe", b"\xfe\xff")):
                continue
            return data.decode(encoding)
        except UnicodeDecodeError:
            continue
    raise DocumentError(f"{name}: not UTF-8 text (an unknown encoding); save it as UTF-8 and upload it again")


def _markdown(text: str) -> list[tuple[str, str]]:
    sections, head, lines = [], "", []
    for line in text.splitlines():
        m = re.match(r"\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            sections.append((head, "\n".join(lines)))
            head, lines = m.group(2), []
        else:
            lines.append(line)
    sections.append((head, "\n".join(lines)))
    return sections


class _HTMLText(html.parser.HTMLParser):
    BLOCKS = {"p", "div", "li", "br", "tr", "section", "article", "table", "ul", "ol"}

    def __init__(self) -> None:
        super().__init__()
        self.sections, self.head, self.parts, self.in_head, self.skip = [], "", [], False, 0
        self.link: tuple[int, str] | None = None  # an open <a href>: where its words start, its address

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style", "nav", "footer", "title"):
            self.skip += 1
        elif tag == "a" and re.match(r"(https?|mailto):", dict(attrs).get("href") or "", re.I) and not (self.in_head or self.skip):
            self.link = (len(self.parts), dict(attrs)["href"])  # the text keeps the address: [words](address)
        elif tag in ("h1", "h2", "h3", "h4"):
            self.sections.append((self.head, "".join(self.parts)))
            self.head, self.parts, self.in_head = "", [], True
        elif tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style", "nav", "footer", "title"):
            self.skip = max(0, self.skip - 1)
        elif tag == "a" and self.link:
            (start, href), self.link = self.link, None
            words = "".join(self.parts[start:]).strip()
            self.parts[start:] = [f"[{words}]({href})" if words else href]
        elif tag in ("h1", "h2", "h3", "h4"):
            self.in_head = False

    def handle_data(self, data):
        if self.skip:
            return
        if self.in_head:
            self.head += data.strip()
        else:
            self.parts.append(data)


def _html(text: str) -> list[tuple[str, str]]:
    parser = _HTMLText()
    parser.feed(text)
    parser.close()
    return parser.sections + [(parser.head, "".join(parser.parts))]


def _pdf(name: str, data: bytes) -> list[tuple[str, str]]:
    import pypdf

    try:
        reader = pypdf.PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            raise DocumentError(f"{name}: the PDF is encrypted; upload an unprotected copy")
        return [(f"page {i}", page.extract_text() or "") for i, page in enumerate(reader.pages, 1)]
    except DocumentError:
        raise
    except Exception as e:  # noqa: BLE001 - pypdf raises many kinds for a broken file; all say the same to us
        raise DocumentError(f"{name}: not a readable PDF ({type(e).__name__}: {e})") from None


def _docx(name: str, data: bytes) -> list[tuple[str, str]]:
    """A Word document's paragraphs (tables' included) in order, a section per heading-styled one."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            if z.getinfo("word/document.xml").file_size > MAX_XML_BYTES:
                raise DocumentError(f"{name}: its text unpacks to over {MAX_XML_BYTES >> 20} MiB")
            body = ElementTree.fromstring(z.read("word/document.xml"))
            rels, styles = "word/_rels/document.xml.rels", "word/styles.xml"
            links = {r.get("Id"): r.get("Target") for r in ElementTree.fromstring(z.read(rels))
                     if r.get("TargetMode") == "External"} if rels in z.namelist() else {}
            names = {st.get(f"{WORD}styleId"): st.find(f"{WORD}name").get(f"{WORD}val", "")  # Korean Word: "1" -> "heading 1"
                     for st in ElementTree.fromstring(z.read(styles)).iter(f"{WORD}style")
                     if st.find(f"{WORD}name") is not None} if styles in z.namelist() else {}
    except DocumentError:
        raise
    except (zipfile.BadZipFile, KeyError, ElementTree.ParseError, OSError) as e:
        raise DocumentError(f"{name}: not a readable Word document ({type(e).__name__}: {e}); save it as .docx "
                            "again, or as PDF") from None
    sections, head, lines = [], "", []
    for paragraph in body.iter(f"{WORD}p"):
        style = paragraph.find(f"{WORD}pPr/{WORD}pStyle")
        style = "" if style is None else style.get(f"{WORD}val", "")
        text = _docx_text(paragraph, links).strip()
        if re.match(r"(heading|title)", names.get(style, style), re.I) and text:
            sections.append((head, "\n\n".join(lines)))
            head, lines = text, []
        elif text:
            lines.append(text)
    return sections + [(head, "\n\n".join(lines))]


def _docx_text(element, links: dict[str, str]) -> str:
    """A paragraph's text (runs, tracked insertions, fields; not the paragraphs of a text box inside it,
    which come on their own); a hyperlink to an address as [words](address)."""
    parts = []
    for child in element:
        if child.tag == f"{WORD}hyperlink":
            words = _docx_text(child, links)
            target = links.get(child.get(f"{RELATION}id"))
            parts.append(f"[{words}]({target})" if target and words.strip() else words)
        elif child.tag == f"{WORD}t":
            parts.append(child.text or "")
        elif child.tag in (f"{WORD}tab", f"{WORD}br"):
            parts.append(" ")
        elif child.tag != f"{WORD}p":
            parts.append(_docx_text(child, links))
    return "".join(parts)


def split(sections: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(section, text) blocks -> (section, chunk text), each chunk at most CHUNK_CHARS."""
    chunks = []
    for head, body in sections:
        paragraphs = [re.sub(r"[ \t]+", " ", p).strip() for p in re.split(r"\n\s*\n", body)]
        current = ""
        for piece in (s for p in paragraphs if p for s in _pieces(p)):
            if current and len(current) + 2 + len(piece) > CHUNK_CHARS:
                chunks.append((head, current))
                current = ""
            current = f"{current}\n\n{piece}" if current else piece
        if current:
            chunks.append((head, current))
    return chunks


def _pieces(paragraph: str) -> list[str]:
    if len(paragraph) <= CHUNK_CHARS:
        return [paragraph]
    sentences, out, current = re.split(r"(?<=[.!?。])\s+", paragraph), [], ""
    for s in sentences:
        while len(s) > CHUNK_CHARS:  # one sentence longer than a chunk: cut it
            out.append(s[:CHUNK_CHARS])
            s = s[CHUNK_CHARS:]
        if current and len(current) + 1 + len(s) > CHUNK_CHARS:
            out.append(current)
            current = ""
        current = f"{current} {s}" if current else s
    return out + ([current] if current else [])


# ---- a page of the shop's site, by its address ----------------------------------------------------
def fetch(url: str) -> tuple[str, bytes]:
    """The document at an http(s) address -> (its name, its bytes as read_document takes them: text in
    UTF-8), or DocumentError saying what went wrong. The name is the address without its scheme,
    query and fragment, ending in its kind's extension (a page: .html), so fetching it again replaces
    it. Link-local addresses (a cloud's metadata service) are refused, after a redirect too; bounded
    by FETCH_TIMEOUT_S and MAX_FILE_BYTES."""
    url = (url or "").strip()
    _check_address(url)
    request = urllib.request.Request(url, headers={"User-Agent": "pagedchat-knowledge/1"})
    try:
        with urllib.request.build_opener(_CheckedRedirects).open(request, timeout=FETCH_TIMEOUT_S) as r:
            data = r.read(MAX_FILE_BYTES + 1)
            kind, charset, final = r.headers.get_content_type(), r.headers.get_content_charset(), r.geturl()
    except urllib.error.HTTPError as e:
        raise DocumentError(f"{url}: the server answered {e.code} {e.reason}") from None
    except DocumentError:
        raise
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise DocumentError(f"{url}: could not be fetched ({getattr(e, 'reason', e)})") from None
    ext = MIME_KINDS.get(kind)
    if ext is None:
        raise DocumentError(f"{url}: the address gives {kind}, not a document (HTML, text, Markdown, PDF or Word)")
    if len(data) > MAX_FILE_BYTES:
        raise DocumentError(f"{url}: over the {MAX_FILE_BYTES >> 20} MiB limit")
    if charset and ext in (".html", ".txt", ".md") and charset.lower().replace("_", "-") not in ("utf-8", "utf8"):
        try:
            data = data.decode(charset).encode("utf-8")
        except (LookupError, UnicodeDecodeError):
            raise DocumentError(f"{url}: its text is not {charset}, as the server says it is") from None
    page = urlsplit(final)
    name = f"{page.hostname}{page.path}".rstrip("/")
    return (name if name.lower().endswith(ext) else name + ext), data


def _check_address(url: str) -> None:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        parts, port = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise DocumentError(f"{url or 'the address'}: give an http:// or https:// address")
    try:
        addresses = {info[4][0].split("%")[0] for info in socket.getaddrinfo(parts.hostname, port or 80)}
    except (socket.gaierror, UnicodeError) as e:
        raise DocumentError(f"{url}: {parts.hostname} could not be found ({e})") from None
    if any(ipaddress.ip_address(a).is_link_local for a in addresses):
        raise DocumentError(f"{url}: {parts.hostname} is a link-local address (a cloud's metadata service): refused")


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        _check_address(newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)
