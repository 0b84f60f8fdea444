"""Internal keys live where no calendar text reaches; keys of the previous format still match."""

from __future__ import annotations

import dataclasses
import re
from datetime import timedelta

from hypothesis import given
from hypothesis import strategies as st
from test_plan import CONFIG, INVENTORY, T0, booking, kinds, running
from test_reservations import VARIANTS, WINDOW, event, make_config

from gpuresa.model import (
    AD_HOC_PREFIX,
    INTERNAL_MARK,
    bench_key,
    calendar_key,
    is_ad_hoc,
    occurrence_key,
)
from gpuresa.planning.planner import plan
from gpuresa.reservations.rules import read_calendar
from gpuresa.sessions.labels import ftp_name, session_name
from gpuresa.sessions.specs import new_spec

# what Docker accepts as a container or network name
DOCKER_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]+")


@given(st.text(max_size=40), st.text(max_size=40))
def test_no_calendar_text_makes_an_internal_key_and_no_two_texts_one_key(
    one: str, other: str
) -> None:
    for text in (one, other):
        assert not calendar_key(text).startswith(INTERNAL_MARK)
        assert not is_ad_hoc(calendar_key(text)) or text.startswith("adhoc-")
        assert not occurrence_key(text, "20260310T080000Z").startswith(INTERNAL_MARK)
    if one != other:
        assert calendar_key(one) != calendar_key(other)


def test_internal_keys_start_with_the_mark_and_make_valid_docker_names() -> None:
    spec = new_spec(CONFIG, [], (0, 1, 2, 3), "alice", "pytorch", T0 + timedelta(hours=1), start=T0)
    assert spec.key.startswith(AD_HOC_PREFIX) and spec.key.startswith(INTERNAL_MARK)
    assert bench_key("gpu1") == "@bench:gpu1"
    for key in (spec.key, bench_key("gpu1"), calendar_key("@adhoc-1a2b3c4d"), "%", "%@x"):
        for name in (session_name("gpu1", key), ftp_name("gpu1", key)):
            assert DOCKER_NAME.fullmatch(name), name
    # the internal key and the calendar text that spells it have different names
    assert session_name("gpu1", spec.key) != session_name("gpu1", calendar_key(spec.key))


def test_a_uid_spelling_an_internal_key_is_a_booking_of_its_own() -> None:
    config = make_config()
    calendar = config.calendars[0]
    internal = f"{AD_HOC_PREFIX}1a2b3c4d"
    found = read_calendar(
        calendar,
        config,
        [("a.ics", event("mallory", uid=internal)), (f"{internal}.ics", "BEGIN:VCALENDAR\r\n")],
        *WINDOW,
        variants=VARIANTS,
    )
    [reservation] = found.reservations
    assert reservation.key == "%" + internal and reservation.uid == internal
    assert all(not item.key.startswith(INTERNAL_MARK) for item in found.rejected)
    # the planner never takes the ad-hoc session for that booking: no stop, no hand-over
    ad_hoc = running(dataclasses.replace(booking(internal), key=internal, user="bob"))
    mallory = dataclasses.replace(booking(reservation.key, user="mallory"), gpus=1)
    actions = plan([mallory], [ad_hoc], INVENTORY, T0 + timedelta(minutes=1), CONFIG)
    assert kinds(actions) == [("Start", reservation.key)]


def test_sessions_of_the_previous_key_format_still_match() -> None:
    # an ad-hoc session made before: still ad-hoc (runs to its end, no orphan stop)
    old_ad_hoc = running(booking("adhoc-1a2b3c4d"))
    assert plan([], [old_ad_hoc], INVENTORY, T0 + timedelta(hours=1), CONFIG) == []
    assert kinds(plan([], [old_ad_hoc], INVENTORY, old_ad_hoc.end, CONFIG)) == [
        ("Stop", "adhoc-1a2b3c4d")
    ]
    # a calendar booking's key is what it was: its running session is still its own
    config = make_config()
    for uid, series in (("booking-42@example.org", ""), ("urn:uuid:1-2", "RRULE:FREQ=DAILY")):
        found = read_calendar(
            config.calendars[0], config, [("a.ics", event(uid=uid, extra=series))], *WINDOW,
            variants=VARIANTS,
        )  # fmt: skip
        first = found.reservations[0]
        assert first.key == (uid if not series else f"{uid}@{first.recurrence_id}")
        session = running(first, gpus=(0, 1))
        now = first.start + timedelta(minutes=1)
        assert plan([first], [session], INVENTORY, now, CONFIG) == []


def test_the_legacy_prefixes_stay_refused_as_uids() -> None:
    # a second layer for keys of the previous format, which running sessions and the
    # journal may still carry: without it, "adhoc-…" would be taken for an ad-hoc session
    config = make_config()
    for uid in ("adhoc-1a2b3c4d", "bench:gpu1"):
        found = read_calendar(
            config.calendars[0], config, [("a.ics", event(uid=uid))], *WINDOW, variants=VARIANTS
        )
        assert found.reservations == ()
        assert "starts like a key gpuresa keeps for itself" in found.rejected[0].reason
