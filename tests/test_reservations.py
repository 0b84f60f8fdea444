"""Events to reservations: mapping rules, every validator rejecting, over-booking, the CLI."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from support.configs import config_of

from gpuresa.cli import main
from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config
from gpuresa.model import Rejection, Reservation, ReservationSet
from gpuresa.reservations.conflicts import host_gpu_count, resolve_conflicts
from gpuresa.reservations.rules import read_calendar, read_reservations

VARIANTS = {"pytorch": ("12.4", "11.8"), "tensorflow": ("12.3", "12.2")}
START = datetime(2026, 3, 10, 8, tzinfo=UTC)
WINDOW = (datetime(2026, 3, 1, tzinfo=UTC), datetime(2026, 4, 1, tzinfo=UTC))


def make_config(
    calendar: Mapping[str, Any] | None = None,
    *,
    hosts: list[dict[str, Any]] | None = None,
    **reservations: Any,
) -> Config:
    return config_of(
        {
            "daemon": {"host": "gpu1"},
            "reservations": {"timezone": "UTC", **reservations},
            "hosts": hosts
            if hosts is not None
            else [{"name": "gpu1", "gpus": [0, 1, 2, 3]}, {"name": "gpu2", "gpus": [0, 1]}],
            "calendars": [
                {
                    "name": "lab",
                    "url": "/lab.ics",
                    "kind": "ics",
                    **(calendar if calendar is not None else {"host": "gpu1"}),
                }
            ],
        }
    )


def event(
    summary: str = "alice",
    description: str = "template: pytorch\\ngpus: 2",
    *,
    uid: str = "booking-1",
    start: datetime = START,
    hours: float = 2,
    extra: str = "",
) -> str:
    end = start + timedelta(hours=hours)
    lines = [
        "BEGIN:VCALENDAR",
        "VERSION:2.0",
        "PRODID:test",
        "BEGIN:VEVENT",
        f"UID:{uid}",
        "DTSTAMP:20260301T000000Z",
        f"DTSTART:{start:%Y%m%dT%H%M%SZ}",
        f"DTEND:{end:%Y%m%dT%H%M%SZ}",
        f"SUMMARY:{summary}",
        f"DESCRIPTION:{description}",
        *[line for line in extra.split("\n") if line],
        "END:VEVENT",
        "END:VCALENDAR",
    ]
    return "\r\n".join(lines) + "\r\n"


def read_one(text: str, config: Config | None = None) -> ReservationSet:
    config = config or make_config()
    return read_calendar(
        config.calendars[0], config, [("one.ics", text)], *WINDOW, variants=VARIANTS
    )


def only_reservation(text: str, config: Config | None = None) -> Reservation:
    found = read_one(text, config)
    assert found.rejected == ()
    [reservation] = found.reservations
    return reservation


def only_rejection(text: str, config: Config | None = None) -> Rejection:
    found = read_one(text, config)
    assert found.reservations == ()
    [rejection] = found.rejected
    return rejection


# --- mapping rules ------------------------------------------------------------------------


def test_default_rules_read_a_login_summary_and_description_lines() -> None:
    reservation = only_reservation(event())
    assert (reservation.user, reservation.host, reservation.template) == (
        "alice",
        "gpu1",
        "pytorch",
    )
    # no CUDA asked: the template's first variant
    assert (reservation.cuda, reservation.gpus) == ("12.4", 2)
    assert (reservation.key, reservation.uid, reservation.recurrence_id) == (
        "booking-1",
        "booking-1",
        None,
    )
    assert (reservation.start, reservation.end) == (START, START + timedelta(hours=2))
    assert reservation.calendar == "lab"
    assert reservation.stamp == datetime(2026, 3, 1, tzinfo=UTC)


def test_calendar_defaults_fill_what_the_event_does_not_say() -> None:
    config = make_config(
        {
            "host": "gpu1",
            "default_template": "tensorflow",
            "default_cuda": "12.2",
            "default_gpus": 3,
        }
    )
    reservation = only_reservation(event(description="Just a note."), config)
    assert (reservation.template, reservation.cuda, reservation.gpus) == ("tensorflow", "12.2", 3)


def test_a_default_cuda_the_template_lacks_gives_way_to_the_template_default() -> None:
    config = make_config({"host": "gpu1", "default_cuda": "12.2"})
    reservation = only_reservation(event(description="template: pytorch"), config)
    assert reservation.cuda == "12.4"


def test_x_gpuresa_properties_win_over_description_lines() -> None:
    extra = "X-GPURESA-TEMPLATE:tensorflow\nX-GPURESA-CUDA:12.2\nX-GPURESA-GPUS:all"
    reservation = only_reservation(event(extra=extra))
    assert (reservation.template, reservation.cuda, reservation.gpus) == ("tensorflow", "12.2", 4)


def test_summary_regex_named_groups_win_over_everything() -> None:
    config = make_config(
        {
            "host": "gpu1",
            "summary_regex": r"^(?P<user>[a-z]+) \((?P<template>\w+), (?P<gpus>\d+) GPUs\)$",
        }
    )
    reservation = only_reservation(
        event(summary="bob (tensorflow, 1 GPUs)", extra="X-GPURESA-TEMPLATE:pytorch"), config
    )
    assert (reservation.user, reservation.template, reservation.gpus) == ("bob", "tensorflow", 1)


def test_user_from_organizer_through_the_email_table_and_case() -> None:
    config = make_config(
        {
            "host": "gpu1",
            "user_from": "organizer",
            "email_logins": {"alice.martin@example.org": "alice"},
        }
    )
    mapped = only_reservation(
        event(summary="Lab meeting", extra="ORGANIZER;CN=Alice:MAILTO:Alice.Martin@Example.org"),
        config,
    )
    assert (mapped.user, mapped.email) == ("alice", "Alice.Martin@Example.org")
    local_part = only_reservation(
        event(summary="x", uid="booking-2", extra="ORGANIZER:mailto:Carol@example.org"), config
    )
    assert local_part.user == "carol"


def test_user_from_attendee_skips_resources() -> None:
    config = make_config({"host": "gpu1", "user_from": "attendee"})
    extra = (
        "ORGANIZER:mailto:secretary@example.org\n"
        "ATTENDEE;CUTYPE=RESOURCE:mailto:gpu1@example.org\n"
        "ATTENDEE;CUTYPE=INDIVIDUAL:mailto:dan@example.org"
    )
    reservation = only_reservation(event(summary="Training", extra=extra), config)
    assert (reservation.user, reservation.email) == ("dan", "dan@example.org")


def test_host_from_location_in_any_case() -> None:
    config = make_config({"user_from": "summary"})
    reservation = only_reservation(event(extra="LOCATION: GPU2 "), config)
    assert reservation.host == "gpu2"


def test_html_descriptions_and_spelling_variants() -> None:
    description = "<p>Hello</p><p>Template = PyTorch</p><div>CUDA: cuda 11.8</div>GPU : 1"
    reservation = only_reservation(event(description=description))
    assert (reservation.template, reservation.cuda, reservation.gpus) == ("pytorch", "11.8", 1)


# --- every validator rejecting ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "config", "reason"),
    [
        (event(summary="Alice"), None,
         "'Alice' (from the title) is not a login: lower-case letters, digits, '_' and '-', "
         "starting with a letter or '_', at most 32"),
        (event(summary="a" * 33), None, "is not a login"),
        (event(summary="root;rm -rf /"), None, "is not a login"),
        (event(summary=""), None, "no user: the event has no title (SUMMARY) to read a login from"),
        (event(summary="mallory"), make_config(allowed_users=["alice"]),
         "user 'mallory' may not book (not in reservations.allowed_users)"),
        (event(summary="x"), make_config({"host": "gpu1", "user_from": "organizer"}),
         "no user: the event has no ORGANIZER with an e-mail address"),
        (event(summary="x", extra="ORGANIZER:mailto:Jean.Dupont@example.org"),
         make_config({"host": "gpu1", "user_from": "organizer"}),
         "'jean.dupont' (from the ORGANIZER Jean.Dupont@example.org) is not a login"),
        (event(summary="x"),
         make_config({"host": "gpu1", "summary_regex": r"^user=(?P<user>\w+)$"}),
         "the title 'x' does not have the form this calendar expects (its summary_regex)"),
        (event(description="template: ../../bin"), None,
         "unknown template '../../bin' (templates: pytorch, tensorflow)"),
        (event(description="gpus: 1"), None,
         "no template: write 'template: NAME' in the description (templates: pytorch, tensorflow)"),
        (event(description="template: pytorch\\ncuda: 9.0"), None,
         "CUDA '9.0' is not available for template 'pytorch' (choose one of: 12.4, 11.8)"),
        (event(description="template: pytorch\\ngpus: 5"), None,
         "5 GPUs asked, but host 'gpu1' has 4"),
        (event(description="template: pytorch\\ngpus: 0"), None,
         "0 GPUs: a booking takes at least 1 GPU"),
        (event(description="template: pytorch\\ngpus: -1"), None, "'-1' is not a number of GPUs"),
        (event(description="template: pytorch\\ngpus: 2.5"), None, "'2.5' is not a number of GPUs"),
        (event(description="template: pytorch\\ngpus: ２"), None, "'２' is not a number of GPUs"),
        (event(extra="LOCATION:gpu9"), make_config({}),
         "unknown host 'gpu9' in LOCATION (hosts: gpu1, gpu2)"),
        (event(), make_config({}),
         "no host: this calendar books no fixed host and the event has no LOCATION "
         "(hosts: gpu1, gpu2)"),
        (event(hours=-1), None, "it ends before it starts"),
        (event(hours=0), None, "it ends when it starts (no end time, or a zero length)"),
        (event(hours=25), make_config(max_duration="1d"),
         "it lasts 1d1h, longer than the site's maximum of 1d"),
        (event(uid="a/b"), None, "the event's UID cannot name a reservation"),
        (event(uid="x" * 300), None, "the event's UID cannot name a reservation"),
    ],
)  # fmt: skip
def test_each_validator_rejects(text: str, config: Config | None, reason: str) -> None:
    rejection = only_rejection(text, config)
    assert reason in rejection.reason
    assert rejection.calendar == "lab"


def test_every_problem_of_an_occurrence_is_in_its_reason() -> None:
    rejection = only_rejection(event(summary="Alice", description="template: caffe\\ngpus: 9"))
    assert rejection.reason.count("; ") == 2
    assert (rejection.user, rejection.start, rejection.end) == (
        None,
        START,
        START + timedelta(hours=2),
    )


def test_a_rejection_names_who_to_tell() -> None:
    rejection = only_rejection(
        event(description="template: caffe", extra="ORGANIZER:mailto:alice@example.org")
    )
    assert (rejection.user, rejection.email) == ("alice", "alice@example.org")


def test_gpus_all_needs_a_known_count() -> None:
    hosts = [{"name": "gpu1", "gpus": "auto"}]
    rejection = only_rejection(
        event(description="template: pytorch\\ngpus: all"), make_config(hosts=hosts)
    )
    assert "'gpus: all' needs host 'gpu1' to list its GPUs" in rejection.reason


def test_an_auto_or_gpu_less_host_takes_any_count() -> None:
    for host in (
        {"name": "gpu1", "gpus": "auto"},
        {"name": "gpu1", "gpus": [], "gpu_mode": "none"},
    ):
        reservation = only_reservation(
            event(description="template: pytorch\\ngpus: 64"), make_config(hosts=[host])
        )
        assert reservation.gpus == 64


def test_tentative_bookings_wait_unless_the_calendar_accepts_them() -> None:
    text = event(extra="STATUS:TENTATIVE")
    assert read_one(text) == ReservationSet()
    accepted = only_reservation(text, make_config({"host": "gpu1", "accept_tentative": True}))
    assert accepted.tentative


def test_an_unreadable_object_is_rejected_and_the_others_count() -> None:
    config = make_config()
    found = read_calendar(
        config.calendars[0],
        config,
        [("good.ics", event()), ("junk.ics", b"\x00\x01 not a calendar"), ("empty.ics", "")],
        *WINDOW,
        variants=VARIANTS,
    )
    assert [item.key for item in found.reservations] == ["booking-1"]
    assert {(item.key, item.uid) for item in found.rejected} == {
        ("junk.ics", ""),
        ("empty.ics", ""),
    }


def test_objects_far_outside_the_window_are_not_read_unless_their_uid_matters() -> None:
    config = make_config()
    calendar = config.calendars[0]
    far = START - timedelta(days=40)
    # a broken line in an event long past: never read, so never reported
    broken = event(uid="old", start=far).replace("SUMMARY:", "not a property line\r\nSUMMARY:")
    assert read_calendar(calendar, config, [("old.ics", broken)], *WINDOW, variants=VARIANTS) == (
        ReservationSet()
    )
    # the same flaw inside the window is
    near = event(uid="near").replace("SUMMARY:", "not a property line\r\nSUMMARY:")
    found = read_calendar(calendar, config, [("near.ics", near)], *WINDOW, variants=VARIANTS)
    assert [item.key for item in found.rejected] == ["near"]
    # an exception of a far event kept in another file: the event far away is read after
    # all, so the copy of its UID in another object is seen and refused
    moved = (
        "BEGIN:VCALENDAR\r\nVERSION:2.0\r\nBEGIN:VEVENT\r\nUID:moved\r\n"
        f"RECURRENCE-ID:{far:%Y%m%dT%H%M%SZ}\r\nDTSTART:{START:%Y%m%dT%H%M%SZ}\r\n"
        "DURATION:PT1H\r\nSUMMARY:alice\r\nDESCRIPTION:template: pytorch\r\n"
        "END:VEVENT\r\nEND:VCALENDAR\r\n"
    )
    objects = [("master.ics", event(uid="moved", start=far)), ("exception.ics", moved)]
    origins = {"moved": (calendar.name, "master.ics")}
    found = read_calendar(calendar, config, objects, *WINDOW, variants=VARIANTS, origins=origins)
    assert found.reservations == ()
    assert [item.key for item in found.rejected] == [f"moved/copy/{calendar.name}/exception.ics"]


def test_the_template_catalog_is_read_from_the_template_folders_when_not_given() -> None:
    config = make_config()
    found = read_calendar(config.calendars[0], config, [("a.ics", event())], *WINDOW)
    assert found.reservations[0].cuda == "12.4"  # templates/pytorch/template.toml
    rejected = read_calendar(
        config.calendars[0],
        config,
        [("a.ics", event(description="template: pytorch\\ncuda: 11.1"))],
        *WINDOW,
    )
    assert "choose one of: 12.4, 11.8" in rejected.rejected[0].reason


# --- over-booking ----------------------------------------------------------------------------


def booking(
    key: str,
    start_hour: int,
    end_hour: int,
    gpus: int,
    created_day: int | None,
    host: str = "gpu1",
    stamp_day: int | None = None,
) -> Reservation:
    return Reservation(
        key=key,
        uid=key,
        recurrence_id=None,
        calendar="lab",
        host=host,
        user="alice",
        template="pytorch",
        cuda="12.4",
        gpus=gpus,
        start=datetime(2026, 3, 10, start_hour, tzinfo=UTC),
        end=datetime(2026, 3, 10, end_hour, tzinfo=UTC),
        created=datetime(2026, 3, created_day, tzinfo=UTC) if created_day else None,
        stamp=datetime(2026, 3, stamp_day, tzinfo=UTC) if stamp_day else None,
    )


def seen(**days: int) -> dict[str, datetime]:
    """When gpuresa first saw each key: a day of March 2026."""
    return {key: datetime(2026, 3, day, tzinfo=UTC) for key, day in days.items()}


@pytest.mark.parametrize(
    ("bookings", "first_seen", "holding", "kept", "conflicts"),
    [
        # 3 + 2 GPUs overlap on a 4-GPU host: the one seen first wins
        ([booking("late", 9, 12, 2, 1), booking("early", 10, 14, 3, 5)], seen(late=5, early=1),
         set(), ["early"], {"late": "early"}),
        # a forged CREATED in 1970 wins nothing
        ([booking("forged", 8, 12, 3, None), booking("honest", 8, 12, 3, 2)],
         seen(forged=3, honest=2), set(), ["honest"], {"forged": "honest"}),
        # nor does a DTSTAMP: the journal's first sight decides
        ([booking("z", 8, 10, 3, None, stamp_day=1), booking("y", 8, 10, 3, None, stamp_day=9)],
         seen(z=2, y=1), set(), ["y"], {"z": "y"}),
        # a booking without CREATED that was seen first wins
        ([booking("plain", 8, 10, 3, None), booking("dated", 8, 10, 3, 1)],
         seen(plain=1, dated=2), set(), ["plain"], {"dated": "plain"}),
        # a key never seen counts as seen now: it loses to every known one
        ([booking("new", 8, 10, 3, 1), booking("known", 8, 10, 3, 9)], seen(known=9),
         set(), ["known"], {"new": "known"}),
        # seen at the same time (or neither seen): the UID decides
        ([booking("n", 8, 10, 3, 1), booking("m", 8, 10, 3, 2)], seen(n=1, m=1), set(),
         ["m"], {"n": "m"}),
        ([booking("n", 8, 10, 3, 1), booking("m", 8, 10, 3, 2)], {}, set(), ["m"], {"n": "m"}),
        # a booking whose session runs keeps it, even against one seen earlier
        ([booking("a", 8, 12, 3, 1), booking("b", 10, 14, 3, 5)], seen(a=1, b=5), {"b"},
         ["b"], {"a": "b"}),
        # back to back is no overlap
        ([booking("a", 8, 10, 4, 1), booking("b", 10, 12, 4, 2)], seen(a=1, b=2), set(),
         ["a", "b"], {}),
        # three fit together, the fourth does not, and names the best claim it meets
        ([booking("a", 8, 12, 1, 1), booking("b", 9, 12, 1, 2), booking("c", 10, 12, 2, 3),
          booking("d", 11, 13, 1, 4)], seen(a=1, b=2, c=3, d=4), set(), ["a", "b", "c"],
         {"d": "a"}),
        # the peak counts, not the sum: a and b never overlap each other
        ([booking("a", 8, 10, 2, 1), booking("b", 10, 12, 2, 2), booking("c", 8, 12, 2, 3)],
         seen(a=1, b=2, c=3), set(), ["a", "c", "b"], {}),
        # other hosts do not count
        ([booking("a", 8, 10, 4, 1), booking("b", 8, 10, 2, 2, host="gpu2")], seen(a=1, b=2),
         set(), ["a", "b"], {}),
        # a rejected booking holds no GPUs: c fits beside a once b is out
        ([booking("a", 8, 12, 2, 1), booking("b", 9, 12, 3, 2), booking("c", 9, 12, 2, 3)],
         seen(a=1, b=2, c=3), set(), ["a", "c"], {"b": "a"}),
    ],
)  # fmt: skip
def test_over_booking(
    bookings: list[Reservation],
    first_seen: dict[str, datetime],
    holding: set[str],
    kept: list[str],
    conflicts: dict[str, str],
) -> None:
    resolved = resolve_conflicts(
        bookings, make_config(), first_seen=first_seen, holding=frozenset(holding)
    )
    assert [item.key for item in resolved.reservations] == kept
    by_key = {item.key: item for item in bookings}
    assert {item.key: item.reason.split(" which")[0] for item in resolved.rejected} == {
        key: f"overlaps another booking on host {by_key[key].host} from {_times(by_key[first])}"
        for key, first in conflicts.items()
    }


def _times(booking: Reservation) -> str:
    """A booking as a conflict names it: by its UTC times."""
    return f"{booking.start:%Y-%m-%d %H:%M} UTC to {booking.end:%Y-%m-%d %H:%M} UTC"


def test_a_conflict_says_who_wins_and_why() -> None:
    first = replace(booking("a", 8, 12, 3, 1), summary="alice — thesis run")
    resolved = resolve_conflicts(
        [first, booking("b", 9, 10, 2, 2)], make_config(), first_seen=seen(a=1, b=2)
    )
    [rejection] = resolved.rejected
    # the other booking is named by host and time: its title and UID are its owner's
    assert rejection.reason == (
        "overlaps another booking on host gpu1 from 2026-03-10 08:00 UTC to 2026-03-10 12:00 UTC "
        "which was booked first: the host has 4 GPU(s) and 3 of them are taken during this "
        "time (this one asks for 2)"
    )
    assert "alice" not in rejection.reason and "(a)" not in rejection.reason
    assert (rejection.user, rejection.start) == ("alice", datetime(2026, 3, 10, 9, tzinfo=UTC))


def test_extending_a_booking_into_a_running_one_rejects_the_extension() -> None:
    # A was booked first for 8-10; B then took 10-14 and runs; A is now extended to 12
    extended = booking("a", 8, 12, 3, created_day=None)
    running = booking("b", 10, 14, 3, created_day=None)
    resolved = resolve_conflicts(
        [extended, running], make_config(), first_seen=seen(a=1, b=2), holding=frozenset({"b"})
    )
    assert [item.key for item in resolved.reservations] == ["b"]
    [rejection] = resolved.rejected
    assert rejection.key == "a"
    assert rejection.reason.startswith(
        f"overlaps another booking on host gpu1 from {_times(running)} which already runs: "
    )


def test_hosts_with_uncounted_gpus_keep_everything() -> None:
    config = make_config(hosts=[{"name": "gpu1", "gpus": "auto"}])
    resolved = resolve_conflicts([booking("a", 8, 12, 8, 1), booking("b", 8, 12, 8, 2)], config)
    assert [item.key for item in resolved.reservations] == ["a", "b"]


def test_host_gpu_count() -> None:
    config = parse_config(
        {
            "daemon": {"host": "listed"},
            "hosts": [
                {"name": "listed", "gpus": [0, 2, 5]},
                {"name": "auto", "gpus": "auto"},
                {"name": "none", "gpus": [0], "gpu_mode": "none"},
            ],
        }
    )
    assert [host_gpu_count(host) for host in config.hosts] == [3, None, None]


def test_read_reservations_across_calendars_resolves_conflicts_and_duplicates() -> None:
    config = parse_config(
        {
            "daemon": {"host": "gpu1"},
            "hosts": [{"name": "gpu1", "gpus": [0, 1, 2, 3]}],
            "calendars": [
                {"name": "first", "url": "/a.ics", "kind": "ics", "host": "gpu1"},
                {"name": "second", "url": "/b.ics", "kind": "ics", "host": "gpu1"},
            ],
        }
    )
    early = event(
        uid="early", extra="CREATED:20260201T000000Z", description="template: pytorch\\ngpus: 3"
    )
    late = event(
        uid="late", extra="CREATED:20260202T000000Z", description="template: pytorch\\ngpus: 2"
    )
    copy = event(uid="early", description="template: pytorch\\ngpus: 1")
    objects = {
        "second": [("late.ics", late), ("copy.ics", copy)],
        "first": [("early.ics", early)],
    }
    found = read_reservations(
        config, objects, *WINDOW, variants=VARIANTS, first_seen=seen(early=1, late=2)
    )
    # the copy of "early" in the second calendar is refused, the first calendar's counts
    assert [(item.key, item.calendar, item.gpus) for item in found.reservations] == [
        ("early", "first", 3)
    ]
    by_key = {item.key: item for item in found.rejected}
    assert by_key.keys() == {"late", "early/copy/second/early"}
    assert by_key["late"].reason.startswith("overlaps another booking on host ")
    assert "which was booked first" in by_key["late"].reason
    assert "already a booking in calendar first" in by_key["early/copy/second/early"].reason
    # once "late" holds a session, it keeps it
    found = read_reservations(
        config, objects, *WINDOW, variants=VARIANTS, holding=frozenset({"late"})
    )
    assert [item.key for item in found.reservations] == ["late"]
    by_key = {item.key: item for item in found.rejected}
    assert by_key["early"].reason.startswith("overlaps another booking on host ")
    assert "which already runs" in by_key["early"].reason


# --- the command ------------------------------------------------------------------------------


def write_config(tmp_path: Path, calendar_lines: str) -> Path:
    config = tmp_path / "config.toml"
    config.write_text(
        f"""
[daemon]
host = "gpu1"
state_dir = "{tmp_path / "state"}"
[reservations]
timezone = "Europe/Paris"
[[hosts]]
name = "gpu1"
gpus = [0, 1, 2, 3]
[[calendars]]
{calendar_lines}
"""
    )
    return config


# the key of the event without UID below: a hash of its DTSTART, DTEND, SUMMARY, DESCRIPTION
DERIVED = "derived-33bb8ec58f937ca5495f8b9f197f2057"


def test_reservations_json_is_exactly_the_public_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "calendar"
    folder.mkdir()
    (folder / "good.ics").write_text(event())
    (folder / "series.ics").write_text(
        event(uid="weekly", start=START - timedelta(hours=1), extra="RRULE:FREQ=WEEKLY;COUNT=2")
    )
    (folder / "bad.ics").write_text(event(uid="bad", summary="Not A Login"))
    # a feed may leave UID out: the key is derived from the event's content
    without_uid = event(start=START + timedelta(days=10)).replace("UID:booking-1\r\n", "")
    (folder / "no-uid.ics").write_text(without_uid)
    config = write_config(tmp_path, f'name = "lab"\nkind = "ics"\nurl = "{folder}"\nhost = "gpu1"')
    code = main(
        ["--config", str(config), "reservations", "--from", "2026-03-01", "--to", "2026-04-01",
         "--json"]
    )  # fmt: skip
    assert code == 0
    document = json.loads(capsys.readouterr().out)
    assert document == {
        "reservations": [
            {"key": "weekly@20260310T070000Z", "uid": "weekly", "uid_derived": False,
             "recurrence_id": "20260310T070000Z",
             "calendar": "lab", "host": "gpu1", "user": "alice", "template": "pytorch",
             "cuda": "12.4", "gpus": 2, "start": "2026-03-10T07:00:00+00:00",
             "end": "2026-03-10T09:00:00+00:00"},
            {"key": "booking-1", "uid": "booking-1", "uid_derived": False, "recurrence_id": None,
             "calendar": "lab",
             "host": "gpu1", "user": "alice", "template": "pytorch", "cuda": "12.4", "gpus": 2,
             "start": "2026-03-10T08:00:00+00:00", "end": "2026-03-10T10:00:00+00:00"},
            {"key": "weekly@20260317T070000Z", "uid": "weekly", "uid_derived": False,
             "recurrence_id": "20260317T070000Z",
             "calendar": "lab", "host": "gpu1", "user": "alice", "template": "pytorch",
             "cuda": "12.4", "gpus": 2, "start": "2026-03-17T07:00:00+00:00",
             "end": "2026-03-17T09:00:00+00:00"},
            {"key": DERIVED, "uid": DERIVED, "uid_derived": True, "recurrence_id": None,
             "calendar": "lab", "host": "gpu1", "user": "alice", "template": "pytorch",
             "cuda": "12.4", "gpus": 2, "start": "2026-03-20T08:00:00+00:00",
             "end": "2026-03-20T10:00:00+00:00"},
        ],
        # booking-1 and the series' first occurrence share the 4 GPUs (2 + 2): both fit
        "rejected": [
            {"key": "bad", "uid": "bad", "uid_derived": False, "calendar": "lab",
             "reason": "'Not A Login' (from the title) is not a login: lower-case letters, "
             "digits, '_' and '-', starting with a letter or '_', at most 32"},
        ],
    }  # fmt: skip


def test_reservations_ics_option_uses_the_calendar_rules_and_prints_a_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(
        tmp_path,
        'name = "lab"\nurl = "https://calendar.invalid/lab/"\nuser_from = "organizer"\n'
        'host = "gpu1"',
    )
    export = tmp_path / "export.ics"
    export.write_text(event(summary="Anything", extra="ORGANIZER:mailto:erin@example.org"))
    code = main(
        ["reservations", "--config", str(config), "--ics", str(export), "--from",
         "2026-03-10T00:00", "--to", "2026-03-11T00:00+01:00"]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "Reservations from 2026-03-10 00:00 to 2026-03-11 00:00 (Europe/Paris): 1" in out
    # times in the site zone
    assert "2026-03-10 09:00  2026-03-10 11:00  gpu1  erin  2" in out
    assert "Rejected: 0" in out


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--from", "yesterday"], "--from 'yesterday' is not an ISO 8601 date or time"),
        (["--from", "2026-03-02", "--to", "2026-03-01"], "--to must be later than --from"),
        (["--ics", "/nonexistent/export.ics"], "--ics /nonexistent/export.ics: no such file"),
        (["--calendar", "nope"], "no calendar is named 'nope' (configured: lab)"),
    ],
)
def test_reservations_command_errors_are_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], arguments: list[str], message: str
) -> None:
    folder = tmp_path / "calendar"
    folder.mkdir()
    config = write_config(tmp_path, f'name = "lab"\nkind = "ics"\nurl = "{folder}"\nhost = "gpu1"')
    code = main(["--config", str(config), "reservations", *arguments])
    assert code == 1
    error = capsys.readouterr().err
    assert message in error
    assert "Traceback" not in error


def test_reservations_command_shows_the_last_snapshot_when_the_source_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "calendar"
    folder.mkdir()
    (folder / "good.ics").write_text(event())
    config_path = write_config(
        tmp_path, f'name = "lab"\nkind = "ics"\nurl = "{folder}"\nhost = "gpu1"'
    )
    from gpuresa.config.reading import load_config
    from gpuresa.reservations.sources import open_source

    config = load_config(config_path)
    open_source(config.calendars[0], config.daemon.state_dir).poll()  # the daemon's snapshot
    (folder / "good.ics").unlink()
    folder.rmdir()
    code = main(["--config", str(config_path), "reservations", "--from", "2026-03-01", "--json"])
    assert code == 0
    captured = capsys.readouterr()
    assert "showing its last snapshot" in captured.err
    assert [item["key"] for item in json.loads(captured.out)["reservations"]] == ["booking-1"]
