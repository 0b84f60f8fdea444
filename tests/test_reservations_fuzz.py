"""No input crashes the reader: every outcome is a valid reservation or a rejection with a reason.

Hypothesis feeds random bytes, random lines, and otherwise valid events whose
property values (times, rules, zones, names, counts, free text) are random.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuresa.config.names import LOGIN
from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config
from gpuresa.model import ReservationSet
from gpuresa.reservations.rules import read_reservations

VARIANTS = {"pytorch": ("12.4", "11.8"), "tensorflow": ("12.3",)}
WINDOW = (datetime(2026, 3, 1, tzinfo=UTC), datetime(2026, 3, 15, tzinfo=UTC))
CONFIG: Config = parse_config(
    {
        "daemon": {"host": "gpu1"},
        "reservations": {"timezone": "Europe/Paris", "max_duration": "3d"},
        "hosts": [{"name": "gpu1", "gpus": [0, 1, 2, 3]}, {"name": "gpu2", "gpus": [0]}],
        "calendars": [
            {"name": "fixed", "url": "/a.ics", "kind": "ics", "host": "gpu1"},
            {"name": "located", "url": "/b.ics", "kind": "ics", "user_from": "organizer"},
        ],
    }
)
SETTINGS = settings(
    max_examples=150,
    deadline=timedelta(seconds=5),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def check(found: ReservationSet) -> None:
    """The invariants of any outcome, whatever the input."""
    hosts = {host.name: host for host in CONFIG.hosts}
    for reservation in found.reservations:
        assert re.fullmatch(LOGIN, reservation.user)
        assert reservation.host in hosts
        assert reservation.template in VARIANTS
        assert reservation.cuda in VARIANTS[reservation.template]
        gpus = hosts[reservation.host].gpus
        assert isinstance(gpus, tuple) and 1 <= reservation.gpus <= len(gpus)
        assert reservation.start.tzinfo is not None and reservation.end.tzinfo is not None
        assert reservation.start.utcoffset() == timedelta(0)
        assert reservation.start < reservation.end <= reservation.start + timedelta(days=3)
        assert reservation.start < WINDOW[1] and reservation.end > WINDOW[0]
        assert "/" not in reservation.uid
    for rejection in found.rejected:
        assert isinstance(rejection.reason, str) and rejection.reason.strip()
        assert rejection.calendar in ("fixed", "located")
    keys = [reservation.key for reservation in found.reservations]
    assert len(keys) == len(set(keys))


def read(objects: list[tuple[str, str | bytes]]) -> ReservationSet:
    return read_reservations(
        CONFIG, {"fixed": objects, "located": objects}, *WINDOW, variants=VARIANTS
    )


@SETTINGS
@given(st.lists(st.binary(max_size=600), min_size=1, max_size=4))
def test_random_bytes(blobs: list[bytes]) -> None:
    check(read([(f"{index}.ics", blob) for index, blob in enumerate(blobs)]))


LINE_NAMES = st.sampled_from(
    ["BEGIN", "END", "UID", "DTSTART", "DTEND", "DURATION", "RRULE", "RDATE", "EXDATE",
     "RECURRENCE-ID", "SUMMARY", "DESCRIPTION", "STATUS", "X-WR-TIMEZONE", "LOCATION", ""]
)  # fmt: skip
COMPONENTS = st.sampled_from(["VCALENDAR", "VEVENT", "VTIMEZONE", "VALARM", "STANDARD", "X"])


@SETTINGS
@given(
    st.lists(
        st.one_of(
            st.tuples(st.sampled_from(["BEGIN", "END"]), COMPONENTS).map(":".join),
            st.tuples(LINE_NAMES, st.text(max_size=40)).map(":".join),
            st.text(max_size=60),
        ),
        max_size=40,
    )
)
def test_random_lines_in_random_structure(lines: list[str]) -> None:
    text = "BEGIN:VCALENDAR\r\n" + "\r\n".join(lines) + "\r\nEND:VCALENDAR\r\n"
    check(read([("lines.ics", text)]))


def one_of_text(usual: str, *others: str) -> st.SearchStrategy[str]:
    """Mostly `usual`, sometimes one of `others`, now and then any text at all."""
    weighted = [usual] * (2 * len(others) + 2) + [*others] * 2 + ["\x00"]
    return st.sampled_from(weighted).flatmap(
        lambda choice: st.text(max_size=30) if choice == "\x00" else st.just(choice)
    )


STARTS = st.datetimes(datetime(2026, 2, 25), datetime(2026, 3, 16)).map(
    lambda moment: moment.replace(second=0, microsecond=0)
)
ZONES = one_of_text(
    "Europe/Paris", "America/New_York", "W. Europe Standard Time", "/mozilla.org/x/Europe/Paris",
    "UTC", "Etc/GMT+5", "Nowhere/City", "../../etc/passwd", "Customized Time Zone",
)  # fmt: skip
RULES = st.one_of(
    st.sampled_from(
        ["FREQ=DAILY;COUNT=3", "FREQ=WEEKLY;BYDAY=MO,WE", "FREQ=DAILY;INTERVAL=2;UNTIL=20260312",
         "FREQ=MONTHLY;BYDAY=-1FR", "FREQ=WEEKLY;COUNT=2;WKST=SU"]
    ),
    st.lists(
        st.one_of(
            st.sampled_from(
                ["FREQ=DAILY", "FREQ=WEEKLY", "FREQ=MONTHLY", "FREQ=YEARLY", "FREQ=HOURLY",
                 "FREQ=SECONDLY", "INTERVAL=2", "INTERVAL=0", "COUNT=5", "COUNT=99999",
                 "UNTIL=20260310T000000Z", "UNTIL=20260310", "BYDAY=MO,WE", "BYDAY=-1FR",
                 "BYDAY=5SU", "BYMONTHDAY=31", "BYMONTHDAY=-1,15", "BYMONTH=2", "BYSETPOS=-1",
                 "BYHOUR=0,12", "BYMINUTE=0,30", "WKST=SU", "BYWEEKNO=20"]
            ),
            st.tuples(st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZ", max_size=8), st.text(max_size=10)).map(
                "=".join
            ),
        ),
        max_size=6,
    ).map(";".join),
)  # fmt: skip
VTIMEZONE = (
    "BEGIN:VTIMEZONE\r\nTZID:Customized Time Zone\r\nBEGIN:STANDARD\r\nDTSTART:16010101T030000\r\n"
    "TZOFFSETFROM:+0200\r\nTZOFFSETTO:+0100\r\nRRULE:FREQ=YEARLY;BYDAY=-1SU;BYMONTH=10\r\n"
    "END:STANDARD\r\nBEGIN:DAYLIGHT\r\nDTSTART:16010101T020000\r\nTZOFFSETFROM:+0100\r\n"
    "TZOFFSETTO:+0200\r\nRRULE:FREQ=YEARLY;BYDAY=-1SU;BYMONTH=3\r\nEND:DAYLIGHT\r\nEND:VTIMEZONE\r\n"
)


@st.composite
def events(draw: st.DrawFn) -> str:
    """A VEVENT, mostly the way a booking app writes it, any value of which may be anything
    a person could type instead."""
    lines = [f"UID:{draw(one_of_text('booking-1', 'booking-2', 'booking-3', 'a/b', ''))}"]
    start = draw(STARTS)

    def timed(name: str, moment: datetime) -> None:
        zone = draw(st.one_of(st.none(), st.none(), ZONES))
        parameters = "" if zone is None else f";TZID={zone}"
        form = draw(st.sampled_from(["local"] * 4 + ["utc"] * 3 + ["date", "junk"]))
        if form == "date":
            value = f"{moment:%Y%m%d}"
            parameters += ";VALUE=DATE" if draw(st.booleans()) else ""
        elif form == "utc":
            value = f"{moment:%Y%m%dT%H%M%S}Z"
        elif form == "junk":
            value = draw(st.text(max_size=20))
        else:
            value = f"{moment:%Y%m%dT%H%M%S}"
        lines.append(f"{name}{parameters}:{value}")

    timed("DTSTART", start)
    ending = draw(st.sampled_from(["DTEND", "DTEND", "DURATION", "none"]))
    if ending == "DTEND":
        length = draw(st.one_of(st.integers(30, 600), st.integers(-120, 6000)))
        timed("DTEND", start + timedelta(minutes=length))
    elif ending == "DURATION":
        lines.append(f"DURATION:{draw(one_of_text('PT2H', 'P1D', '-PT1H', 'P1W', 'PT0S'))}")
    if draw(st.integers(0, 2)) == 0:
        lines.append(f"RRULE:{draw(RULES)}")
    for name in ("EXDATE", "RDATE", "RECURRENCE-ID"):
        if draw(st.integers(0, 3)) == 0:
            timed(name, start + timedelta(days=draw(st.integers(-3, 10))))
    fields = {
        "SUMMARY": one_of_text("alice", "bob", "Alice", "root", "a" * 40, "alice (pytorch)"),
        "DESCRIPTION": one_of_text(
            "template: pytorch\\ngpus: 2",
            "template: tensorflow\\ncuda: 12.3\\ngpus: all",
            "<p>template: pytorch</p><br>gpus: 9",
            "template: pytorch\\ncuda: 11.8",
            "gpus: 1e9",
        ),
        "LOCATION": one_of_text("gpu1", "GPU2", "gpu3", ""),
        "STATUS": one_of_text("CONFIRMED", "TENTATIVE", "CANCELLED"),
        "ORGANIZER": one_of_text("mailto:alice@example.org", "mailto:Bob@x", "mailto:", "x"),
        "X-GPURESA-GPUS": one_of_text("1", "all", "0", "-3", "４"),
        "X-GPURESA-TEMPLATE": one_of_text("pytorch", "tensorflow", "../x"),
        "X-GPURESA-CUDA": one_of_text("12.4", "cuda 11.8", "9"),
        "SEQUENCE": one_of_text("0", "3", "x"),
        "CREATED": one_of_text("20260101T000000Z", "garbage"),
    }
    for name, values in fields.items():
        # the usual fields are usually there; the X- ones now and then
        if draw(st.integers(0, 3)) < (
            3 if name in ("SUMMARY", "DESCRIPTION", "LOCATION", "ORGANIZER") else 1
        ):
            lines.append(f"{name}:{draw(values)}")
    cleaned = (line.replace("\r", "").replace("\n", "") for line in lines)
    return "BEGIN:VEVENT\r\n" + "\r\n".join(cleaned) + "\r\nEND:VEVENT\r\n"


@SETTINGS
@given(
    st.lists(st.lists(events(), min_size=1, max_size=3), min_size=1, max_size=3),
    st.booleans(),
    st.one_of(st.none(), ZONES),
)
def test_random_values_in_otherwise_valid_events(
    objects: list[list[str]], with_timezone: bool, calendar_zone: str | None
) -> None:
    header = VTIMEZONE if with_timezone else ""
    if calendar_zone is not None:
        header += f"X-WR-TIMEZONE:{calendar_zone.replace(chr(13), '').replace(chr(10), '')}\r\n"
    texts: list[tuple[str, str | bytes]] = [
        (
            f"{index}.ics",
            f"BEGIN:VCALENDAR\r\nVERSION:2.0\r\n{header}{''.join(items)}END:VCALENDAR\r\n",
        )
        for index, items in enumerate(objects)
    ]
    check(read(texts))
