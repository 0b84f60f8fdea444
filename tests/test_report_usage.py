"""The usage report's figures from rows built by hand (pure: no journal, no clock)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuresa.reports.reasons import reason_class
from gpuresa.reports.usage import (
    Booking,
    Holding,
    Period,
    Refusal,
    StateChange,
    Telemetry,
    UsageFacts,
    UsageRow,
    held_intervals,
    start_gpus,
    usage_report,
    week_start,
)

T0 = datetime(2026, 11, 2, tzinfo=UTC)  # a Monday
WEEK = Period(T0, T0 + timedelta(days=7))
NOW = T0 + timedelta(days=10)


def facts_of(
    bookings: Sequence[Booking] = (),
    changes: Sequence[StateChange] = (),
    telemetry: dict[str, Telemetry] | None = None,
    refusals: Sequence[Refusal] = (),
) -> UsageFacts:
    """The facts of `bookings` whose sessions went through `changes`."""
    return UsageFacts(bookings, held_intervals(changes), telemetry or {}, refusals)


def hours(count: float) -> timedelta:
    return timedelta(hours=count)


def booking(key: str, start: float, end: float, gpus: int = 1, **fields: object) -> Booking:
    values: dict[str, object] = {"user": "alice", "host": "gpu1"} | fields
    return Booking(key=key, gpus=gpus, start=T0 + hours(start), end=T0 + hours(end), **values)  # type: ignore[arg-type]


def ran(key: str, start: float, end: float | None, final: str = "ended") -> list[StateChange]:
    """The changes of a session that ran from `start` (hours after T0) to `end`."""
    changes = [
        StateChange(key, T0 + hours(start - 0.1), "preparing"),
        StateChange(key, T0 + hours(start), "running"),
    ]
    if end is not None:
        changes.append(StateChange(key, T0 + hours(end - 0.25), "warned"))
        changes.append(StateChange(key, T0 + hours(end), "stopping"))
        changes.append(StateChange(key, T0 + hours(end) + timedelta(seconds=36), final))
    return changes


def by_user(facts: UsageFacts, period: Period = WEEK, now: datetime = NOW) -> dict[str, UsageRow]:
    report = usage_report(facts, period, "user", lambda login: f"group-{login}", now)
    return {row.key: row for row in report.rows} | {"total": report.total}


def test_booked_is_the_booking_within_the_period_times_its_gpus() -> None:
    facts = facts_of(
        bookings=[
            booking("inside", 10, 14, gpus=2),  # 4 h × 2
            booking("across-start", -3, 2, gpus=1),  # 2 h inside
            booking("across-end", 7 * 24 - 1, 7 * 24 + 5, gpus=4),  # 1 h × 4
            booking("before", -10, -1, gpus=8),
        ]
    )
    report = usage_report(facts, WEEK, "user", str, NOW)
    assert report.total.booked == pytest.approx(8 + 2 + 4)
    assert [row.key for row in report.rows] == ["alice"]
    # nothing was held: no session ran
    assert report.total.held == 0 and report.total.sessions == 0


@pytest.mark.parametrize(
    ("withdrawn", "expected"),
    [
        (None, 4.0),  # not withdrawn: all of it
        (-5.0, 0.0),  # cancelled before it started: nothing
        (12.0, 2.0),  # cancelled during it: up to then
        (20.0, 4.0),  # rejected after it ended: all of it
    ],
)
def test_a_withdrawn_booking_counts_up_to_its_withdrawal(
    withdrawn: float | None, expected: float
) -> None:
    at = None if withdrawn is None else T0 + hours(withdrawn)
    facts = facts_of(bookings=[booking("b", 10, 14, withdrawn_at=at)])
    assert usage_report(facts, WEEK, "user", str, NOW).total.booked == pytest.approx(expected)


def test_held_runs_from_running_to_the_end_and_busy_follows_the_mean_utilization() -> None:
    facts = facts_of(
        bookings=[booking("a", 10, 14, gpus=2), booking("b", 20, 30, gpus=1, user="bob")],
        changes=[*ran("a", 10, 13), *ran("b", 20, 30)],
        telemetry={"a": Telemetry("a", 180, 50.0)},
    )
    rows = by_user(facts)
    alice, bob = rows["alice"], rows["bob"]
    # 3 h + 36 s of stopping, × 2 GPUs
    assert alice.held == pytest.approx((3 + 0.01) * 2)
    assert alice.busy == pytest.approx((3 + 0.01) * 2 * 0.5)
    assert alice.unmeasured == 0
    # no telemetry: its busy time is unknown, not zero
    assert bob.busy == 0 and bob.unmeasured == pytest.approx(10.01)
    assert rows["total"].sessions == 2


@pytest.mark.parametrize(("now", "held"), [(12, 2.0), (14, 4.0), (40, 4.0)])
def test_a_session_still_running_is_held_until_now_or_its_booking_end(
    now: float, held: float
) -> None:
    facts = facts_of(bookings=[booking("a", 10, 14)], changes=ran("a", 10, None))
    report = usage_report(facts, WEEK, "user", str, T0 + hours(now))
    assert report.total.held == pytest.approx(held)


def test_a_recreated_session_holds_on_and_a_re_plan_ends_the_holding() -> None:
    changes = [
        StateChange("a", T0 + hours(1), "running"),
        StateChange("a", T0 + hours(2), "preparing"),  # a container came back
        StateChange("a", T0 + hours(2.5), "running"),
        StateChange("a", T0 + hours(3), "booked"),  # stopped to be re-planned
        StateChange("a", T0 + hours(4), "running"),
        StateChange("a", T0 + hours(5), "ended"),
    ]
    assert held_intervals(changes)["a"] == [
        Holding(T0 + hours(1), T0 + hours(2), "preparing"),
        Holding(T0 + hours(2.5), T0 + hours(3), "booked"),
        Holding(T0 + hours(4), T0 + hours(5), "ended"),
    ]


@pytest.mark.parametrize(
    ("telemetry", "final", "no_show"),
    [
        (Telemetry("a", 60, 0.0), "ended", True),  # GPUs never busy
        (Telemetry("a", 60, 0.9), "ended", True),  # a probe's blip is not use
        (Telemetry("a", 60, 1.0), "ended", False),
        (Telemetry("a", 0, None), "ended", False),  # GPUs never answered: unknown
        (None, "ended", False),  # no telemetry at all: unknown
        (None, "released", True),  # released: nobody logged in
        (Telemetry("a", 60, 80.0), "released", True),
    ],
)
def test_no_shows(telemetry: Telemetry | None, final: str, no_show: bool) -> None:
    facts = facts_of(
        bookings=[booking("a", 10, 14)],
        changes=ran("a", 10, 12, final=final),
        telemetry={"a": telemetry} if telemetry else {},
    )
    total = usage_report(facts, WEEK, "user", str, NOW).total
    assert (total.sessions, total.no_shows) == (1, int(no_show))


def test_a_session_counts_in_the_period_it_started_in() -> None:
    facts = facts_of(bookings=[booking("a", -2, 2)], changes=ran("a", -2, 2))
    total = usage_report(facts, WEEK, "user", str, NOW).total
    assert total.sessions == 0 and total.held == pytest.approx(2.01)


def test_rows_by_gpu_split_a_session_over_the_gpus_it_ran_on() -> None:
    facts = facts_of(
        bookings=[
            booking("a", 10, 14, gpus=2, gpu_indices=(0, 3)),
            booking("b", 10, 11, gpus=2),  # never started: no GPU known
        ],
        changes=ran("a", 10, 12),
        telemetry={"a": Telemetry("a", 10, 100.0)},
    )
    report = usage_report(facts, WEEK, "gpu", str, NOW)
    rows = {row.key: row for row in report.rows}
    assert sorted(rows) == ["gpu1:0", "gpu1:3", "gpu1:?"]
    assert rows["gpu1:0"].booked == pytest.approx(4.0)
    assert rows["gpu1:3"].busy == pytest.approx(2.01)
    assert rows["gpu1:?"].booked == pytest.approx(2.0)
    # the total counts the session once, its GPU-hours fully
    assert report.total.sessions == 1
    assert report.total.booked == pytest.approx(10.0)


def test_rows_by_group_and_host() -> None:
    facts = facts_of(
        bookings=[
            booking("a", 0, 1, user="alice", host="gpu1"),
            booking("b", 0, 1, user="bob", host="gpu1"),
            booking("c", 0, 1, user="carol", host="gpu2"),
        ]
    )
    groups = {"alice": "vision", "bob": "vision", "carol": "nlp"}
    by_group = usage_report(facts, WEEK, "group", groups.__getitem__, NOW)
    assert {row.key: row.booked for row in by_group.rows} == {"nlp": 1.0, "vision": 2.0}
    by_host = usage_report(facts, WEEK, "host", str, NOW)
    assert {row.key: row.booked for row in by_host.rows} == {"gpu1": 2.0, "gpu2": 1.0}
    with pytest.raises(ValueError, match="not 'calendar'"):
        usage_report(facts, WEEK, "calendar", str, NOW)  # type: ignore[arg-type]


def test_refusals_are_counted_by_class_when_their_booking_starts_in_the_period() -> None:
    def refusal(key: str, at: float, reason: str, user: str | None = "bob") -> Refusal:
        return Refusal(key, user, "gpu1", reason, T0 + hours(at))

    facts = facts_of(
        refusals=[
            refusal("r1", 1, "overlaps another booking on host gpu1 from …"),
            refusal("r2", 2, "overlaps another booking on host gpu1 from …"),
            refusal("r3", 3, "rule max_gpu_hours (group students): bob has 2 of 8 GPU-hours"),
            refusal("r4", -1, "unknown template 'tf' (templates: pytorch)"),  # before
            refusal("r5", 4, "this calendar object cannot be read: bad DTSTART", user=None),
        ]
    )
    report = usage_report(facts, WEEK, "user", str, NOW)
    rows = {row.key: dict(row.refused) for row in report.rows}
    assert rows == {"?": {"unreadable": 1}, "bob": {"conflict": 2, "rule max_gpu_hours": 1}}
    assert sum(report.total.refused.values()) == 4


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        ("overlaps another booking on host gpu1 from 2026-11-02 09:00 CET", "conflict"),
        ("3 GPUs asked, but host 'gpu1' has 2", "too many GPUs"),
        ("0 GPUs: a booking takes at least 1 GPU", "too many GPUs"),
        ("user 'eve' may not book (not in reservations.allowed_users)", "user not allowed"),
        ("unknown host 'gpu9' in LOCATION (hosts: gpu1)", "unknown host"),
        ("unknown template 'tf' (templates: pytorch)", "unknown template"),
        ("it ends before it starts", "bad times"),
        ("it lasts 30d, longer than the site's maximum of 14d", "bad times"),
        (
            "the UID 'x' is already a booking in calendar a; this copy in calendar b is refused",
            "duplicate",
        ),
        ("this calendar object cannot be read: no DTSTART; …", "unreadable"),
        ("rule max_gpus (default): bob holds 2 GPU(s) during this time", "rule max_gpus"),
        ("'maybe' is not yes or no (preemptible)", "bad field"),
        ("something new", "other"),
    ],
)
def test_reason_classes(reason: str, expected: str) -> None:
    assert reason_class(reason) == expected


def test_start_gpus_reads_the_journaled_start_action() -> None:
    assert start_gpus("start k for alice (GPUs [0, 3], ssh 2201, ftp 2301)") == (0, 3)
    assert start_gpus("start k for alice (GPUs [], ssh 2201, ftp 2301)") == ()
    assert start_gpus("start k for alice") == ()


@pytest.mark.parametrize(
    ("now", "monday"),
    [
        # the Sunday of the spring DST change: Monday before is still CET (+01:00)
        ("2026-03-29T12:00:00+02:00", "2026-03-23T00:00:00+01:00"),
        ("2026-03-30T00:00:00+02:00", "2026-03-30T00:00:00+02:00"),
        ("2026-11-04T09:30:00+01:00", "2026-11-02T00:00:00+01:00"),
    ],
)
def test_week_start_is_monday_midnight_in_the_site_zone(now: str, monday: str) -> None:
    zone = ZoneInfo("Europe/Paris")
    found = week_start(datetime.fromisoformat(now).astimezone(zone))
    assert found == datetime.fromisoformat(monday)
    assert found.astimezone(zone).utcoffset() == datetime.fromisoformat(monday).utcoffset()


def test_a_period_must_end_after_it_starts() -> None:
    with pytest.raises(ValueError, match="end after it starts"):
        Period(T0, T0)


# --- properties -------------------------------------------------------------------------

_hours = st.integers(min_value=-48, max_value=24 * 9)


@st.composite
def sessions(draw: st.DrawFn) -> UsageFacts:
    """Random bookings, some run (maybe still running), some with telemetry."""
    bookings, changes, telemetry = [], [], {}
    for number in range(draw(st.integers(0, 8))):
        key = f"k{number}"
        start = draw(_hours)
        length = draw(st.integers(1, 72))
        gpus = draw(st.integers(1, 4))
        user = draw(st.sampled_from(["alice", "bob", "carol"]))
        indices = tuple(range(gpus)) if draw(st.booleans()) else ()
        bookings.append(booking(key, start, start + length, gpus, user=user, gpu_indices=indices))
        if draw(st.booleans()):
            run_end = draw(st.one_of(st.none(), st.integers(start + 1, start + length)))
            changes += ran(key, start, run_end)
            if draw(st.booleans()):
                telemetry[key] = Telemetry(key, 10, draw(st.floats(0, 100)))
    return facts_of(bookings=bookings, changes=changes, telemetry=telemetry)


@settings(max_examples=150, deadline=None)
@given(sessions(), st.sampled_from(["user", "group", "host", "gpu"]), st.integers(1, 167))
def test_figures_add_up_over_rows_and_over_split_periods(
    facts: UsageFacts, by: str, cut_hours: int
) -> None:
    groups = {"alice": "g1", "bob": "g1", "carol": "g2"}.__getitem__
    report = usage_report(facts, WEEK, by, groups, NOW)  # type: ignore[arg-type]
    total = report.total
    # busy never exceeds held; held never exceeds a session's own time
    assert total.busy <= total.held + 1e-9
    assert total.busy + total.unmeasured <= total.held + 1e-9
    assert total.no_shows <= total.sessions
    # the rows add up to the total (a session spread over GPUs counts once in the total)
    for name in ("booked", "held", "busy", "unmeasured"):
        assert sum(getattr(row, name) for row in report.rows) == pytest.approx(getattr(total, name))
    if by != "gpu":
        assert sum(row.sessions for row in report.rows) == total.sessions
    # two halves of a period add up to the whole
    cut = WEEK.start + hours(cut_hours)
    halves = [Period(WEEK.start, cut), Period(cut, WEEK.end)]
    parts = [usage_report(facts, half, by, groups, NOW).total for half in halves]  # type: ignore[arg-type]
    for name in ("booked", "held", "busy", "unmeasured"):
        assert sum(getattr(part, name) for part in parts) == pytest.approx(getattr(total, name))
    assert sum(part.sessions for part in parts) == total.sessions
