"""An assistant's team hours: when people answer the chats handed to them. The operator writes them in
the editor as `Mon-Fri 09:00-17:00; Sat 10:00-14:00; Europe/Berlin` (entries split by `;` or new
lines, days as Mon..Sun, single or a range, times 24-hour, one entry an IANA time zone; none: UTC).
Empty: no hours (the team's presence alone says whether anyone is there). A customer who asks for a
person outside them is told the hours and when the team is next in, in their language; the chat
still waits."""
from __future__ import annotations

import datetime as dt
import re
import zoneinfo
from dataclasses import dataclass

from engine.errors import ParameterError

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
DAY_NAMES = {"en": ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"), "ko": ("월", "화", "수", "목", "금", "토", "일")}
ENTRY = re.compile(r"(?P<first>[a-z]{3})(?:\s*-\s*(?P<last>[a-z]{3}))?\s+(?P<open>\d{1,2}:\d{2})\s*-\s*"
                   r"(?P<close>\d{1,2}:\d{2})", re.I)
MAX_CHARS = 300


@dataclass(frozen=True)
class Hours:
    zone: str
    spans: tuple[tuple[int, int, int], ...]  # (weekday 0 = Monday, opens, closes) in minutes of the day

    def _local(self, now: float) -> dt.datetime:
        return dt.datetime.fromtimestamp(now, zoneinfo.ZoneInfo(self.zone))

    def open_at(self, now: float) -> bool:
        t = self._local(now)
        minute = t.hour * 60 + t.minute
        return any(day == t.weekday() and opens <= minute < closes for day, opens, closes in self.spans)

    def next_opening(self, now: float) -> tuple[int, int]:
        """(weekday, minute of the day) the team is next in, after `now` (in the hours' zone)."""
        t = self._local(now)
        minute = t.weekday() * 1440 + t.hour * 60 + t.minute
        starts = sorted(day * 1440 + opens for day, opens, _ in self.spans)
        later = [s for s in starts if s > minute]
        start = later[0] if later else starts[0]
        return start // 1440, start % 1440

    def describe(self, language: str = "en") -> str:
        """`Mon-Fri 09:00-17:00, Sat 10:00-14:00 (Europe/Berlin)`: consecutive days with the same times as one."""
        names = DAY_NAMES.get(language, DAY_NAMES["en"])
        runs: list[list] = []  # [first day, last day, opens, closes]
        for day, opens, closes in sorted(self.spans, key=lambda s: (s[1], s[2], s[0])):
            if runs and runs[-1][1] == day - 1 and runs[-1][2:] == [opens, closes]:
                runs[-1][1] = day
            else:
                runs.append([day, day, opens, closes])
        parts = [f"{names[a]}{'-' + names[b] if b > a else ''} {_clock(o)}-{_clock(c)}"
                 for a, b, o, c in sorted(runs)]
        return f"{', '.join(parts)} ({self.zone})"

    def when(self, now: float, language: str = "en") -> str:
        day, minute = self.next_opening(now)
        return f"{DAY_NAMES.get(language, DAY_NAMES['en'])[day]} {_clock(minute)}"


def parse(text: str | None) -> Hours | None:
    """The editor's text -> Hours (None when empty); ParameterError naming what is wrong."""
    text = (text or "").strip()
    if not text:
        return None
    if len(text) > MAX_CHARS:
        raise ParameterError(f"team hours are at most {MAX_CHARS} characters", "hours")
    zone, spans = "UTC", []
    for entry in filter(None, (e.strip() for e in re.split(r"[;\n]", text))):
        m = ENTRY.fullmatch(entry)
        if m is None:
            try:
                zoneinfo.ZoneInfo(entry)
            except (zoneinfo.ZoneInfoNotFoundError, ValueError):
                raise ParameterError(f"team hours: {entry!r} is neither days and times (`Mon-Fri 09:00-17:00`) nor a "
                                     "time zone (`Europe/Berlin`)", "hours") from None
            zone = entry
            continue
        first, last = m["first"].lower(), (m["last"] or m["first"]).lower()
        if first not in DAYS or last not in DAYS:
            raise ParameterError(f"team hours: days are Mon, Tue, Wed, Thu, Fri, Sat, Sun; got {entry!r}", "hours")
        opens, closes = _minute(m["open"], entry), _minute(m["close"], entry)
        if closes <= opens:
            raise ParameterError(f"team hours: {entry!r} closes before it opens", "hours")
        a, b = DAYS.index(first), DAYS.index(last)
        for day in range(a, (b if b >= a else b + 7) + 1):
            spans.append((day % 7, opens, closes))
    if not spans:
        raise ParameterError("team hours need at least one day and time (`Mon-Fri 09:00-17:00`)", "hours")
    return Hours(zone, tuple(sorted(spans)))


def _clock(minute: int) -> str:
    return f"{minute // 60:02d}:{minute % 60:02d}"


def _minute(hhmm: str, entry: str) -> int:
    hours, minutes = (int(x) for x in hhmm.split(":"))
    if not (0 <= hours <= 24 and 0 <= minutes < 60) or hours * 60 + minutes > 1440:
        raise ParameterError(f"team hours: {hhmm} in {entry!r} is not a time of day", "hours")
    return hours * 60 + minutes
