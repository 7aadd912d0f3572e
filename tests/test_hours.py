"""Fast tier: an assistant's team hours. The editor's text parses (days, ranges, a time zone) or is
refused saying why; whether the team is in and when it is next in are computed in the hours' own zone;
a customer asking for a person outside them is told the hours and the next opening, in their language."""
import datetime as dt
import time
from types import SimpleNamespace
from zoneinfo import ZoneInfo

import pytest

from engine.errors import ParameterError
from storage import Store
from tests.fakes import FakeEngineClient
from ui import assistants
from ui.handlers import ChatHandlers
from ui.hours import DAYS, parse


def at(zone: str, *when) -> float:
    return dt.datetime(*when, tzinfo=ZoneInfo(zone)).timestamp()


def test_hours_parse_and_describe_themselves():
    team = parse("Mon-Fri 09:00-17:00; sat 10:00-14:00\nEurope/Berlin")
    assert team.zone == "Europe/Berlin" and len(team.spans) == 6
    assert team.describe() == "Mon-Fri 09:00-17:00, Sat 10:00-14:00 (Europe/Berlin)"
    assert team.describe("ko") == "월-금 09:00-17:00, 토 10:00-14:00 (Europe/Berlin)"
    assert parse("Fri-Mon 20:00-24:00").describe() == "Mon 20:00-24:00, Fri-Sun 20:00-24:00 (UTC)"  # wraps the week
    assert parse("") is None and parse("  ") is None


@pytest.mark.parametrize("text, says", [
    ("Mon-Fri 9-17", "neither days and times"), ("Mars/Base", "neither days and times"),
    ("Xyz 09:00-10:00", "days are Mon"), ("Mon 17:00-09:00", "closes before it opens"),
    ("Mon 25:00-26:00", "not a time of day"), ("Europe/Berlin", "at least one day"), ("Mon 09:00-10:00;" * 40, "300"),
])
def test_bad_hours_are_refused_saying_why(text, says):
    with pytest.raises(ParameterError, match=says):
        parse(text)
    with pytest.raises(ParameterError, match=says):
        assistants.check("desk", {"name": "Desk", "hours": text})


def test_open_and_next_opening_are_in_the_hours_zone():
    team = parse("Mon-Fri 09:00-17:00; Asia/Seoul")
    assert team.open_at(at("Asia/Seoul", 2026, 12, 8, 9, 0))  # a Tuesday, 09:00 in Seoul
    assert not team.open_at(at("Asia/Seoul", 2026, 12, 8, 17, 0))  # closes at 17:00
    assert not team.open_at(at("UTC", 2026, 12, 8, 9, 0))  # 18:00 in Seoul
    assert team.when(at("Asia/Seoul", 2026, 12, 8, 17, 30)) == "Wed 09:00"
    assert team.when(at("Asia/Seoul", 2026, 12, 11, 18, 0), "ko") == "월 09:00"  # Friday evening: Monday
    assert team.when(at("Asia/Seoul", 2026, 12, 13, 8, 0)) == "Mon 09:00"  # Sunday


def customer(language="en", name="cara"):
    return SimpleNamespace(username=name, session_hash=f"tab-{name}", headers={"accept-language": language},
                           request=SimpleNamespace(path_params={"assistant": "desk"}, headers={}, cookies={}),
                           cookies={})


@pytest.mark.parametrize("language, says", [("en", "Our team answers chats"), ("ko", "상담원 운영 시간은")])
def test_a_customer_asking_outside_the_hours_is_told_them(smol_tokenizer, tmp_path, language, says):
    tomorrow = DAYS[(dt.datetime.now(dt.timezone.utc).weekday() + 1) % 7].capitalize()
    store = Store(str(tmp_path / "chat.db"))
    chat = ChatHandlers(FakeEngineClient(smol_tokenizer), store, demo=False)
    assistants.save(store, "desk", {"name": "Desk", "hours": f"{tomorrow} 10:00-11:00"}, "test")
    uid, sid = chat.current(None, None, customer(language))
    line = chat.ask_person(uid, sid, customer(language))[0]["value"]
    assert says in line and "10:00-11:00 (UTC)" in line and "10:00" in line.split("(UTC)")[1]
    assert chat.handoff.state(sid)["state"] == "waiting"  # the chat still waits for the team
    assistants.save(store, "desk", {"name": "Desk", "hours": "Mon-Sun 00:00-24:00"}, "test")
    uid, sid = chat.current(None, None, customer(language, "dan"))
    line = chat.ask_person(uid, sid, customer(language, "dan"))[0]["value"]
    assert says not in line  # within the hours: whether anyone is online says the rest


def test_the_editor_saves_and_shows_the_hours_and_refuses_bad_ones(smol_tokenizer, tmp_path):
    from ui.console import AssistantEditor
    from ui.operator import OperatorHandlers

    store = Store(str(tmp_path / "chat.db"))
    fake = FakeEngineClient(smol_tokenizer)
    editor = AssistantEditor(store, OperatorHandlers(fake, store, {"m": None}, None, {"olga"}))
    olga = SimpleNamespace(username="olga")
    args = ("desk", "Desk", "You help.", "", None, None, None, None, "", "", "", "[]", 3, 0.0)
    assert editor.save(*args, "Mon-Fri 09:00-17:00; Europe/Berlin", request=olga)[0].startswith("✅")
    assert editor.show("desk", olga)[14] == "Mon-Fri 09:00-17:00; Europe/Berlin"
    status, *_ = editor.save(*args, "Mon-Fri 9 to 5", request=olga)
    assert status.startswith("❌") and "neither days and times" in status
    assert store.assistant("desk")["version"] == 1  # the bad save changed nothing
