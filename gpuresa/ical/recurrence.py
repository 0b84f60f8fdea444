"""RRULE values to instants on a series' wall clock: a recurrence engine bounded by its window.

`read_rule` reads an RRULE value into a `Rule`; `expand_rule` gives the
instances that fall in a window, as naive wall-clock times of the series (the
caller puts them into the series' zone). Its work is bounded by the window,
not by the series' history, and it refuses past `MAX_PERIODS` periods or
`MAX_OCCURRENCES_IN_WINDOW` instances, so no rule can make it spin (dateutil's
rrule loops until the year 9999 on a rule that never matches). Rules more
frequent than daily, BYYEARDAY and BYWEEKNO are refused with a reason.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta

from gpuresa.errors import EventError

# Work limits: what a hostile or broken rule may cost before it is refused.
MAX_OCCURRENCES_IN_WINDOW = 1000
MAX_PERIODS = 100_000

_WEEKDAYS = {"MO": 0, "TU": 1, "WE": 2, "TH": 3, "FR": 4, "SA": 5, "SU": 6}
_BY_DAY = re.compile(r"([+-]?)(\d{1,2})?(MO|TU|WE|TH|FR|SA|SU)")
_NOT_DAILY = ("SECONDLY", "MINUTELY", "HOURLY")
_FREQUENCIES = ("DAILY", "WEEKLY", "MONTHLY", "YEARLY")


@dataclass(frozen=True, slots=True)
class Rule:
    """An RRULE read into plain values (weekdays 0 = Monday, as `date.weekday()`)."""

    frequency: str
    interval: int = 1
    count: int | None = None
    until: datetime | None = None  # wall clock of the series, inclusive
    by_month: tuple[int, ...] = ()
    by_month_day: tuple[int, ...] = ()
    by_day: tuple[tuple[int, int], ...] = ()  # (ordinal or 0, weekday)
    by_hour: tuple[int, ...] = ()
    by_minute: tuple[int, ...] = ()
    by_second: tuple[int, ...] = ()
    by_set_position: tuple[int, ...] = ()
    week_start: int = 0


def _integers(
    name: str, text: str, low: int, high: int, *, signed: bool = False
) -> tuple[int, ...]:
    values = []
    for item in text.split(","):
        item = item.strip()
        if not re.fullmatch(r"[+-]?\d{1,4}" if signed else r"\d{1,4}", item):
            raise EventError(f"RRULE {name}={text[:40]} is not a list of numbers")
        number = int(item)
        if not (low <= abs(number) <= high) or (signed is False and number < low):
            raise EventError(f"RRULE {name}={text[:40]}: {number} is out of range")
        values.append(number)
    return tuple(values)


def read_rule(text: str, until_reader: Callable[[str], datetime], all_day: bool) -> Rule:
    """Read an RRULE value; raises `EventError` with what is wrong or unsupported.

    `until_reader` turns the UNTIL value into the series' wall clock (the
    caller knows the series' zone).
    """
    parts: dict[str, str] = {}
    for item in text.strip().split(";"):
        if not item.strip():
            continue
        name, equals, value = item.partition("=")
        name = name.strip().upper()
        if not equals or not value.strip():
            raise EventError(f"RRULE part {item[:40]!r} has no value")
        if name in parts:
            raise EventError(f"RRULE names {name} twice")
        parts[name] = value.strip().upper()
    frequency = parts.pop("FREQ", None)
    if frequency is None:
        raise EventError("RRULE has no FREQ")
    if frequency in _NOT_DAILY:
        raise EventError(f"RRULE repeats {frequency.lower()}; a booking repeats at most daily")
    if frequency not in _FREQUENCIES:
        raise EventError(f"RRULE FREQ={frequency[:20]} is not a frequency")
    values: dict[str, object] = {"frequency": frequency}
    for name, value in parts.items():
        if name == "INTERVAL":
            values["interval"] = _integers(name, value, 1, 9999)[0]
        elif name == "COUNT":
            values["count"] = _integers(name, value, 1, 9999)[0]
        elif name == "UNTIL":
            values["until"] = until_reader(value)
        elif name == "BYMONTH":
            values["by_month"] = _integers(name, value, 1, 12)
        elif name == "BYMONTHDAY":
            values["by_month_day"] = _integers(name, value, 1, 31, signed=True)
        elif name == "BYHOUR":
            values["by_hour"] = _integers(name, value, 0, 23)
        elif name == "BYMINUTE":
            values["by_minute"] = _integers(name, value, 0, 59)
        elif name == "BYSECOND":
            values["by_second"] = _integers(name, value, 0, 59)
        elif name == "BYSETPOS":
            values["by_set_position"] = _integers(name, value, 1, 366, signed=True)
        elif name == "WKST":
            if value not in _WEEKDAYS:
                raise EventError(f"RRULE WKST={value[:10]} is not a weekday")
            values["week_start"] = _WEEKDAYS[value]
        elif name == "BYDAY":
            days = []
            for item in value.split(","):
                match = _BY_DAY.fullmatch(item.strip())
                if match is None:
                    raise EventError(f"RRULE BYDAY={value[:40]} is not a list of weekdays")
                ordinal = int(match[2] or 0) * (-1 if match[1] == "-" else 1)
                if match[2] is not None and not 1 <= int(match[2]) <= 53:
                    raise EventError(f"RRULE BYDAY={value[:40]}: ordinal out of range")
                days.append((ordinal, _WEEKDAYS[match[3]]))
            values["by_day"] = tuple(days)
        elif name in ("BYYEARDAY", "BYWEEKNO"):
            raise EventError(f"RRULE {name} is not supported (no booking app writes it)")
        elif not name.startswith("X-"):
            raise EventError(f"RRULE part {name[:20]} is not known")
    rule = Rule(**values)  # type: ignore[arg-type]
    if rule.count is not None and rule.until is not None:
        raise EventError("RRULE has both COUNT and UNTIL")
    has_ordinal = any(ordinal for ordinal, _ in rule.by_day)
    if has_ordinal and rule.frequency in ("DAILY", "WEEKLY"):
        raise EventError("RRULE BYDAY with a number only fits MONTHLY or YEARLY")
    if has_ordinal and rule.by_month_day:
        raise EventError("RRULE BYDAY with a number cannot be combined with BYMONTHDAY")
    if rule.frequency == "MONTHLY" and any(abs(ordinal) > 5 for ordinal, _ in rule.by_day):
        raise EventError("RRULE BYDAY: a month has at most 5 of each weekday")
    if rule.frequency == "WEEKLY" and rule.by_month_day:
        raise EventError("RRULE BYMONTHDAY does not fit FREQ=WEEKLY")
    if all_day and (rule.by_hour or rule.by_minute or rule.by_second):
        raise EventError("an all-day series cannot repeat by hour, minute or second")
    return rule


def _month_days(year: int, month: int) -> int:
    if month == 12:
        return 31
    return (date(year, month + 1, 1) - date(year, month, 1)).days


def _days_of_month(rule: Rule, year: int, month: int, start: datetime) -> list[date]:
    """The days of one month that a MONTHLY (or YEARLY by month) rule picks."""
    length = _month_days(year, month)
    if rule.by_month_day:
        chosen = sorted({day if day > 0 else length + day + 1 for day in rule.by_month_day})
        days = [date(year, month, day) for day in chosen if 1 <= day <= length]
        if rule.by_day:
            weekdays = {weekday for _, weekday in rule.by_day}
            days = [day for day in days if day.weekday() in weekdays]
        return days
    if rule.by_day:
        return sorted(set(_weekdays_in(rule.by_day, date(year, month, 1), length)))
    if start.day <= length:
        return [date(year, month, start.day)]
    return []  # the 31st in a 30-day month: no occurrence (RFC 5545)


def _weekdays_in(by_day: tuple[tuple[int, int], ...], first: date, length: int) -> Iterator[date]:
    """The days of a span (a month or a year) that BYDAY picks; ordinals count in the span."""
    for ordinal, weekday in by_day:
        offset = (weekday - first.weekday()) % 7
        matching = list(range(offset, length, 7))
        if ordinal == 0:
            chosen = matching
        elif ordinal > 0:
            chosen = matching[ordinal - 1 : ordinal] if ordinal <= len(matching) else []
        else:
            chosen = [matching[ordinal]] if -ordinal <= len(matching) else []
        for day in chosen:
            yield first + timedelta(days=day)


def _days_picker(rule: Rule, start: datetime) -> Callable[[date], list[date]]:
    """The function giving the days a rule picks in the period beginning on a day.

    The plain cases (a daily rule without filters, a weekly one by weekday)
    get their work done once here, since they are what bookings repeat by.
    """
    if rule.frequency == "DAILY" and not (rule.by_month or rule.by_month_day or rule.by_day):
        return lambda first: [first]
    if rule.frequency == "WEEKLY" and not rule.by_month:
        weekdays = [weekday for _, weekday in rule.by_day] or [start.weekday()]
        offsets = [
            timedelta(days=offset)
            for offset in sorted({(weekday - rule.week_start) % 7 for weekday in weekdays})
        ]
        return lambda first: [first + offset for offset in offsets]
    return lambda first: _period_days(rule, first, start)


def _period_days(rule: Rule, first: date, start: datetime) -> list[date]:
    """The days of the period beginning on `first` that the rule picks, before BYSETPOS."""
    if rule.frequency == "DAILY":
        return _daily_days(rule, first)
    if rule.frequency == "WEEKLY":
        weekdays = [weekday for _, weekday in rule.by_day] or [start.weekday()]
        week = {first + timedelta(days=(weekday - rule.week_start) % 7) for weekday in weekdays}
        return sorted(day for day in week if not rule.by_month or day.month in rule.by_month)
    if rule.frequency == "MONTHLY":
        if rule.by_month and first.month not in rule.by_month:
            return []
        return _days_of_month(rule, first.year, first.month, start)
    return _yearly_days(rule, first.year, start)


def _daily_days(rule: Rule, day: date) -> list[date]:
    """A DAILY rule's day, unless BYMONTH, BYMONTHDAY or BYDAY leave it out."""
    if rule.by_month and day.month not in rule.by_month:
        return []
    if rule.by_month_day:
        length = _month_days(day.year, day.month)
        if not any(
            (wanted if wanted > 0 else length + wanted + 1) == day.day
            for wanted in rule.by_month_day
        ):
            return []
    if rule.by_day and day.weekday() not in {weekday for _, weekday in rule.by_day}:
        return []
    return [day]


def _yearly_days(rule: Rule, year: int, start: datetime) -> list[date]:
    """The days of one year that a YEARLY rule picks (BYDAY counts in the year or month)."""
    if rule.by_day and not rule.by_month_day and not rule.by_month:
        first = date(year, 1, 1)
        return sorted(set(_weekdays_in(rule.by_day, first, (date(year + 1, 1, 1) - first).days)))
    months: Iterable[int]
    if rule.by_month:
        months = sorted(set(rule.by_month))
    elif rule.by_month_day:
        months = range(1, 13)
    else:
        months = [start.month]
    days: list[date] = []
    for month in months:
        days.extend(_days_of_month(rule, year, month, start))
    return days


def _week_start(day: date, week_start: int) -> date:
    return day - timedelta(days=(day.weekday() - week_start) % 7)


def _period_index(rule: Rule, start: datetime, moment: datetime) -> int:
    """Which period (counted from the start's) holds `moment`."""
    if rule.frequency == "DAILY":
        return (moment.date() - start.date()).days
    if rule.frequency == "WEEKLY":
        return (
            _week_start(moment.date(), rule.week_start) - _week_start(start.date(), rule.week_start)
        ).days // 7
    if rule.frequency == "MONTHLY":
        return (moment.year - start.year) * 12 + moment.month - start.month
    return moment.year - start.year


def _period_first_day(rule: Rule, start: datetime, index: int) -> date:
    if rule.frequency == "DAILY":
        return start.date() + timedelta(days=index)
    if rule.frequency == "WEEKLY":
        return _week_start(start.date(), rule.week_start) + timedelta(weeks=index)
    if rule.frequency == "MONTHLY":
        year, month = divmod(start.year * 12 + start.month - 1 + index, 12)
        return date(year, month + 1, 1)
    return date(start.year + index, 1, 1)


def expand_rule(rule: Rule, start: datetime, low: datetime, high: datetime) -> list[datetime]:
    """The instances of `rule` from `start` that fall in [low, high], on the wall clock.

    All three datetimes are naive wall-clock times of the series. DTSTART is
    not returned (the caller adds it: it is always the first instance, and
    counts towards COUNT). The work is bounded by the window: periods before it
    are skipped when there is no COUNT, and a COUNT series may not start more
    than `MAX_PERIODS` periods before it. Raises `EventError` past the limits.
    """
    found: list[datetime] = []
    if start > high:
        return found
    hours = rule.by_hour or (start.hour,)
    minutes = rule.by_minute or (start.minute,)
    seconds = rule.by_second or (start.second,)
    clock = sorted(
        time(hour, minute, second) for hour in hours for minute in minutes for second in seconds
    )
    index = 0
    if rule.count is None:
        # no COUNT: nothing before the window's period matters; jump there
        wanted = _period_index(rule, start, low)
        if wanted > 0:
            index = wanted - wanted % rule.interval
    last_day = high.date() if rule.until is None else min(high.date(), rule.until.date())
    days_of = _days_picker(rule, start)
    # DAILY and WEEKLY periods follow each other by a fixed step; the others are computed
    stepped = rule.frequency in ("DAILY", "WEEKLY")
    step = timedelta(days=rule.interval * (7 if rule.frequency == "WEEKLY" else 1))
    first_day = _period_first_day(rule, start, index)
    produced = 1  # DTSTART
    periods = 0
    while True:
        if not stepped:
            first_day = _period_first_day(rule, start, index)
        if first_day > last_day or first_day.year > 9998:
            break
        periods += 1
        if periods > MAX_PERIODS:
            raise EventError(
                f"the series starts {MAX_PERIODS} repetitions or more before the window "
                "(split it, or give it an UNTIL)"
            )
        days = days_of(first_day)
        index += rule.interval
        if stepped:
            first_day += step
        if not days:
            continue
        if len(clock) == 1:
            moment = clock[0]
            candidates = [datetime.combine(day, moment) for day in days]
        else:
            candidates = [datetime.combine(day, moment) for day in days for moment in clock]
        if rule.by_set_position and candidates:
            size = len(candidates)
            candidates = sorted(
                {
                    candidates[position - 1 if position > 0 else size + position]
                    for position in rule.by_set_position
                    if position <= size and -position <= size
                }
            )
        for candidate in candidates:
            if candidate <= start:
                continue
            if rule.until is not None and candidate > rule.until:
                return found
            if rule.count is not None and produced >= rule.count:
                return found
            produced += 1
            if candidate > high:
                return found
            if candidate >= low:
                found.append(candidate)
                if len(found) > MAX_OCCURRENCES_IN_WINDOW:
                    raise EventError(
                        f"the series has more than {MAX_OCCURRENCES_IN_WINDOW} "
                        "occurrences in the window"
                    )
    return found
