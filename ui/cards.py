"""Payment card numbers never reach the database or the model. Customers paste them into support
chats; a shop that kept them would hold card data in a plain SQLite file. A number that looks like a
card (13-19 digits, alone or in groups split by spaces or dashes, a card network's first digits, a
valid Luhn check digit) keeps its last four digits and its separators: `•••• •••• •••• 4242`, the
way receipts print it. Order numbers (`NW20481377`), phone numbers (`+82 10 ...`) and other digits are
left alone."""
from __future__ import annotations

import re

# a run of digits, alone or grouped by single spaces or dashes, not inside a Latin word, a longer number or a
# "+..." phone number (Korean writes particles right after a number: 4111...1111입니다)
DIGIT_RUN = re.compile(r"(?<![A-Za-z0-9_+\-.,/])[0-9]+(?:[ -][0-9]+)*(?![A-Za-z0-9_])")
HIDDEN = "•"


def luhn_ok(digits: str) -> bool:
    total = 0
    for i, d in enumerate(reversed(digits)):
        n = int(d) * (2 if i % 2 else 1)
        total += n - 9 if n > 9 else n
    return total % 10 == 0


def looks_like_card(digits: str) -> bool:
    """13-19 digits from a card network's range (Visa 4, Mastercard 51-55 and 2221-2720, Amex, JCB and
    Diners 3, Discover, UnionPay and Maestro 5-6) whose last digit checks out."""
    if not 13 <= len(digits) <= 19:
        return False
    network = digits[0] in "3456" or 2221 <= int(digits[:4]) <= 2720
    return network and luhn_ok(digits)


def _masked(groups: list[str]) -> list[str]:
    """The groups of one card number with all but the last four digits hidden."""
    keep, out = 4, []
    for group in reversed(groups):
        shown = min(keep, len(group))
        out.append(HIDDEN * (len(group) - shown) + group[len(group) - shown:])
        keep -= shown
    return out[::-1]


def _hide_in_groups(groups: list[str]) -> tuple[list[str], int]:
    """The groups with every card number among them masked, leftmost first, each the longest span of
    whole groups that is one (so a card number followed by its expiry `12 27` keeps the expiry)."""
    out, found, start = [], 0, 0
    while start < len(groups):
        for size in range(min(len(groups) - start, 19), 0, -1):  # a card has at most 19 digits
            if looks_like_card("".join(groups[start:start + size])):
                out += _masked(groups[start:start + size])
                found, start = found + 1, start + size
                break
        else:
            out.append(groups[start])
            start += 1
    return out, found


def hide_cards(text: str) -> tuple[str, int]:
    """`text` with every card number masked, and how many there were."""
    found = 0

    def masked(match: re.Match) -> str:
        nonlocal found
        run = match.group(0)
        groups, n = _hide_in_groups(re.split(r"[ -]", run))
        if not n:
            return run
        found += n
        seps = re.findall(r"[ -]", run) + [""]
        return "".join(g + s for g, s in zip(groups, seps))

    return DIGIT_RUN.sub(masked, text), found
