"""What one booking asks for (`Booking`), and the helpers that read it out of a form's free text.

Everything here is untrusted text typed into a calendar; these helpers take it
apart without trusting it (bounded patterns, control characters dropped),
clean it for names and quote it for messages, and never raise.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from datetime import datetime

from gpuresa.config.calendar_sections import CalendarConfig
from gpuresa.config.capabilities import host_capabilities
from gpuresa.config.sections import HostConfig
from gpuresa.ical.state_block import strip_block

_EMAIL = re.compile(r"[^@\s<>(),;:\"\\\[\]]{1,64}@[A-Za-z0-9.-]{1,253}")
_DESCRIPTION_LINE = re.compile(r"\s*([A-Za-z][A-Za-z _-]{0,30}?)\s*[:=]\s*(.*?)\s*")
_HTML_BREAK = re.compile(r"<\s*(?:br|/p|/div|/li|p|div|li)\b[^>]{0,200}>", re.IGNORECASE)
_HTML_TAG = re.compile(r"<[^<>]{0,500}>")
# keys of `key: value` lines in DESCRIPTION, as people write them
_DESCRIPTION_KEYS = {
    "template": "template",
    "cuda": "cuda",
    "gpus": "gpus",
    "gpu": "gpus",
    "node": "node",
    "partition": "partition",
    "preemptible": "preemptible",
}
_YES = {"yes", "y", "true", "on", "1"}
_NO = {"no", "n", "false", "off", "0"}
# a Slurm node or partition name as a booking may give it
_PLACE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_KEY_SPELLING = str.maketrans("", "", " \t_-")


def clean_text(text: str) -> str:
    """Text without control characters (a newline, tab kept), for names and logs."""
    if text.isprintable():
        return text
    return "".join(
        character for character in text if character.isprintable() or character in "\n\t"
    )


def quoted(value: str) -> str:
    """A value quoted for a message, shortened."""
    shown = clean_text(value).replace("\n", " ")
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return repr(shown)


def email_address(found: object) -> str | None:
    """The e-mail address of an ORGANIZER or ATTENDEE (`mailto:` value), if it is one."""
    value = getattr(found, "value", None)
    if not isinstance(value, str):
        return None
    value = value.strip()
    if value[:7].casefold() == "mailto:":
        value = value[7:].strip()
    if len(value) > 254 or not _EMAIL.fullmatch(value):
        return None
    return value


def description_fields(description: str) -> dict[str, str]:
    """`template: pytorch` / `cuda: 12.4` / `gpus: 2` lines of a DESCRIPTION (first wins).

    Descriptions written by web calendars often carry HTML (`<br>`, `<p>`):
    tags become line breaks or go, entities are decoded. gpuresa's own block
    (what it writes back, `gpuresa.ical.state_block`) is no booking's text: its
    lines are never read as fields.
    """
    description = strip_block(description)
    if "<" in description:
        description = html.unescape(_HTML_TAG.sub("", _HTML_BREAK.sub("\n", description)))
    fields: dict[str, str] = {}
    for line in description.splitlines():
        match = _DESCRIPTION_LINE.fullmatch(line)
        if match is None:
            continue
        key = _DESCRIPTION_KEYS.get(match[1].translate(_KEY_SPELLING).casefold())
        if key is not None and key not in fields and match[2]:
            fields[key] = clean_text(match[2])
    return fields


@dataclass(frozen=True)
class Booking:
    """What one VEVENT asks for, read once for all its occurrences."""

    user: str | None
    email: str | None
    host: str | None
    template: str | None
    cuda: str | None
    gpus: int
    summary: str
    created: datetime | None
    stamp: datetime | None
    tentative: bool
    problems: tuple[str, ...]
    place: str = ""
    preemptible: bool = False


def place_of(fields: dict[str, str], problems: list[str]) -> str:
    """The booking's Slurm place: a node, "partition:<name>", or "" (the site's default)."""
    node, partition = fields.get("node"), fields.get("partition")
    if node and partition:
        problems.append("give a node or a partition, not both")
        return ""
    name = node or partition
    if not name:
        return ""
    if not _PLACE_NAME.fullmatch(name.strip()):
        kind = "node" if node else "partition"
        problems.append(f"{quoted(name)} is not a {kind} name (letters, digits, '.', '_', '-')")
        return ""
    return name.strip() if node else "partition:" + name.strip()


def preemptible_of(
    fields: dict[str, str], calendar: CalendarConfig, host: HostConfig | None, problems: list[str]
) -> bool:
    """Whether the booking is preemptible: its `preemptible:` line, else its calendar's.

    A calendar marked preemptible makes every booking of it so: a line there
    saying no is refused, since the calendar's rule is the admin's, not the
    writer's. On a host whose scheduler places the GPUs (Slurm) gpuresa does
    not know which are idle: a preemptible booking there is refused.
    """
    asked = fields.get("preemptible")
    preemptible = calendar.preemptible
    if asked is not None:
        answer = asked.strip().casefold()
        if answer in _YES:
            preemptible = True
        elif answer not in _NO:
            problems.append(f"{quoted(asked)} is not yes or no (preemptible)")
        elif calendar.preemptible:
            problems.append("this calendar's bookings are all preemptible: 'no' refused")
    if preemptible and host is not None and host_capabilities(host).places_gpus:
        problems.append(
            f"host {host.name} is a cluster whose scheduler places the GPUs: a preemptible "
            "booking there is its scheduler's own preemption to serve, not gpuresa's"
        )
    return preemptible
