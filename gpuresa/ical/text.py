"""iCalendar text to components: the bounded line reader behind `gpuresa.ical.events`.

`parse_object` reads one calendar object (one or more VCALENDARs) into its
VEVENTs, each a `Component` of raw properties, and keeps the VTIMEZONE
definitions by TZID for `gpuresa.ical.zones`. It never raises; what cannot be
read is a problem of the event or of the whole object (see `gpuresa.ical.events`).
`gpuresa.ical.content_lines` takes each property line apart.
"""

from __future__ import annotations

import functools
import hashlib
import re
from typing import NamedTuple

from gpuresa.ical.content_lines import parameter_values, split_line

_FOLD = re.compile(r"\n[ \t]")
# a fold after blank lines (old Mozilla exports), unfolded as icalendar does
_FOLD_AFTER_BLANK_LINES = re.compile(r"\n+[ \t]")
# what a key for an event without UID is made of: when it happens and what it says
# (not DTSTAMP, which a feed may write anew on every download)
_DERIVED_UID_FROM = (
    "DTSTART",
    "DTEND",
    "DURATION",
    "RRULE",
    "RDATE",
    "EXDATE",
    "RECURRENCE-ID",
    "SUMMARY",
    "DESCRIPTION",
    "LOCATION",
    "ORGANIZER",
)
DERIVED_UID_PREFIX = "derived-"
_TEXT_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
_TEXT_UNESCAPED = {"n": "\n", "N": "\n"}


# --- reading the text ---------------------------------------------------------------


class Property(NamedTuple):
    """One property line: its raw parameters and its raw (still escaped) value."""

    parameters: str
    value: str

    def parameter(self, name: str) -> str | None:
        """The value of parameter `name` (upper case), quotes removed; None when absent."""
        if not self.parameters:
            return None
        return parameter_values(self.parameters).get(name)


class ObjectContext(NamedTuple):
    """What the events of one calendar object share: its time zone definitions."""

    timezones: dict[str, str]
    calendar_zone: str | None


class Component:
    """A VEVENT: its properties by upper-case name, in file order.

    `problem` says why the event cannot be read, when a line of it is broken.
    """

    __slots__ = ("context", "derived", "position", "problem", "properties")

    def __init__(
        self,
        context: ObjectContext,
        position: int,
        properties: dict[str, list[Property]] | None = None,
        problem: str | None = None,
    ) -> None:
        self.context = context
        self.position = position
        self.properties: dict[str, list[Property]] = properties if properties is not None else {}
        self.problem = problem
        # what is computed from the event alone (its timing, its rules), kept with it:
        # a component lives in the parse cache as long as its calendar object is unchanged
        self.derived: dict[object, object] = {}

    def __repr__(self) -> str:
        return f"Component(uid={self.uid!r}, position={self.position})"

    def first(self, name: str) -> Property | None:
        """The first `name` property, or None."""
        values = self.properties.get(name)
        return values[0] if values else None

    def all(self, name: str) -> list[Property]:
        """Every `name` property, in file order (empty when none)."""
        return self.properties.get(name, [])

    def text(self, name: str) -> str | None:
        """The first `name` property as unescaped TEXT, or None when absent."""
        found = self.first(name)
        return None if found is None else unescape_text(found.value)

    @property
    def uid(self) -> str:
        """The UID, stripped; for an event without one, a key derived from its content.

        An ICS feed may leave UID out (RFC 5545 §3.8.4.7 requires it). The key
        then is `derived-` and a hash of DTSTART, DTEND, DURATION, the
        recurrence, SUMMARY, DESCRIPTION, LOCATION and ORGANIZER as written: the
        same from one download to the next as long as the event is unchanged.
        """
        found = self.first("UID")
        if found is not None:
            value = found.value.strip()
            if value:
                return value
        derived = self.derived.get("uid")
        if not isinstance(derived, str):
            content = "\n".join(
                f"{name};{item.parameters}:{item.value}"
                for name in _DERIVED_UID_FROM
                for item in self.all(name)
            )
            digest = hashlib.sha256(content.encode("utf-8", errors="replace")).hexdigest()
            derived = self.derived["uid"] = DERIVED_UID_PREFIX + digest[:32]
        return derived

    @property
    def uid_derived(self) -> bool:
        """Whether `uid` is derived from the content (the event has no UID of its own)."""
        found = self.first("UID")
        return found is None or not found.value.strip()


class ParsedObject(NamedTuple):
    """One calendar object read: its VEVENTs, or the reason it cannot be read at all."""

    events: tuple[Component, ...]
    problem: str | None = None


def unescape_text(value: str) -> str:
    r"""A TEXT value with its escapes (\n, \N, \, \; \\) replaced by what they stand for."""
    if "\\" not in value:
        return value
    return _TEXT_ESCAPE.sub(lambda match: _TEXT_UNESCAPED.get(match[1], match[1]), value)


def decode(data: str | bytes) -> str:
    """Calendar bytes as text: UTF-8 (a BOM dropped), undecodable bytes replaced."""
    if isinstance(data, bytes):
        data = data.decode("utf-8", errors="replace")
    return data.removeprefix("\ufeff")


# read objects kept by content: about 4 kB each; a changed object's old reading ages out
PARSE_CACHE_SIZE = 32_768


@functools.lru_cache(maxsize=PARSE_CACHE_SIZE)
def parse_object(data: str | bytes) -> ParsedObject:
    """Read one calendar object (one or more VCALENDARs) into its VEVENTs.

    Given the object's text, returns its VEVENTs, each marked with the problem
    that spoils it (if any), or a `ParsedObject` whose `problem` says why the
    object as a whole cannot be read. Never raises for any input. Results are
    cached by content: an unchanged object is read once.
    """
    text = decode(data)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    timezones: dict[str, str] = {}
    fold = _FOLD_AFTER_BLANK_LINES if "\n\n" in text else _FOLD
    lines = _cut_timezones(fold.sub("", text), timezones).split("\n")
    events: list[Component] = []
    # what the parser is inside: [] outside, ["VCALENDAR"], ["VCALENDAR", "VEVENT"], ...
    stack: list[str] = []
    calendar_zone: str | None = None
    pending: list[Component] = []
    timezone_lines: list[str] = []
    timezone_id: str | None = None
    context = ObjectContext(timezones, None)
    event: Component | None = None
    # after a whole VCALENDAR, stray lines are passed over (a feed's trailing comment)
    closed = False
    index = -1
    count = len(lines)
    while index + 1 < count:
        index += 1
        line = lines[index]
        if not line:
            continue  # blank, or where a VTIMEZONE was taken out
        head, colon, rest = line.partition(":")
        if colon and head and '"' not in head and ";" not in head:
            # the common case: NAME:value, no parameters
            parts: tuple[str, str, str] | None = (head.upper(), "", rest)
        elif line.isspace():
            continue
        else:
            parts = split_line(line)
        if parts is None:
            if event is not None and len(stack) == 2:
                if _is_foreign_extension(line):
                    continue  # another app's broken X- line says nothing about a booking
                # a broken line spoils its event only
                event.problem = event.problem or f"line {index + 1} is not a 'NAME:value' property"
            elif not stack and not closed:
                return ParsedObject((), _not_icalendar(index + 1, line))
            continue
        name, parameters, value = parts
        if name == "BEGIN":
            component = value.strip().upper()
            if not stack:
                if component != "VCALENDAR":
                    return ParsedObject((), f"line {index + 1}: expected BEGIN:VCALENDAR")
                calendar_zone = None
            elif len(stack) == 1 and component == "VEVENT":
                event = Component(context, len(events) + len(pending) + 1)
                # the usual event (no alarm, no broken line) is read in one tight loop
                end = _read_plain_event(lines, index, event)
                if end is not None:
                    pending.append(event)
                    event = None
                    index = end
                    continue
            elif len(stack) == 1 and component == "VTIMEZONE":
                # one _cut_timezones left in place: read line by line
                timezone_lines = []
                timezone_id = None
            stack.append(component)
            if len(stack) > 1 and stack[1] == "VTIMEZONE":
                timezone_lines.append(line)
            if len(stack) > 20:
                return ParsedObject((), f"line {index + 1}: components nested too deep")
            continue
        if name == "END":
            component = value.strip().upper()
            if not stack or stack[-1] != component:
                inside = stack[-1] if stack else "nothing"
                return ParsedObject(
                    (), f"line {index + 1}: END:{component[:40]} inside {inside[:40]}"
                )
            if len(stack) > 1 and stack[1] == "VTIMEZONE":
                timezone_lines.append(line)
            stack.pop()
            if len(stack) == 1 and component == "VEVENT" and event is not None:
                pending.append(event)
                event = None
            elif len(stack) == 1 and component == "VTIMEZONE" and timezone_id:
                timezones.setdefault(timezone_id, "\r\n".join(timezone_lines) + "\r\n")
            elif not stack:
                closed = True
                # one VCALENDAR done: its events share its X-WR-TIMEZONE
                finished = ObjectContext(timezones, calendar_zone)
                for item in pending:
                    item.context = finished
                events.extend(pending)
                pending = []
            continue
        if not stack:
            if closed:
                continue  # text after the last END:VCALENDAR
            return ParsedObject((), _not_icalendar(index + 1, line))
        depth = len(stack)
        if depth == 2 and event is not None and stack[1] == "VEVENT":
            properties = event.properties
            if name in properties:
                properties[name].append(Property(parameters, value))
            else:
                properties[name] = [Property(parameters, value)]
        elif depth == 1 and name == "X-WR-TIMEZONE":
            calendar_zone = unescape_text(value).strip() or None
        elif depth >= 2 and stack[1] == "VTIMEZONE":
            timezone_lines.append(line)
            if depth == 2 and name == "TZID":
                timezone_id = value.strip()
    if stack:
        return ParsedObject((), f"the text ends inside {stack[-1][:40]} (cut short?)")
    if not events and not any(line.strip() for line in lines):
        return ParsedObject((), "the object is empty")
    return ParsedObject(tuple(events))


def _read_plain_event(lines: list[str], begin: int, event: Component) -> int | None:
    """The properties of a VEVENT without subcomponents or broken lines, in one pass.

    Given the lines and the index of BEGIN:VEVENT, fills `event` and returns
    the index of its END:VEVENT; returns None (leaving `event` alone) when the
    event holds anything else, for the line-by-line reader to handle.
    """
    try:
        end = lines.index("END:VEVENT", begin)
    except ValueError:
        return None
    properties: dict[str, list[Property]] = {}
    make = tuple.__new__  # a Property without the Python-level __new__: this loop is hot
    for line in lines[begin + 1 : end]:
        head, colon, value = line.partition(":")
        if not colon or not head:
            return None
        if '"' in head:
            parts = split_line(line)
            if parts is None:
                return None
            name, parameters, value = parts
        else:
            name, _, parameters = head.partition(";")
            if not name:
                return None
            name = name.upper()
        if name == "BEGIN" or name == "END":
            return None
        found = properties.get(name)
        if found is None:
            properties[name] = [make(Property, (parameters, value))]
        else:
            found.append(make(Property, (parameters, value)))
    event.properties = properties
    return end


def _cut_timezones(text: str, timezones: dict[str, str]) -> str:
    """Take the VTIMEZONEs written the usual way out of the text, in a few string searches.

    Their definitions go into `timezones` by TZID (only a zone no name
    identifies is ever built from one); each is replaced by as many empty
    lines, so line numbers in messages stay right. Anything unusual is left
    in place for the line-by-line reader.
    """
    marker = "\nBEGIN:VTIMEZONE\n"
    start = text.find(marker)
    if start < 0:
        return text
    pieces: list[str] = []
    position = 0
    while start >= 0:
        end = text.find("\nEND:VTIMEZONE\n", start + 1)
        if end < 0:
            break
        block = text[start + 1 : end + 14]
        if "BEGIN:VEVENT" in block or "END:VCALENDAR" in block or block.count("BEGIN:VTIMEZ") > 1:
            break
        begin = block.find("\nTZID")
        parts = split_line(block[begin + 1 : block.find("\n", begin + 1)]) if begin > 0 else None
        if parts is not None and parts[0] == "TZID" and parts[2].strip():
            timezones.setdefault(parts[2].strip(), block.replace("\n", "\r\n") + "\r\n")
        pieces.append(text[position : start + 1])
        pieces.append("\n" * block.count("\n"))
        position = end + 14
        start = text.find(marker, position - 1)
    pieces.append(text[position:])
    return "".join(pieces)


def _is_foreign_extension(line: str) -> bool:
    """An X- property line of another app (X-APPLE-..., not X-GPURESA-...)."""
    name = line[:10].upper()
    return name.startswith("X-") and not name.startswith("X-GPURESA")


def _not_icalendar(number: int, line: str) -> str:
    shown = line[:40].encode("ascii", "backslashreplace").decode("ascii")
    return f"not iCalendar text (line {number} reads {shown!r})"
