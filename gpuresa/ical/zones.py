"""TZID values to time zones: IANA, Windows and vendor names, or the object's own VTIMEZONE.

A TZID is looked up by name first (IANA, Windows as Outlook writes it,
``/vendor/Area/City``), then built from the calendar object's VTIMEZONE of
that TZID (icalendar builds it: Outlook's "Customized Time Zone" has no other
meaning). `zone_for` raises `EventError` when neither gives a zone.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from gpuresa.errors import EventError

# Names feeds write that are neither IANA names nor Windows zone IDs, by lower-case name.
_OTHER_NAMES = {
    # Exchange and Lotus Notes exports: CET with EU summer time
    "western/central europe": "Europe/Berlin",
}
# Windows display names, which some Outlook versions write as the TZID, without their
# "(UTC+01:00) " (or "(GMT+01.00) ") and lower-case, cities separated by ", "
_DISPLAY_NAMES = {
    "coordinated universal time": "Etc/UTC",
    "dublin, edinburgh, lisbon, london": "Europe/London",
    "amsterdam, berlin, bern, rome, stockholm, vienna": "Europe/Berlin",
    "belgrade, bratislava, budapest, ljubljana, prague": "Europe/Budapest",
    "brussels, copenhagen, madrid, paris": "Europe/Paris",
    "sarajevo, skopje, warsaw, zagreb": "Europe/Warsaw",
    "athens, bucharest": "Europe/Bucharest",
    "athens, bucharest, istanbul": "Europe/Bucharest",
    "helsinki, kyiv, riga, sofia, tallinn, vilnius": "Europe/Helsinki",
    "helsinki, kiev, riga, sofia, tallinn, vilnius": "Europe/Helsinki",
    "moscow, st. petersburg": "Europe/Moscow",
    "moscow, st. petersburg, volgograd": "Europe/Moscow",
    "jerusalem": "Asia/Jerusalem",
    "chennai, kolkata, mumbai, new delhi": "Asia/Kolkata",
    "beijing, chongqing, hong kong, urumqi": "Asia/Shanghai",
    "osaka, sapporo, tokyo": "Asia/Tokyo",
    "canberra, melbourne, sydney": "Australia/Sydney",
    "eastern time (us & canada)": "America/New_York",
    "central time (us & canada)": "America/Chicago",
    "mountain time (us & canada)": "America/Denver",
    "pacific time (us & canada)": "America/Los_Angeles",
}
_DISPLAY_OFFSET = re.compile(r"\((?:utc|gmt)(?:\s*[+-]\s*\d{1,2}[:.]\d{2})?\)\s*")
_DISPLAY_SEPARATOR = re.compile(r"\s*[,/]\s*")


@functools.lru_cache(maxsize=1024)
def named_zone(name: str) -> tzinfo | None:
    """The zone a TZID names; None if none.

    Read are IANA names (also as "/vendor/.../Area/City"), Windows zone IDs in
    any case, Windows display names ("(UTC+01:00) Brussels, Copenhagen, Madrid,
    Paris") and a few other names feeds write.
    """
    candidates = [name.strip().strip('"').strip("/")]
    lower = candidates[0].lower()
    known = (
        _windows_names().get(lower)
        or _OTHER_NAMES.get(lower)
        or _DISPLAY_NAMES.get(_DISPLAY_SEPARATOR.sub(", ", _DISPLAY_OFFSET.sub("", lower, 1)))
    )
    if known:
        candidates.append(known)
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


@functools.cache
def _windows_names() -> dict[str, str]:
    """Windows zone IDs (lower case) to IANA names, as icalendar has them from CLDR."""
    from icalendar.timezone.windows_to_olson import WINDOWS_TO_OLSON

    return {windows.lower(): iana for windows, iana in WINDOWS_TO_OLSON.items()}


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
