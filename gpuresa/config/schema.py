"""Turn parsed TOML into frozen dataclasses, collecting every problem with its key path.

The schema is the dataclasses themselves: each field's type says how its value
is read (see `convert`), `field(metadata=...)` adds a description or a check.
Adding a config section is therefore a new dataclass and one field on its
parent; nothing here changes.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections import abc
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")

Check = Callable[[Any], "str | None"]

_DURATION_PART = re.compile(r"(\d+)\s*([smhdw])")
_DURATION_WHOLE = re.compile(r"^\s*(\d+\s*[smhdw]\s*)+$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class Invalid(Exception):
    """A value that cannot be read; the message says what was expected."""


@dataclasses.dataclass(frozen=True, order=True)
class PortRange:
    """An inclusive range of TCP ports, written "20000-20999" in the config."""

    first: int
    last: int

    def __iter__(self) -> typing.Iterator[int]:
        return iter(range(self.first, self.last + 1))

    def __len__(self) -> int:
        return self.last - self.first + 1

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.first <= port <= self.last

    def overlaps(self, other: PortRange) -> bool:
        return self.first <= other.last and other.first <= self.last

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"


_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


@dataclasses.dataclass(frozen=True, order=True)
class Size:
    """A number of bytes, written "8g", "512m" or "1048576" in the config."""

    bytes: int

    def __str__(self) -> str:
        for unit in ("t", "g", "m", "k"):
            if self.bytes and self.bytes % _SIZE_UNITS[unit] == 0:
                return f"{self.bytes // _SIZE_UNITS[unit]}{unit}"
        return str(self.bytes)


@dataclasses.dataclass(frozen=True, order=True)
class Share:
    """A fraction of a whole (0 to 1), written "10%" in the config."""

    fraction: float

    def of(self, whole: float) -> float:
        return whole * self.fraction

    def __str__(self) -> str:
        return f"{self.fraction * 100:g}%"


def parse_size(value: object) -> Size:
    """Read "8g", "512m", "1024" (bytes) or a bare integer of bytes; raises `Invalid`."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    text = value.lower() if isinstance(value, str) else ""
    match = re.fullmatch(r"\s*(\d+)\s*([bkmgt]?)\s*", text)
    if not match:
        raise Invalid(f'expected a size such as "8g" or "512m", got {value!r}')
    return Size(int(match.group(1)) * _SIZE_UNITS[match.group(2)])


def parse_share(value: object) -> Share:
    """Read "10%" or "2.5%" (0 to 100); raises `Invalid`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*%\s*", value) if isinstance(value, str) else None
    if not match or float(match.group(1)) > 100:
        raise Invalid(f'expected a share such as "10%" (0 to 100%), got {value!r}')
    return Share(float(match.group(1)) / 100)


def parse_duration(text: str) -> timedelta:
    """Read "30s", "15m", "2h", "1d", "1w" or combinations such as "1h30m".

    Raises `Invalid` for anything else, including a bare number (the unit is
    never guessed).
    """
    if not isinstance(text, str) or not _DURATION_WHOLE.match(text):
        raise Invalid(f'expected a duration such as "30s", "15m", "2h" or "1d", got {text!r}')
    seconds = sum(
        int(amount) * _UNIT_SECONDS[unit] for amount, unit in _DURATION_PART.findall(text)
    )
    return timedelta(seconds=seconds)


def format_duration(value: timedelta) -> str:
    """The shortest config spelling of a duration ("90s" -> "1m30s")."""
    seconds = int(value.total_seconds())
    if seconds == 0:
        return "0s"
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        amount, seconds = divmod(seconds, size)
        if amount:
            parts.append(f"{amount}{unit}")
    return "".join(parts)


def parse_port_range(text: object) -> PortRange:
    """Read "20000-20999" (or a single port "22000") into a `PortRange`."""
    if isinstance(text, int) and not isinstance(text, bool):
        text = str(text)
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text) if isinstance(text, str) else None
    if not match:
        raise Invalid(f'expected a port range such as "20000-20999", got {text!r}')
    first = int(match.group(1))
    last = int(match.group(2) or first)
    if not (1 <= first <= last <= 65535):
        raise Invalid(f"expected ports from 1 to 65535 with first <= last, got {text!r}")
    return PortRange(first, last)


def describe(kind: Any) -> str:
    """A short human name for a schema type, used in error messages."""
    origin = get_origin(kind)
    if kind is str:
        return "a string"
    if kind is bool:
        return "true or false"
    if kind is int:
        return "an integer"
    if kind is float:
        return "a number"
    if kind is timedelta:
        return 'a duration such as "30s"'
    if kind is Path:
        return "an absolute path"
    if kind is PortRange:
        return 'a port range such as "20000-20999"'
    if kind is Size:
        return 'a size such as "8g"'
    if kind is Share:
        return 'a share such as "10%"'
    if origin is Literal:
        return " or ".join(repr(choice) for choice in get_args(kind))
    if origin is tuple:
        return f"a list of {describe(get_args(kind)[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin in (dict, abc.Mapping):
        return "a table"
    if dataclasses.is_dataclass(kind):
        return "a table"
    if origin in (Union, types.UnionType):
        return " or ".join(describe(arg) for arg in get_args(kind) if arg is not type(None))
    return str(kind)


class Loader:
    """Reads one document into a dataclass tree and keeps every problem it finds."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def problem(self, path: str, message: str) -> None:
        self.problems.append(f"{path}: {message}" if path else message)

    def load(self, cls: type[T], data: Any, path: str = "") -> T | None:
        """Build `cls` from a table; returns None (with problems recorded) when it cannot."""
        if not isinstance(data, Mapping):
            self.problem(path, f"expected a table, got {data!r}")
            return None
        hints = get_type_hints(cls)
        schema: Any = cls
        fields = {field.name: field for field in dataclasses.fields(schema) if field.init}
        for key in data:
            if key not in fields:
                known = ", ".join(sorted(fields))
                self.problem(_join(path, key), f"unknown key (known keys here: {known})")
        values: dict[str, Any] = {}
        failed = False
        for name, field in fields.items():
            key_path = _join(path, name)
            if name not in data:
                if (
                    field.default is dataclasses.MISSING
                    and field.default_factory is dataclasses.MISSING
                ):
                    self.problem(key_path, f"missing; expected {describe(hints[name])}")
                    failed = True
                continue
            try:
                value = self.convert(hints[name], data[name], key_path)
            except _AlreadyReported:
                failed = True
                continue
            except Invalid as error:
                expected = field.metadata.get("expected")
                message = f"expected {expected}, got {data[name]!r}" if expected else str(error)
                self.problem(key_path, message)
                failed = True
                continue
            check: Check | None = field.metadata.get("check")
            if check is not None:
                complaint = check(value)
                if complaint:
                    self.problem(key_path, complaint)
                    failed = True
                    continue
            values[name] = value
        if failed:
            return None
        return cls(**values)

    def convert(self, kind: Any, value: Any, path: str) -> Any:
        """Convert one TOML value to `kind`; raises `Invalid` with what was expected."""
        origin = get_origin(kind)
        if kind in (PortRange, Size, Share):
            # values of their own written as strings, not tables
            return _convert_scalar(kind, value)
        if dataclasses.is_dataclass(kind):
            built: object = self.load(typing.cast(type, kind), value, path)
            if built is None:
                # the nested problems are already recorded with their own paths
                raise _AlreadyReported()
            return built
        if origin in (Union, types.UnionType):
            alternatives = [arg for arg in get_args(kind) if arg is not type(None)]
            for alternative in alternatives:
                try:
                    return self.convert(alternative, value, path)
                except Invalid:
                    continue
            raise Invalid(f"expected {describe(kind)}, got {value!r}")
        if origin is Literal:
            if value in get_args(kind):
                return value
            raise Invalid(f"expected {describe(kind)}, got {value!r}")
        if origin is tuple:
            item_kind = get_args(kind)[0]
            if not isinstance(value, list):
                raise Invalid(f"expected {describe(kind)}, got {value!r}")
            items = []
            failed = False
            for index, item in enumerate(value):
                try:
                    items.append(self.convert(item_kind, item, f"{path}[{index}]"))
                except _AlreadyReported:
                    failed = True
                except Invalid as error:
                    self.problem(f"{path}[{index}]", str(error))
                    failed = True
            if failed:
                raise _AlreadyReported()
            return tuple(items)
        if origin in (dict, abc.Mapping):
            value_kind = get_args(kind)[1]
            if not isinstance(value, Mapping):
                raise Invalid(f"expected a table, got {value!r}")
            entries = {}
            failed = False
            for key, item in value.items():
                try:
                    entries[str(key)] = self.convert(value_kind, item, _join(path, str(key)))
                except _AlreadyReported:
                    failed = True
                except Invalid as error:
                    self.problem(_join(path, str(key)), str(error))
                    failed = True
            if failed:
                raise _AlreadyReported()
            return types.MappingProxyType(entries)
        return _convert_scalar(kind, value)


class _AlreadyReported(Invalid):
    """A nested value failed and recorded its own problems already."""


def _convert_scalar(kind: Any, value: Any) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif kind is str:
        if isinstance(value, str):
            return value
    elif kind is timedelta:
        return parse_duration(value)
    elif kind is Path:
        if isinstance(value, str) and value.startswith("/"):
            return Path(value)
        raise Invalid(f"expected an absolute path (starting with /), got {value!r}")
    elif kind is PortRange:
        return parse_port_range(value)
    elif kind is Size:
        return parse_size(value)
    elif kind is Share:
        return parse_share(value)
    else:  # pragma: no cover - a schema bug, not a config problem
        raise TypeError(f"unsupported schema type {kind!r}")
    raise Invalid(f"expected {describe(kind)}, got {value!r}")


def _join(path: str, key: str) -> str:
    if not path:
        return key
    if re.fullmatch(r"[A-Za-z0-9_-]+", key):
        return f"{path}.{key}"
    return f"{path}.{key!r}"


def Field(
    default: Any = dataclasses.MISSING,
    *,
    check: Check | None = None,
    expected: str | None = None,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A dataclass field with an optional check and an "expected ..." phrase for errors."""
    metadata: dict[str, Any] = {}
    if check is not None:
        metadata["check"] = check
    if expected is not None:
        metadata["expected"] = expected
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def at_least(minimum: float) -> Check:
    """A check that a number is >= minimum."""

    def check(value: Any) -> str | None:
        return None if value >= minimum else f"must be at least {minimum}, got {value!r}"

    return check


def positive_duration(value: timedelta) -> str | None:
    return None if value > timedelta(0) else "must be longer than 0s"


def positive_or_unset(value: timedelta | None) -> str | None:
    """A duration longer than 0s, or unset (a feature left off)."""
    return None if value is None else positive_duration(value)


def matches(pattern: str, what: str) -> Check:
    """A check that a string fully matches a regular expression."""
    compiled = re.compile(pattern)

    def check(value: Any) -> str | None:
        if isinstance(value, str) and compiled.fullmatch(value):
            return None
        return f"expected {what}, got {value!r}"

    return check


def valid_regex(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        re.compile(value)
    except re.error as error:
        return f"not a valid regular expression: {error}"
    return None
