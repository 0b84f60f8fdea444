"""gpuresa's own part of a booking event: one delimited block in DESCRIPTION, two X- properties.

What gpuresa writes back into a user's event (`gpuresa.writeback`) is a
block of lines at the end of DESCRIPTION, between `BLOCK_START` and
`BLOCK_END`, plus `X-GPURESA-STATE` and `X-GPURESA-DETAIL` (for tools; most
calendar apps show DESCRIPTION and ignore X- properties). Three pure
functions make that safe:

- `strip_block(text)`: a DESCRIPTION's text without gpuresa's block, so the
  booking reader never takes a line of it (`gpus: 8` in a state text) as a
  booking field;
- `without_own_part(data)`: a calendar object with gpuresa's part removed and
  lines unfolded, so a poll that sees only gpuresa's own write does not count
  it as a change of the booking (no new decision, no loop of writes);
- `write_block(data, uid, ...)`: the object with the block and properties set,
  edited as raw text.

The edit is made on the raw iCalendar text, not by re-serialising a parsed
object (icalendar and vobject reorder properties, refold lines and rewrite
escapes): only the VEVENT's DESCRIPTION and X-GPURESA-STATE/-DETAIL lines
change; every other line, the line endings and the physical lines holding
the user's own part of DESCRIPTION stay byte for byte. The block is replaced,
never appended twice; text the user typed after an old block is kept.

Recurring events: the block goes on the series' master VEVENT (the one
without RECURRENCE-ID), and describes the occurrence gpuresa last wrote
about (the current or next one), naming it by its start. An override
VEVENT is left alone (its own DESCRIPTION is the user's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BLOCK_START = "—— gpuresa ——"
BLOCK_END = "—— end gpuresa ——"
STATE_PROPERTY = "X-GPURESA-STATE"
DETAIL_PROPERTY = "X-GPURESA-DETAIL"
OWN_PROPERTIES = frozenset({STATE_PROPERTY, DETAIL_PROPERTY})
# RFC 5545 §3.1: lines of at most 75 octets, excluding the line break
FOLD_OCTETS = 75
_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
_LINES = re.compile(r"[^\n]*\n|[^\n]+$")
_CONTROLS = re.compile("[\x00-\x09\x0b-\x1f\x7f\x85\u2028\u2029]")


# --- text of a DESCRIPTION (unescaped) ----------------------------------------------


def _block_spans(lines: list[str]) -> list[tuple[int, int]]:
    """(first, last) line indexes of each block, with the one blank line gpuresa puts
    before it; a block without its end marker runs to the end (it was cut short)."""
    spans: list[tuple[int, int]] = []
    index = 0
    while index < len(lines):
        if lines[index].strip() != BLOCK_START:
            index += 1
            continue
        first = index - 1 if index > 0 and not lines[index - 1].strip() else index
        last = index + 1
        while last < len(lines) and lines[last].strip() != BLOCK_END:
            last += 1
        last = min(last, len(lines) - 1)
        spans.append((first, last))
        index = last + 1
    return spans


def _drop(lines: list[str], spans: list[tuple[int, int]]) -> list[str]:
    dropped = {index for first, last in spans for index in range(first, last + 1)}
    return [line for index, line in enumerate(lines) if index not in dropped]


def strip_block(text: str) -> str:
    """`text` (a DESCRIPTION, unescaped) without gpuresa's block(s); the rest as it was."""
    if BLOCK_START not in text:
        return text
    lines = text.split("\n")
    return "\n".join(_drop(lines, _block_spans(lines)))


def escape_text(text: str) -> str:
    """`text` as an iCalendar TEXT value (RFC 5545 §3.3.11); control characters and
    other line breaks (which TEXT cannot hold) become spaces."""
    text = _CONTROLS.sub(" ", text.replace("\r\n", "\n"))
    return (
        text.replace("\\", "\\\\")
        .replace(";", "\\;")
        .replace(",", "\\,")
        .replace("\r\n", "\n")
        .replace("\n", "\\n")
    )


def _escaped_lines(value: str) -> tuple[list[str], list[str]]:
    """An escaped TEXT value split at its escaped line breaks (`\\n`, `\\N`): the lines,
    and the separator after each but the last, as written."""
    lines: list[str] = []
    separators: list[str] = []
    start = 0
    for match in _ESCAPE.finditer(value):
        if match[1] in "nN":
            lines.append(value[start : match.start()])
            separators.append(match[0])
            start = match.end()
    lines.append(value[start:])
    return lines, separators


def strip_escaped(value: str) -> str:
    """An escaped DESCRIPTION value without gpuresa's block; the rest byte for byte."""
    if BLOCK_START not in value:
        return value
    lines, separators = _escaped_lines(value)
    spans = _block_spans(lines)
    dropped = {index for first, last in spans for index in range(first, last + 1)}
    kept = [index for index in range(len(lines)) if index not in dropped]
    out: list[str] = []
    for position, index in enumerate(kept):
        out.append(lines[index])
        if position + 1 < len(kept):
            # the separator that followed this line in the original (or a plain \n)
            out.append(separators[index] if index < len(separators) else "\\n")
    return "".join(out)


# --- raw calendar objects -----------------------------------------------------------


@dataclass
class _Property:
    """One property: its physical lines (with their line breaks) and where it sits."""

    lines: list[str]
    depth: int

    @property
    def unfolded(self) -> str:
        text = "".join(
            line.rstrip("\r\n") if i == 0 else line.rstrip("\r\n")[1:]
            for i, line in enumerate(self.lines)
        )
        return text

    @property
    def name(self) -> str:
        head = self.unfolded.split(":", 1)[0]
        return head.split(";", 1)[0].strip().upper()

    @property
    def value(self) -> str:
        text = self.unfolded
        quoted = False
        for index, character in enumerate(text):
            if character == '"':
                quoted = not quoted
            elif character == ":" and not quoted:
                return text[index + 1 :]
        return ""


def _properties(text: str) -> list[_Property]:
    """The object's properties (BEGIN/END lines included), folded lines kept together,
    each with its depth (1 inside VCALENDAR, 2 inside a VEVENT, 3 inside its VALARM)."""
    found: list[_Property] = []
    depth = 0
    for line in _LINES.findall(text):
        if line[:1] in (" ", "\t") and found:
            found[-1].lines.append(line)
            continue
        upper = line.strip().upper()
        if upper.startswith("END:"):
            depth -= 1
            found.append(_Property([line], depth))
        else:
            found.append(_Property([line], depth))
            if upper.startswith("BEGIN:"):
                depth += 1
    return found


def _newline(text: str) -> str:
    return "\r\n" if "\r\n" in text else "\n"


def fold(line: str, newline: str, first_room: int = FOLD_OCTETS) -> list[str]:
    """`line` (unfolded) as physical lines of at most 75 octets; never inside a
    character, nor between a backslash and the character it escapes."""
    out: list[str] = []
    current = ""
    room = first_room
    index = 0
    while index < len(line):
        piece = line[index : index + 2] if line[index] == "\\" else line[index]
        size = len(piece.encode("utf-8"))
        if len(current.encode("utf-8")) + size > room and current:
            out.append(current + newline)
            current = " "
            room = FOLD_OCTETS
        current += piece
        index += len(piece)
    out.append(current + newline)
    return out


def _events(props: list[_Property]) -> list[tuple[int, int]]:
    """(begin, end) indexes of each VEVENT in `props`."""
    spans: list[tuple[int, int]] = []
    begin: int | None = None
    for index, prop in enumerate(props):
        upper = prop.unfolded.strip().upper()
        if upper == "BEGIN:VEVENT" and begin is None:
            begin = index
        elif upper == "END:VEVENT" and begin is not None and prop.depth == props[begin].depth:
            spans.append((begin, index))
            begin = None
    return spans


def _target(props: list[_Property], uid: str) -> tuple[int, int] | None:
    """The VEVENT of `uid` to write on: its master, else its first (see the docstring)."""
    candidates = []
    for begin, end in _events(props):
        inner = [prop for prop in props[begin + 1 : end] if prop.depth == props[begin].depth + 1]
        uids = [prop.value.strip() for prop in inner if prop.name == "UID"]
        if uids and uids[0] == uid:
            master = not any(prop.name == "RECURRENCE-ID" for prop in inner)
            candidates.append((not master, begin, end))
    if not candidates:
        return None
    _, begin, end = min(candidates)
    return begin, end


def write_block(data: str, uid: str, state: str, detail: str, block_text: str) -> str | None:
    """`data` with gpuresa's block (`block_text`, plain lines) at the end of the DESCRIPTION of
    `uid`'s VEVENT, and X-GPURESA-STATE/-DETAIL set; None when no VEVENT has that UID.

    Returns `data` itself when it already says exactly this (nothing to write).
    """
    props = _properties(data)
    target = _target(props, uid)
    if target is None:
        return None
    begin, end = target
    level = props[begin].depth + 1
    newline = _newline(data)
    block_value = escape_text(f"{BLOCK_START}\n{block_text.strip()}\n{BLOCK_END}")
    own = [
        _Property([f"{STATE_PROPERTY}:{escape_text(state)}{newline}"], level),
        _Property(fold(f"{DETAIL_PROPERTY}:{escape_text(detail)}", newline), level),
    ]
    inner = range(begin + 1, end)
    # where new properties go: after the event's last property, before any VALARM
    insert_at = next(
        (
            index
            for index in inner
            if props[index].depth == level
            and props[index].unfolded.strip().upper().startswith("BEGIN:")
        ),
        end,
    )
    description = next(
        (
            index
            for index in inner
            if props[index].depth == level and props[index].name == "DESCRIPTION"
        ),
        None,
    )
    before: dict[int, list[_Property]] = {}  # properties put before that index
    instead: dict[int, list[_Property]] = {}  # what replaces the property at that index
    if description is None:
        before.setdefault(insert_at, []).append(
            _Property(fold("DESCRIPTION:" + block_value, newline), level)
        )
    else:
        old = props[description]
        user_part = strip_escaped(old.value)
        new_value = (user_part + "\\n\\n" if user_part else "") + block_value
        if new_value != old.value:
            head = old.unfolded[: len(old.unfolded) - len(old.value)]
            instead[description] = [_Property(_refold(old, head + new_value, newline), level)]
    olds = [
        index
        for index in inner
        if props[index].depth == level and props[index].name in OWN_PROPERTIES
    ]
    if [props[index].unfolded for index in olds] != [prop.unfolded for prop in own]:
        for index in olds:
            instead[index] = []
        if olds:
            instead[olds[0]] = own  # where the old ones were
        else:
            before.setdefault(insert_at, []).extend(own)
    if not before and not instead:
        return data
    out: list[str] = []
    for index, prop in enumerate(props):
        for new in before.get(index, []):
            out.extend(new.lines)
        for new in instead.get(index, [prop]):
            out.extend(new.lines)
    return "".join(out)


def _refold(old: _Property, line: str, newline: str) -> list[str]:
    """`line` folded, keeping `old`'s physical lines for as long as they hold its start."""
    kept: list[str] = []
    consumed = 0
    for index, physical in enumerate(old.lines):
        content = physical.rstrip("\r\n")
        if index > 0:
            content = content[1:]
        end = consumed + len(content)
        if line[consumed:end] != content:
            common = 0
            while common < len(content) and line[consumed + common] == content[common]:
                common += 1
            # never between a backslash and the character it escapes
            while (
                common
                and content[:common].endswith("\\")
                and (len(content[:common]) - len(content[:common].rstrip("\\"))) % 2
            ):
                common -= 1
            if common:
                prefix = physical[: common + (1 if index > 0 else 0)]
                kept.append(prefix + newline)
                consumed += common
            break
        kept.append(physical if physical.endswith("\n") else physical + newline)
        consumed = end
    rest = line[consumed:]
    if not rest:
        return kept
    if not kept:
        return fold(line, newline)
    return kept + fold(" " + rest, newline)


def without_own_part(data: str | bytes) -> str:
    """An object's text with gpuresa's part removed, unfolded, line breaks made plain:
    two objects that differ only by what `write_block` writes give the same text."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    out: list[str] = []
    for prop in _properties(text):
        name = prop.name
        if name in OWN_PROPERTIES:
            continue
        line = prop.unfolded
        if name == "DESCRIPTION":
            value = strip_escaped(prop.value)
            if not value:
                continue  # a DESCRIPTION gpuresa added to an event that had none
            line = line[: len(line) - len(prop.value)] + value
        out.append(line)
    return "\n".join(out) + "\n"
