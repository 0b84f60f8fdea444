"""The fair-share rules on their own: each limit at its boundary, periods, zones, groups, order.

Pure: bookings are built as values, the journal's facts passed in as values.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.configs import config_of

from gpuresa.config.rules_sections import RulesConfig
from gpuresa.fairshare.check import RuleFacts, apply_rules, is_rule_refusal
from gpuresa.fairshare.limits import groups_of, limits_for
from gpuresa.fairshare.periods import period_name, period_of, periods_over
from gpuresa.model import Rejection, Reservation

PARIS = ZoneInfo("Europe/Paris")
# a Wednesday, noon UTC
NOW = datetime(2026, 11, 25, 12, tzinfo=UTC)


def booking(
    key: str,
    start: datetime,
    hours: float,
    gpus: int = 1,
    user: str = "alice",
    host: str = "gpu1",
    preemptible: bool = False,
) -> Reservation:
    return Reservation(
        key=key,
        uid=key,
        recurrence_id=None,
        calendar="gpu",
        host=host,
        user=user,
        template="pytorch",
        cuda=None,
        gpus=gpus,
        start=start,
        end=start + timedelta(hours=hours),
        preemptible=preemptible,
    )


def rules_of(table: Mapping[str, Any]) -> RulesConfig:
    return config_of({"rules": table}).rules


def decide(
    items: Iterable[Reservation],
    table: Mapping[str, Any],
    *,
    first_seen: Mapping[str, datetime] | None = None,
    holding: Iterable[str] = (),
    used: tuple[Reservation, ...] = (),
    members: Mapping[str, frozenset[str]] | None = None,
    now: datetime = NOW,
    zone: ZoneInfo = PARIS,
    preemptible: Iterable[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """The kept keys (in the given order) and the reason of each refused key."""
    kept, refused = apply_rules(
        list(items),
        rules_of(table),
        RuleFacts(now, used, members or {}),
        zone,
        first_seen=first_seen or {},
        holding=frozenset(holding),
        preemptible=frozenset(preemptible),
    )
    return [item.key for item in kept], {item.key: item.reason for item in refused}


AT = datetime(2026, 11, 26, 9, tzinfo=UTC)  # Thursday 10:00 in Paris


def test_no_rule_keeps_everything_as_it_is() -> None:
    items = [booking("a", AT, 500, gpus=8), booking("b", AT, 500, gpus=8)]
    assert not rules_of({}).active
    assert decide(items, {}) == (["a", "b"], {})
    # a level that sets a limit makes the rules active
    assert rules_of({"users": {"bob": {"max_gpus": 1}}}).active


@pytest.mark.parametrize(("hours", "refused"), [(48, False), (48 + 1 / 3600, True)])
def test_max_duration_at_its_boundary(hours: float, refused: bool) -> None:
    kept, reasons = decide([booking("a", AT, hours)], {"max_duration": "2d"})
    assert (kept == []) == refused
    if refused:
        assert reasons["a"] == (
            "rule max_duration (default): this booking lasts 2d1s; a booking of alice may "
            "last 2d at most"
        )


@pytest.mark.parametrize(
    ("ahead", "refused"), [(timedelta(days=14), False), (timedelta(days=14, seconds=1), True)]
)
def test_max_ahead_is_measured_from_the_first_sight(ahead: timedelta, refused: bool) -> None:
    seen = datetime(2026, 11, 20, 8, tzinfo=UTC)
    item = booking("a", seen + ahead, 1)
    for now in (NOW, seen + ahead - timedelta(hours=1)):
        # as time passes, a refusal stays one: the first sight does not move
        kept, reasons = decide([item], {"max_ahead": "14d"}, first_seen={"a": seen}, now=now)
        assert (kept == []) == refused
    if refused:
        assert reasons["a"] == (
            "rule max_ahead (default): this booking starts 14d1s after gpuresa first saw it "
            "(2026-11-20 09:00 CET); alice may book 14d ahead at most"
        )


def test_max_ahead_of_a_booking_never_seen_counts_from_now() -> None:
    kept, _ = decide([booking("a", NOW + timedelta(days=3), 1)], {"max_ahead": "3d"})
    assert kept == ["a"]
    kept, _ = decide([booking("a", NOW + timedelta(days=3, seconds=1), 1)], {"max_ahead": "3d"})
    assert kept == []


def test_max_gpus_counts_overlaps_over_every_host_and_not_touching_ones() -> None:
    items = [
        booking("a", AT, 4, gpus=2, host="gpu1"),
        booking("b", AT + timedelta(hours=2), 4, gpus=1, host="gpu2"),  # overlaps a: 3 at once
        booking("c", AT + timedelta(hours=4), 4, gpus=2),  # touches a's end, overlaps b: 3
        booking("d", AT + timedelta(hours=3), 1, gpus=2),  # a + b + d = 5
    ]
    kept, reasons = decide(items, {"max_gpus": 3})
    assert kept == ["a", "b", "c"]
    assert reasons["d"] == (
        "rule max_gpus (default): alice holds 3 GPU(s) during this time, of 3 at once at most; "
        "this booking asks for 2"
    )
    # another user's bookings are theirs alone
    kept, _ = decide([*items, booking("e", AT, 1, gpus=3, user="bob")], {"max_gpus": 3})
    assert "e" in kept


def test_max_bookings_counts_the_bookings_still_to_come() -> None:
    started = booking("now", NOW - timedelta(hours=1), 3)
    future = [booking(f"f{day}", NOW + timedelta(days=day), 1) for day in (1, 2, 3)]
    kept, reasons = decide([started, *future], {"max_bookings": 2})
    assert kept == ["now", "f1", "f2"]
    assert reasons["f3"] == (
        "rule max_bookings (default): alice has 2 booking(s) still to come, of 2 at most"
    )
    # once one has started, the third fits (a limit on what is to come)
    kept, _ = decide([started, *future], {"max_bookings": 2}, now=NOW + timedelta(days=1, hours=1))
    assert kept == ["now", "f1", "f2", "f3"]


@pytest.mark.parametrize(
    ("offset_hours", "between"),
    [
        (5.5, "ends 30m before this one starts"),  # after the first
        (-1.5, "starts 30m after this one ends"),  # before it
        (3, "overlaps this one"),
    ],
)
def test_min_gap_refuses_what_comes_too_close(offset_hours: float, between: str) -> None:
    first = booking("first", AT, 5)
    close = booking("close", AT + timedelta(hours=offset_hours), 1)
    kept, reasons = decide(
        [first, close], {"min_gap": "1h"}, first_seen={"first": NOW - timedelta(days=1)}
    )
    assert kept == ["first"]
    assert reasons["close"] == (
        "rule min_gap (default): another booking of alice (2026-11-26 10:00 CET to "
        f"2026-11-26 15:00 CET) {between}; bookings of alice must be 1h apart at least"
    )


def test_min_gap_at_its_boundary_and_zero() -> None:
    first = booking("first", AT, 5)
    apart = booking("apart", AT + timedelta(hours=6), 1)
    assert decide([first, apart], {"min_gap": "1h"})[0] == ["first", "apart"]
    back_to_back = booking("next", AT + timedelta(hours=5), 1)
    assert decide([first, back_to_back], {"min_gap": "0s"})[0] == ["first", "next"]


def test_max_gpu_hours_names_the_week_and_its_figures() -> None:
    # the week of Mon 23 Nov: 18 GPU-hours used already (an ended session, from the journal)
    ended = booking("ended", datetime(2026, 11, 23, 8, tzinfo=UTC), 9, gpus=2)
    fits = booking("fits", AT, 6)  # 24 of 24
    over = booking("over", AT + timedelta(hours=8), 4, gpus=2)
    table = {"groups": {"students": {"members": ["alice"], "max_gpu_hours": 24}}}
    kept, reasons = decide([fits, over], table, used=(ended,), first_seen={"over": NOW})
    assert kept == ["fits"]
    assert reasons["over"] == (
        "rule max_gpu_hours (group students): alice has 0 of 24 GPU-hours left in the week "
        "Mon 23 Nov-Sun 29 Nov; this booking asks for 8"
    )
    kept, reasons = decide([over], table, used=(ended,))
    assert reasons["over"].startswith(
        "rule max_gpu_hours (group students): alice has 6 of 24 GPU-hours left"
    )


def test_a_booking_across_a_weeks_end_counts_in_each_week() -> None:
    # Sunday 29 Nov 20:00 to Monday 30 Nov 04:00, Paris time: 4 h in each week, 2 GPUs
    across = booking("across", datetime(2026, 11, 29, 19, tzinfo=UTC), 8, gpus=2)
    week_two = booking("monday", datetime(2026, 11, 30, 9, tzinfo=UTC), 10)
    kept, _ = decide([across, week_two], {"max_gpu_hours": 18})
    assert kept == ["across", "monday"]  # 8 + 10 in week two: fits exactly
    kept, reasons = decide([across, week_two], {"max_gpu_hours": 17}, first_seen={"monday": NOW})
    assert kept == ["across"]
    assert "the week Mon 30 Nov-Sun 6 Dec; this booking asks for 10" in reasons["monday"]
    # the first week full: the booking across is refused for that week's part
    full = booking("full", datetime(2026, 11, 23, 8, tzinfo=UTC), 16)
    kept, reasons = decide([full, across], {"max_gpu_hours": 18}, first_seen={"full": NOW})
    assert kept == ["full"]
    assert (
        "2 of 18 GPU-hours left in the week Mon 23 Nov-Sun 29 Nov; this booking asks for 8"
        in (reasons["across"])
    )


@pytest.mark.parametrize(
    ("zone", "week"),
    [
        ("UTC", "the week Mon 23 Nov-Sun 29 Nov"),
        ("Europe/Paris", "the week Mon 30 Nov-Sun 6 Dec"),  # 00:30 on Monday there
        ("America/New_York", "the week Mon 23 Nov-Sun 29 Nov"),
    ],
)
def test_the_week_is_the_site_zones(zone: str, week: str) -> None:
    late_sunday = datetime(2026, 11, 29, 23, 30, tzinfo=UTC)
    bounds = period_of(late_sunday, "week", ZoneInfo(zone))
    assert period_name(bounds, "week", ZoneInfo(zone)) == week
    half_hour = booking("a", late_sunday, 0.5)
    _, reasons = decide([half_hour], {"max_gpu_hours": 0.25}, zone=ZoneInfo(zone))
    assert week in reasons["a"]


def test_a_week_with_a_clock_change_is_cut_at_local_midnights() -> None:
    # Paris leaves summer time on Sunday 25 October 2026: that week lasts 169 hours
    start, end = period_of(datetime(2026, 10, 21, tzinfo=UTC), "week", PARIS)
    assert end - start == timedelta(hours=169)
    assert start == datetime(2026, 10, 18, 22, tzinfo=UTC)


@pytest.mark.parametrize(
    ("period", "name"),
    [("day", "on Sun 29 Nov"), ("month", "in November 2026"), ("week", "in the week")],
)
def test_each_period(period: str, name: str) -> None:
    items = [booking("a", datetime(2026, 11, 29, 8, tzinfo=UTC), 3)]
    kept, reasons = decide(items, {"max_gpu_hours": 2, "period": period})
    assert kept == []
    assert f"alice has 2 of 2 GPU-hours left {name}" in reasons["a"]


def test_periods_over_a_month_end() -> None:
    found = periods_over(
        datetime(2026, 12, 31, 12, tzinfo=UTC), datetime(2027, 1, 1, 12, tzinfo=UTC), "month", PARIS
    )
    assert [period_name(bounds, "month", PARIS) for bounds in found] == [
        "December 2026",
        "January 2027",
    ]


TWO_GROUPS: dict[str, Any] = {
    "max_gpus": 4,
    "min_gap": "2h",
    "max_ahead": "7d",
    "groups": {
        "students": {"members": ["alice", "bob"], "max_gpus": 1, "max_gpu_hours": 10},
        "staff": {"members": ["alice"], "max_gpu_hours": 40, "min_gap": "30m"},
        "visitors": {"members": ["dave"], "max_duration": "4h"},
    },
    "users": {"bob": {"max_gpus": "unlimited", "max_ahead": "30d"}},
}


def test_a_user_in_two_groups_gets_the_most_generous_value_of_each_limit() -> None:
    rules = rules_of(TWO_GROUPS)
    assert groups_of("alice", rules) == ("staff", "students")
    limits = {key: (limit.value, limit.source) for key, limit in limits_for("alice", rules).items()}
    assert limits == {
        # staff leaves max_gpus unset: the default's 4, more than students' 1
        "max_gpus": (4, "default"),
        "max_gpu_hours": (40.0, "group staff"),
        "min_gap": (timedelta(minutes=30), "group staff"),  # the shorter gap is the generous one
        "max_ahead": (timedelta(days=7), "default"),
    }
    # bob's own keys win over his group's and the default's; "unlimited" lifts a limit
    bob = limits_for("bob", rules)
    assert "max_gpus" not in bob
    assert bob["max_ahead"].source == "user bob"
    assert bob["max_gpu_hours"].source == "group students"
    # no group: the default; a group that sets a limit the default leaves unset
    assert set(limits_for("carol", rules)) == {"max_gpus", "min_gap", "max_ahead"}
    assert limits_for("dave", rules)["max_duration"].source == "group visitors"


def test_a_user_in_two_groups_is_refused_by_the_generous_limit_only() -> None:
    # 3 GPUs: more than students' 1 but within the default's 4, which staff keeps
    kept, _ = decide([booking("a", AT, 1, gpus=3)], TWO_GROUPS)
    assert kept == ["a"]
    kept, reasons = decide([booking("a", AT, 1, gpus=5)], TWO_GROUPS)
    assert reasons["a"].startswith("rule max_gpus (default): alice holds 0 GPU(s)")
    # bob: his exception lifts students' max_gpus, students' GPU-hours still hold
    assert decide([booking("b", AT, 1, gpus=2, user="bob")], TWO_GROUPS)[0] == ["b"]
    kept, reasons = decide([booking("b", AT, 6, gpus=2, user="bob")], TWO_GROUPS)
    assert reasons["b"].startswith(
        "rule max_gpu_hours (group students): bob has 10 of 10 GPU-hours left"
    )


def test_unix_group_members_come_from_the_host() -> None:
    table = {"groups_from": "unix", "groups": {"gpu-users": {"max_gpus": 1}}}
    members = {"gpu-users": frozenset({"alice"})}
    assert groups_of("alice", rules_of(table), members) == ("gpu-users",)
    _, reasons = decide([booking("a", AT, 1, gpus=2)], table, members=members)
    assert reasons["a"].startswith("rule max_gpus (group gpu-users)")
    # the same members given with groups_from = "config": the host is not asked
    config_table = {"groups": {"gpu-users": {"max_gpus": 1}}}
    assert decide([booking("a", AT, 1, gpus=2)], config_table, members=members)[0] == ["a"]


def test_first_sight_decides_which_booking_is_refused_never_the_uid() -> None:
    early_uid = booking("aaa", AT + timedelta(days=1), 1, gpus=2)
    late_uid = booking("zzz", AT + timedelta(days=2), 1, gpus=2)
    table = {"max_bookings": 1}
    seen = {"zzz": NOW - timedelta(days=2), "aaa": NOW - timedelta(days=1)}
    assert decide([early_uid, late_uid], table, first_seen=seen)[0] == ["zzz"]
    seen = {"zzz": NOW - timedelta(days=1), "aaa": NOW - timedelta(days=2)}
    assert decide([early_uid, late_uid], table, first_seen=seen)[0] == ["aaa"]
    # seen together (one poll): the earlier booking first, whatever its key
    together = {"aaa": NOW, "zzz": NOW}
    assert decide([late_uid, early_uid], table, first_seen=together)[0] == ["aaa"]


def test_a_booking_that_holds_its_session_is_never_refused_and_counts() -> None:
    running = booking("running", NOW - timedelta(hours=1), 10, gpus=2)
    other = booking("other", NOW + timedelta(hours=2), 1, gpus=1)
    table = {"max_duration": "4h", "max_gpus": 2}
    # seen after the other, the running one still comes first
    seen = {"other": NOW - timedelta(days=1), "running": NOW - timedelta(hours=2)}
    kept, reasons = decide([running, other], table, first_seen=seen, holding={"running"})
    assert kept == ["running"]
    assert reasons["other"].startswith("rule max_gpus (default): alice holds 2 GPU(s)")


def test_bookings_that_ran_count_once() -> None:
    ended = booking("ended", datetime(2026, 11, 24, 8, tzinfo=UTC), 10)
    new = booking("new", AT, 5)
    table = {"max_gpu_hours": 12}
    assert decide([new], table)[0] == ["new"]
    assert decide([new], table, used=(ended,))[0] == []
    # still listed by the calendar (and holding): counted as listed, not twice
    assert decide([ended, new], table, used=(ended,), holding={"ended"})[0] == ["ended"]
    shorter = booking("ended", datetime(2026, 11, 24, 8, tzinfo=UTC), 7)
    assert decide([shorter, new], table, used=(ended,), holding={"ended"})[0] == ["ended", "new"]


def test_preemptible_bookings_claim_nothing() -> None:
    spare = booking("spare", AT, 100, gpus=4, preemptible=True)
    marked = booking("marked", AT, 100, gpus=4)
    firm = booking("firm", AT, 2, gpus=2)
    table = {"max_gpus": 2, "max_duration": "3h"}
    kept, reasons = decide([spare, marked, firm], table, preemptible={"marked"})
    assert kept == ["spare", "marked", "firm"]
    assert reasons == {}


def test_a_refused_booking_counts_for_nothing() -> None:
    items = [
        booking("one", AT, 2),
        booking("big", AT + timedelta(days=1), 20),  # refused: over the week's 10 alone
        booking("two", AT + timedelta(days=1), 2),
    ]
    seen = {"one": NOW, "big": NOW + timedelta(seconds=1), "two": NOW + timedelta(seconds=2)}
    kept, reasons = decide(items, {"max_gpu_hours": 10}, first_seen=seen)
    assert kept == ["one", "two"]
    assert list(reasons) == ["big"]


def test_refusals_are_marked_as_the_rules() -> None:
    _, reasons = decide([booking("a", AT, 1, gpus=3)], {"max_gpus": 2})
    rejection = Rejection(key="a", uid="a", calendar="gpu", reason=reasons["a"])
    assert is_rule_refusal(rejection)
    assert not is_rule_refusal(Rejection(key="a", uid="a", calendar="gpu", reason="rule of thumb"))


# --- properties -------------------------------------------------------------------------------

bookings = st.lists(
    st.builds(
        lambda index, user, day, hour, hours, gpus, seen: (
            booking(f"k{index}", AT + timedelta(days=day, hours=hour), hours, gpus, user),
            NOW + timedelta(minutes=seen),
        ),
        st.integers(0, 10_000),
        st.sampled_from(["alice", "bob"]),
        st.integers(-2, 12),
        st.integers(0, 23),
        st.integers(1, 30),
        st.integers(1, 4),
        st.integers(0, 5),
    ),
    max_size=25,
    unique_by=lambda pair: pair[0].key,
)
LIMITS = {"max_gpus": 4, "max_gpu_hours": 60, "max_bookings": 6, "min_gap": "1h"}


@settings(max_examples=150, deadline=None)
@given(bookings, st.randoms())
def test_what_is_kept_keeps_every_limit_whatever_the_input_order(
    pairs: list[tuple[Reservation, datetime]], random: Any
) -> None:
    items = [item for item, _ in pairs]
    seen = {item.key: moment for item, moment in pairs}
    kept, reasons = decide(items, LIMITS, first_seen=seen)
    assert sorted(kept + list(reasons)) == sorted(item.key for item in items)
    shuffled = items[:]
    random.shuffle(shuffled)
    again, again_reasons = decide(shuffled, LIMITS, first_seen=seen)
    assert sorted(again) == sorted(kept) and again_reasons == reasons
    by_key = {item.key: item for item in items}
    zone = PARIS
    for user in ("alice", "bob"):
        mine = sorted(
            (by_key[key] for key in kept if by_key[key].user == user), key=lambda i: i.start
        )
        for first, second in itertools.pairwise(mine):
            assert second.start - first.end >= timedelta(hours=1)  # min_gap (so no overlap)
        assert all(item.gpus <= 4 for item in mine)
        assert sum(item.start > NOW for item in mine) <= 6
        hours: dict[tuple[datetime, datetime], float] = {}
        for item in mine:
            for bounds in periods_over(item.start, item.end, "week", zone):
                inside = min(item.end, bounds[1]) - max(item.start, bounds[0])
                hours[bounds] = hours.get(bounds, 0) + item.gpus * inside.total_seconds() / 3600
        assert all(total <= 60 + 1e-6 for total in hours.values())
