"""Message content as the other fronts send it (Responses' input items, Anthropic's blocks): a field
that must be a string, and text parts joined into one string. Errors name the field (ParameterError)."""
from __future__ import annotations

from engine.errors import ParameterError


def string_field(item: dict, key: str, where: str) -> str:
    """item[key], which must be a string (ParameterError naming `where.key`)."""
    value = item.get(key)
    if not isinstance(value, str):
        raise ParameterError(f"{where}.{key} must be a string.", f"{where}.{key}")
    return value


def joined_text(content: object, where: str, kinds: dict[str, str], sep: str = "") -> str:
    """A content field, a string or a list of parts, as one string: `kinds` maps each part type this
    model reads to the key holding its text; a part of another type (an image, a file) is refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ParameterError(f"{where} must be a string or a list of {' / '.join(kinds)} parts.", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise ParameterError(f"this model reads text only; a content part of type {kind!r} cannot be read.",
                                 f"{where}[{j}]")
        text = part.get(kinds[kind])
        if not isinstance(text, str):
            raise ParameterError(f"{where}[{j}] needs its {kinds[kind]}.", f"{where}[{j}]")
        texts.append(text)
    return sep.join(texts)
