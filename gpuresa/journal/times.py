"""Instants in the journal: fixed-width ISO 8601 text in UTC, so they sort as text."""

from __future__ import annotations

from datetime import UTC, datetime


def to_text(instant: datetime) -> str:
    """`instant` as fixed-width ISO 8601 in UTC; raises ValueError for a naive datetime."""
    if instant.tzinfo is None or instant.utcoffset() is None:
        raise ValueError(f"naive datetime {instant.isoformat()} (the journal stores aware UTC)")
    return instant.astimezone(UTC).isoformat(timespec="microseconds")


def from_text(text: str) -> datetime:
    """A stored instant back as an aware UTC datetime."""
    instant = datetime.fromisoformat(text)
    if instant.tzinfo is None:
        # written by hand or by an older tool: the journal only holds UTC
        return instant.replace(tzinfo=UTC)
    return instant.astimezone(UTC)


def optional_text(instant: datetime | None) -> str | None:
    return None if instant is None else to_text(instant)


def optional_time(text: str | None) -> datetime | None:
    return None if text is None else from_text(text)
