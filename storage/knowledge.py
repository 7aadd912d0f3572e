"""An assistant's knowledge: the shop's documents, split into chunks, indexed with SQLite FTS5.

Documents are Markdown, plain text, HTML or PDF (pypdf). Each is read, checked and split in memory
first, then stored in one transaction (its old chunks out, its new ones in), so a bad file never
leaves a document half-indexed and never touches the others. A document whose bytes did not change
is not indexed again.

Chunks follow the document's structure: a section per heading (Markdown `#`, HTML h1-h4), its
paragraphs packed into chunks of at most CHUNK_CHARS characters (a longer paragraph is cut at
sentence ends). The index uses FTS5's `trigram` tokenizer, so Korean and parts of words match, and
ranks by bm25; two-character words outside ASCII (most Korean words, "반품") are matched with
instr() instead, which no trigram index can serve (two-letter English words are stopwords)."""
from __future__ import annotations

import hashlib
import html.parser
import io
import os
import re
import time
from dataclasses import dataclass

CHUNK_CHARS = 700  # ~150-250 tokens: a paragraph or two, a few KV blocks
MAX_FILE_BYTES = 10 << 20
MAX_TEXT_CHARS = 2_000_000
# Words too common to rank by (a trigram index otherwise matches "how" inside "however").
STOPWORDS = frozenset("""the and how can you what when where why does did for are was with your have has this that
our from will would could should please about there they them any not but get got want need just like its into
one yes hello thanks thank take takes long much many know tell""".split())
KINDS = {".md": "markdown", ".markdown": "markdown", ".txt": "text", ".html": "html", ".htm": "html", ".pdf": "pdf"}


class DocumentError(ValueError):
    """A document that cannot be indexed; the message names the file."""


@dataclass
class Chunk:
    id: int
    document: str  # the document's name
    section: str
    text: str
    score: float = 0.0  # relevance: -bm25 (higher is better)
    assistant: str = ""

    @property
    def url(self) -> str:
        """The page that shows this chunk (app.py serves it)."""
        return f"/knowledge/{self.assistant}/{self.id}"


# ---- reading and splitting ------------------------------------------------------------------------
def read_document(name: str, data: bytes) -> list[tuple[str, str]]:
    """A file's bytes -> its (section, text) blocks; DocumentError saying what is wrong with it."""
    kind = KINDS.get(os.path.splitext(name)[1].lower())
    if kind is None:
        raise DocumentError(f"{name}: unknown kind of file; give Markdown, text, HTML or PDF "
                            f"({', '.join(sorted(KINDS))})")
    if len(data) > MAX_FILE_BYTES:
        raise DocumentError(f"{name}: {len(data) >> 20} MiB is over the {MAX_FILE_BYTES >> 20} MiB limit")
    if not data.strip():
        raise DocumentError(f"{name}: the file is empty")
    if kind == "pdf":
        sections = _pdf(name, data)
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
        if tag in ("script", "style", "nav", "footer"):
            self.skip += 1
        elif tag == "a" and re.match(r"(https?|mailto):", dict(attrs).get("href") or "", re.I) and not (self.in_head or self.skip):
            self.link = (len(self.parts), dict(attrs)["href"])  # the text keeps the address: [words](address)
        elif tag in ("h1", "h2", "h3", "h4"):
            self.sections.append((self.head, "".join(self.parts)))
            self.head, self.parts, self.in_head = "", [], True
        elif tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style", "nav", "footer"):
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


# ---- the store ------------------------------------------------------------------------------
class Knowledge:
    def __init__(self, store) -> None:
        self.store = store

    def add(self, assistant: str, name: str, data: bytes) -> str:
        """Index one document (replacing an older one of that name); returns what happened."""
        name = os.path.basename(name)
        digest = hashlib.sha256(data).hexdigest()
        with self.store._db() as db:
            old = list(db["documents"].rows_where("assistant = ? and name = ?", [assistant, name]))
        if old and old[0]["sha256"] == digest:
            return f"{name}: unchanged"
        chunks = split(read_document(name, data))
        now = time.time()
        with self.store._db() as db:  # one transaction: the old chunks out, the new ones in
            if old:
                self._delete(db, old[0]["id"])
            doc_id = db["documents"].insert({"assistant": assistant, "name": name, "sha256": digest,
                                             "chars": sum(len(t) for _, t in chunks), "created": now,
                                             "updated": now}).last_pk
            for i, (section, text) in enumerate(chunks):
                chunk_id = db["chunks"].insert({"document_id": doc_id, "assistant": assistant, "ord": i,
                                                "section": section, "text": text}).last_pk
                db.conn.execute("insert into chunks_fts(rowid, text) values (?, ?)", [chunk_id, f"{section}\n{text}"])
        return f"{name}: {'re-indexed' if old else 'indexed'}, {len(chunks)} chunks"

    def add_folder(self, assistant: str, folder: str) -> list[str]:
        """Every document in a folder (not recursing); one line per file, errors included."""
        if not os.path.isdir(folder):
            raise DocumentError(f"{folder}: not a folder")
        names = sorted(n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n)))
        if not names:
            raise DocumentError(f"{folder}: the folder has no files")
        lines = []
        for n in names:
            try:
                with open(os.path.join(folder, n), "rb") as f:
                    lines.append(self.add(assistant, n, f.read(MAX_FILE_BYTES + 1)))
            except (DocumentError, OSError) as e:
                lines.append(f"❌ {e}" if isinstance(e, DocumentError) else f"❌ {n}: {e}")
        return lines

    def remove(self, assistant: str, name: str) -> bool:
        with self.store._db() as db:
            rows = list(db["documents"].rows_where("assistant = ? and name = ?", [assistant, name]))
            for row in rows:
                self._delete(db, row["id"])
        return bool(rows)

    @staticmethod
    def _delete(db, doc_id: int) -> None:
        db.conn.execute("delete from chunks_fts where rowid in (select id from chunks where document_id = ?)", [doc_id])
        db.conn.execute("delete from chunks where document_id = ?", [doc_id])
        db.conn.execute("delete from documents where id = ?", [doc_id])

    def documents(self, assistant: str) -> list[dict]:
        with self.store._db() as db:
            return list(db.query("select d.name, d.chars, d.updated, count(c.id) as chunks from documents d left join "
                                 "chunks c on c.document_id = d.id where d.assistant = ? group by d.id order by d.name",
                                 [assistant]))

    def texts_with_addresses(self, assistant: str) -> list[str]:
        """The assistant's chunks that may hold a web or e-mail address (ui/links.py reads them)."""
        with self.store._db() as db:
            return [r["text"] for r in db.query(
                "select text from chunks where assistant = ? and (instr(text, '://') or instr(lower(text), 'www.') "
                "or instr(text, '@'))", [assistant])]

    def chunks(self, assistant: str, ids: list[int]) -> list[Chunk]:
        """These chunks of the assistant's, in this order (any that no longer exist left out)."""
        with self.store._db() as db:
            return _chunks(db, assistant, ids)

    def chunk(self, assistant: str, chunk_id: int) -> Chunk | None:
        found = self.chunks(assistant, [chunk_id])
        return found[0] if found else None

    def search(self, assistant: str, query: str, k: int = 3, min_score: float = 0.0) -> list[Chunk]:
        """The k chunks most relevant to `query` (bm25 over trigrams; short words by instr)."""
        words = {w for w in re.findall(r"\w+", query.lower()) if w not in STOPWORDS}
        long = sorted(w for w in words if len(w) >= 3)
        short = sorted(w for w in words if len(w) == 2 and not w.isascii())  # 반품; English pairs are stopwords
        scores: dict[int, float] = {}
        with self.store._db() as db:
            if long:
                match = " OR ".join(f'"{w}"' for w in long)
                for row in db.query("select c.id, bm25(chunks_fts) as rank from chunks_fts join chunks c on "
                                    "c.id = chunks_fts.rowid where chunks_fts match ? and c.assistant = ?",
                                    [match, assistant]):
                    scores[row["id"]] = -row["rank"]  # FTS5's bm25: negative, lower is better
            for w in short:
                for row in db.query("select id from chunks where assistant = ? and instr(lower(section || ' ' || "
                                    "text), ?) > 0", [assistant, w]):
                    scores[row["id"]] = scores.get(row["id"], 0.0) + 1.0
            best = sorted((cid for cid, s in scores.items() if s > min_score), key=lambda c: -scores[c])[:k]
            found = _chunks(db, assistant, best)
        for chunk in found:
            chunk.score = scores[chunk.id]
        return found


def _chunks(db, assistant: str, ids: list[int]) -> list[Chunk]:
    """These chunks of the assistant's, in the order of `ids` (missing ones left out)."""
    rows = {r["id"]: r for r in db.query(
        f"select c.id, d.name, c.section, c.text from chunks c join documents d on d.id = c.document_id "
        f"where c.assistant = ? and c.id in ({', '.join('?' * len(ids))})", [assistant, *ids])} if ids else {}
    return [Chunk(i, rows[i]["name"], rows[i]["section"], rows[i]["text"], assistant=assistant) for i in ids if i in rows]
