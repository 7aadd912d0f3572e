"""Links in the customer chat that the shop vouches for.

A small model invents web and e-mail addresses: a made-up path on the shop's site is a dead link, a
made-up domain may belong to anyone. So in the customer chat a reply's address is a link only where
its site appears in what the shop wrote for the assistant (its prompt, greeting, quick replies,
canned replies, tools' endpoints, documents) or in the chat itself (what a tool returned, what the
customer or a person from the shop wrote). Any other address shows as text that cannot be clicked
(a Markdown link keeps its words only, an image is left out). What the model wrote is stored and
served on the API unchanged; the demo page and the console show it as written."""
from __future__ import annotations

import functools
import html
import re
from urllib.parse import urlsplit

# An address as GitHub-flavoured Markdown would link it: http(s)://..., www...., or an e-mail address.
ADDRESS = r"""(?<![\w.+-])(?:https?://|www\.)[^\s<>"'`()\[\]{}|\\^]+|(?<![\w.+-])[\w.+-]+@[\w-]+(?:\.[\w-]+)*\.[a-z]{2,}\b"""
# What a text holds if it holds anything guard() changes: else it is left as it is, unread.
HINTS = re.compile(r"://|www\.|@|<a|<img|\]\(", re.I)
TRAILING = ".,;:!?*_~'\""  # punctuation after an address ends the sentence, not the address

# One pass over a reply, leftmost first: code (left as written), a Markdown link or image, an HTML
# link or image, an <autolink>, a bare address.
PIECES = re.compile(
    r"(?P<code>```.*?(?:```|$)|`[^`\n]*`)"
    r"|(?P<md>(?P<bang>!?)\[(?P<label>[^\]\n]*)\]\(\s*<?(?P<target>(?:[^()\s>]|\([^()\s]*\))*)>?(?:\s+\"[^\"]*\")?\s*\))"
    r"|(?P<a><a\b[^>]*?\bhref\s*=\s*[\"']?(?P<href>[^\"'\s>]*)[^>]*>(?P<inner>.*?)</a\s*>)"
    r"|(?P<img><img\b[^>]*?\bsrc\s*=\s*[\"']?(?P<src>[^\"'\s>]*)[^>]*>)"
    rf"|<(?P<auto>{ADDRESS})>"
    rf"|(?P<bare>{ADDRESS})",
    re.I | re.S)


def host_of(address: str) -> str | None:
    """The site of an address (lowercase, without "www."), None for one that names no site."""
    address = html.unescape(address).strip().rstrip(TRAILING)
    if address.lower().startswith("mailto:"):
        address = address[7:]
    if "@" in address and "://" not in address:
        host = address.rsplit("@", 1)[1]
    else:
        if address.lower().startswith("www."):
            address = "http://" + address
        try:
            parts = urlsplit(address)
        except ValueError:
            return None
        if parts.scheme.lower() not in ("http", "https"):
            return None
        host = parts.hostname or ""
    host = host.lower().rstrip(".")
    host = host[4:] if host.startswith("www.") else host
    return host or None


def hosts_in(*texts: str) -> set[str]:
    """Every site named by an address in these texts."""
    return set().union(*(_hosts(t or "") for t in texts))


@functools.lru_cache(maxsize=4096)  # a chat is shown again at every token of a reply: its stored texts repeat
def _hosts(text: str) -> frozenset[str]:
    if not HINTS.search(text):
        return frozenset()
    return frozenset(h for m in re.finditer(ADDRESS, text, re.I) if (h := host_of(m.group(0))))


def vouched(address: str, hosts: set[str] | frozenset[str]) -> bool:
    """Whether an address's site (or a site it is a subdomain of) is among `hosts`."""
    host = host_of(address)
    return bool(host) and any(host == h or host.endswith("." + h) for h in hosts)


@functools.lru_cache(maxsize=4096)
def guard(text: str, hosts: frozenset[str]) -> str:
    """A reply's Markdown with every address that `hosts` does not vouch for made unclickable."""
    if not HINTS.search(text):
        return text

    def piece(m: re.Match) -> str:
        if m.group("code"):
            return m.group(0)
        if m.group("md"):
            if vouched(m.group("target"), hosts):
                return m.group(0)
            return "" if m.group("bang") else guard(m.group("label"), hosts)
        if m.group("a"):
            return m.group(0) if vouched(m.group("href"), hosts) else guard(m.group("inner"), hosts)
        if m.group("img"):
            return m.group(0) if vouched(m.group("src"), hosts) else ""
        address = m.group("auto") or m.group("bare")
        kept = address.rstrip(TRAILING)
        rest = address[len(kept):]
        if vouched(kept, hosts):
            return (f"<{kept}>" if m.group("auto") else kept) + rest
        return f"`{kept}`{rest}"
    return PIECES.sub(piece, text)


def chat_hosts(messages: list[dict]) -> frozenset[str]:
    """Sites a chat itself vouches for: what the customer wrote, what a person from the shop wrote,
    what a tool returned."""
    texts = [m["content"] for m in messages if m["role"] == "user" or (m.get("author") or "").startswith("agent:")]
    texts += [c.get("result") or "" for m in messages for c in (m.get("tool_calls") or [])]
    return frozenset(hosts_in(*texts))


def assistant_hosts(version: dict, documents: list[str]) -> frozenset[str]:
    """Sites an assistant version vouches for: those in what the shop wrote for it, and in its
    documents' texts (`documents`)."""
    tools = [t.get("url") or "" for t in version.get("tools") or [] if isinstance(t, dict)]
    return frozenset(hosts_in(version.get("system_prompt") or "", version.get("greeting") or "",
                              *version.get("quick_replies") or [], *(version.get("canned") or {}).values(),
                              *tools, *documents))
