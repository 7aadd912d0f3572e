"""Knowledge in a turn's prompt, laid out for the prefix cache. The retrieved chunks go right after
the assistant's system prompt, in a canonical order (by chunk id: document, then position), each
starting on a KV block boundary (newline tokens pad the gap). The prompt is then, block for block:

    [system prompt ...][chunk 3 ...][chunk 7 ...][conversation ...]

so every chat that cites the same chunks computes none of their blocks again: the blocks of a chunk
never hold the tail of whatever came before it, and the conversation starts on a fresh block.
The chunks' tokens are encoded one piece at a time (the template text before them, each chunk,
the text after), never merged across a boundary by re-tokenizing the whole; `encode` rebuilds the
same ids from the template text of a later turn."""
from __future__ import annotations

from dataclasses import dataclass

from storage.knowledge import Chunk, Knowledge

DEFAULT_K, QUERY_TURNS = 3, 3

HEADER = ("\n\nExcerpts from our documents follow. Answer from them when they cover the question, and do not "
          "make up what they do not say.")
MARK = "\x00"


# session id -> the positions (in its request's block table) of blocks that hold only knowledge: what
# the live panel marks. Written by a chat turn, read by any page's panel in this process.
KNOWLEDGE_BLOCKS: dict[str, frozenset[int]] = {}
MAX_MARKED = 10_000


def mark(session_id: str, grounding: "Grounding | None", block_size: int) -> None:
    if grounding is None:
        KNOWLEDGE_BLOCKS.pop(session_id, None)
        return
    if len(KNOWLEDGE_BLOCKS) >= MAX_MARKED:
        KNOWLEDGE_BLOCKS.pop(next(iter(KNOWLEDGE_BLOCKS)))
    KNOWLEDGE_BLOCKS[session_id] = frozenset(i for start, end in grounding.spans
                                             for i in range(-(-start // block_size), end // block_size))


@dataclass
class Grounding:
    chunks: list[Chunk]
    ids: list[int]  # the knowledge's tokens (pads included)
    text: str  # what they decode to: HEADER and the chunks, appended to the system prompt
    head_len: int  # tokens of the template before the knowledge
    spans: list[tuple[int, int]]  # each chunk's token range in the prompt

    def encode(self, tokenizer, full_text: str) -> list[int]:
        """A prompt's template text -> ids, the knowledge spliced in as laid out."""
        at = full_text.find(self.text)
        if at < 0:
            return tokenizer.encode(full_text, add_special_tokens=False)
        return (tokenizer.encode(full_text[:at], add_special_tokens=False) + self.ids
                + tokenizer.encode(full_text[at + len(self.text):], add_special_tokens=False))

    def sources(self) -> list[dict]:
        return [{"id": c.id, "document": c.document, "section": c.section, "score": round(c.score, 3),
                 "url": c.url} for c in self.chunks]


def chunk_text(n: int, chunk: Chunk) -> str:
    where = f"{chunk.document} › {chunk.section}" if chunk.section else chunk.document
    return f"\n[{n}] {where}\n{chunk.text}\n"


def ground(tokenizer, system_prompt: str, chunks: list[Chunk], block_size: int, align: bool = True) -> Grounding:
    """The knowledge part of a prompt for these chunks (put in canonical order here). align=False:
    the same text with no padding (what bench/knowledge.py compares against)."""
    chunks = sorted(chunks, key=lambda c: c.id)
    probe = tokenizer.apply_chat_template([{"role": "system", "content": system_prompt + MARK}], tokenize=False)
    head_len = len(tokenizer.encode(probe[:probe.index(MARK)], add_special_tokens=False))
    newline = tokenizer.encode("\n", add_special_tokens=False)
    ids, spans = tokenizer.encode(HEADER, add_special_tokens=False), []
    for n, chunk in enumerate(chunks, 1):
        if align and len(newline) == 1:
            ids += newline * ((-(head_len + len(ids))) % block_size)
        start = head_len + len(ids)
        ids += tokenizer.encode(chunk_text(n, chunk), add_special_tokens=False)
        spans.append((start, head_len + len(ids)))
    if align and len(newline) == 1 and chunks:  # the conversation starts on a block of its own
        ids += newline * ((-(head_len + len(ids))) % block_size)
    return Grounding(chunks, ids, tokenizer.decode(ids), head_len, spans)


def retrieve(knowledge: Knowledge, assistant: dict, history: list[dict], text: str) -> list[Chunk]:
    """The chunks for a turn: the top k for the conversation's last customer messages (the
    assistant's `knowledge` settings: k, min_score). If they are among the chunks the last reply drew
    on, those again: the prompt's knowledge stays the same, and the turn continues token for token."""
    settings = assistant.get("knowledge") or {}
    k = settings.get("k", DEFAULT_K)
    if not k:
        return []
    asked = [m["content"] for m in history if m["role"] == "user"][-(QUERY_TURNS - 1):] + [text]
    found = knowledge.search(assistant["assistant"], " ".join(asked), k, settings.get("min_score", 0.0))
    last = next((m for m in reversed(history) if m["role"] == "assistant"), None)
    before = [s["id"] for s in (last or {}).get("sources") or []]
    if found and {c.id for c in found} <= set(before):
        again = knowledge.chunks(assistant["assistant"], before)
        if len(again) == len(before):
            return again
    return found
