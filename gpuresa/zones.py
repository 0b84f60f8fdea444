"""TZID values to time zones: IANA, Windows and vendor names, or the object's own VTIMEZONE.

A TZID is looked up by name first (IANA, Windows as Outlook writes it,
``/vendor/Area/City``), then built from the calendar object's VTIMEZONE of
that TZID (icalendar builds it: Outlook's "Customized Time Zone" has no other
meaning). `zone_for` raises `EventError` when neither gives a zone.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from gpuresa.errors import EventError


@functools.lru_cache(maxsize=1024)
def named_zone(name: str) -> tzinfo | None:
    """The zone a TZID names: IANA, Windows, or "/vendor/.../Area/City"; None if none."""
    from icalendar.timezone.windows_to_olson import WINDOWS_TO_OLSON

    candidates = [name.strip().strip('"').strip("/")]
    windows = WINDOWS_TO_OLSON.get(candidates[0])
    if windows:
        candidates.append(windows)
    parts = candidates[0].split("/")
    candidates.extend("/".join(parts[start:]) for start in range(1, len(parts)))
    for candidate in candidates:
        if not candidate or len(candidate) > 100 or ".." in candidate:
            continue
        try:
            return ZoneInfo(candidate)
        except (ZoneInfoNotFoundError, ValueError, OSError, TypeError):
            continue
    return None


@functools.lru_cache(maxsize=256)
def defined_zone(definition: str) -> tzinfo | None:
    """A zone built by icalendar from a VTIMEZONE's text; None when it cannot be built."""
    import icalendar

    try:
        component = icalendar.Timezone.from_ical(definition)
        built: tzinfo = component.to_tz(lookup_tzid=False)  # type: ignore[attr-defined]
        # a zone that cannot convert is no zone (icalendar builds some that fail later)
        datetime(2026, 1, 1, tzinfo=built).utcoffset()
        datetime(2026, 7, 1, tzinfo=built).utcoffset()
    except Exception:  # icalendar and dateutil raise many kinds for a bad definition
        return None
    return built


def zone_for(tzid: str, timezones: Mapping[str, str]) -> tzinfo:
    """The zone a TZID parameter names, else the object's VTIMEZONE of it (`timezones` by TZID).

    Raises `EventError` when neither defines a zone.
    """
    zone = named_zone(tzid)
    if zone is not None:
        return zone
    definition = timezones.get(tzid)
    if definition is not None:
        zone = defined_zone(definition)
        if zone is not None:
            return zone
        raise EventError(f"the time zone {tzid[:60]!r} is defined in a way that cannot be read")
    raise EventError(f"unknown time zone {tzid[:60]!r} (no VTIMEZONE defines it)")


@dataclass(frozen=True, slots=True)
class Zones:
    """Where times without a zone belong: the site zone and the calendar's own."""

    site: tzinfo
    # X-WR-TIMEZONE of the object's calendar: floating times and UTC series live there
    calendar: tzinfo | None = None
