"""An assistant's knowledge: the shop's documents, split into chunks, indexed with SQLite FTS5.

Documents are read, checked and split in memory first (storage/documents.py), then stored in one
transaction (its old chunks out, its new ones in), so a bad file never leaves a document
half-indexed and never touches the others. A document whose bytes did not change is not indexed
again. The index uses FTS5's `trigram` tokenizer, so Korean and parts of words match, and ranks by
bm25; two-character words outside ASCII (most Korean words, "반품") are matched with
instr() instead, which no trigram index can serve (two-letter English words are stopwords), and a
Korean word is searched without its particle or ending too (stem())."""
from __future__ import annotations

import hashlib
import os
import re
import time
from dataclasses import dataclass

from storage.documents import MAX_FILE_BYTES, DocumentError, fetch, read_document, split

# Words too common to rank by (a trigram index otherwise matches "how" inside "however").
STOPWORDS = frozenset("""the and how can you what when where why does did for are was with your have has this that
our from will would could should please about there they them any not but get got want need just like its into
one yes hello thanks thank take takes long much many know tell""".split())


# What follows a Korean noun (particles) or verb stem (endings), longest first: a Korean word is also
# searched without one ("캐나다로" finds "캐나다", "환불되나요" finds "환불").
KOREAN_SUFFIXES = ("에서는", "으로는", "되나요", "하나요", "인가요", "할까요", "될까요", "합니다", "됩니다", "습니까",
                   "으로", "에서", "에게", "까지", "부터", "보다", "처럼", "이나", "하고", "해요", "돼요", "나요",
                   "은", "는", "이", "가", "을", "를", "에", "의", "도", "로", "와", "과", "만")


def stem(word: str) -> str | None:
    """A Korean word without its particle or ending (at least two syllables left), else None."""
    if word.isascii():
        return None
    return next((word[:-len(s)] for s in KOREAN_SUFFIXES if word.endswith(s) and len(word) - len(s) >= 2), None)


def terms(text: str) -> set[str]:
    """The words a query searches for: each as written, and a Korean one also as stem() cuts it."""
    words = {w for w in re.findall(r"\w+", text.lower()) if w not in STOPWORDS}
    return words | {s for w in words if (s := stem(w))}


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


# ---- the store ------------------------------------------------------------------------------
class Knowledge:
    def __init__(self, store) -> None:
        self.store = store

    def add(self, assistant: str, name: str, data: bytes, source: str | None = None) -> str:
        """Index one document (replacing an older one of that name: a file's name, or a fetched page's
        address as documents.fetch names it; `source`: the address it was fetched from, which
        refresh_pages fetches again); returns what happened."""
        digest = hashlib.sha256(data).hexdigest()
        with self.store._db() as db:
            old = list(db["documents"].rows_where("assistant = ? and name = ?", [assistant, name]))
        if old and old[0]["sha256"] == digest:
            if source and old[0].get("source") != source:
                with self.store._db() as db:
                    db.execute("update documents set source = ? where id = ?", [source, old[0]["id"]])
            return f"{name}: unchanged"
        chunks = split(read_document(name, data))
        now = time.time()
        with self.store._db() as db:  # one transaction: the old chunks out, the new ones in
            if old:
                self._delete(db, old[0]["id"])
            doc_id = db["documents"].insert({"assistant": assistant, "name": name, "sha256": digest,
                                             "chars": sum(len(t) for _, t in chunks), "created": now,
                                             "updated": now, "source": source}).last_pk
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

    def add_page(self, assistant: str, url: str) -> str:
        """A page of the shop's site, fetched now and indexed (again: updated); DocumentError if not."""
        name, data = fetch(url)
        return self.add(assistant, name, data, source=url.strip())

    def refresh_pages(self, assistant: str | None = None) -> list[str]:
        """Every fetched page (of one assistant, or all) fetched again: a changed one is indexed again,
        a page that cannot be fetched now keeps its last text. One line per page."""
        where, args = ("source is not null", []) if assistant is None else ("source is not null and assistant = ?",
                                                                          [assistant])
        with self.store._db() as db:
            pages = [(r[0], r[1]) for r in db.execute(f"select assistant, source from documents where {where} "
                                                      "order by assistant, name", args)]
        lines = []
        for slug, url in pages:
            try:
                lines.append(f"{slug}: {self.add_page(slug, url)}")
            except DocumentError as e:
                lines.append(f"❌ {slug}: {e} (its last text stays)")
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

    def stamp(self, assistant: str) -> tuple:
        """Changes whenever the assistant's documents do (one added, replaced or removed)."""
        with self.store._db() as db:
            return tuple(db.execute("select count(*), max(id), max(updated) from documents where assistant = ?",
                                    [assistant]).fetchone())

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
        words = terms(query)
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
