"""A released or preempted booking stays done for as long as the journal keeps it.

`Remembered.memory` against a real journal: the note survives the booking's absence
from the calendars (a cancel then an undo, an edit that made it invalid for a while),
and goes once the journal no longer holds the booking's state.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpuresa.daemon.memory import PREEMPTED, RELEASED, Remembered
from gpuresa.journal.store import Journal

NOW = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)


@pytest.mark.parametrize(("prefix", "field"), [(RELEASED, "released"), (PREEMPTED, "preempted")])
def test_the_note_outlives_the_bookings_absence_and_goes_with_its_state(
    tmp_path: Path, prefix: str, field: str
) -> None:
    journal = Journal(tmp_path / "journal.db")
    try:
        journal.states.set("gone-a-while", "released", NOW)
        journal.facts.set(prefix + "gone-a-while", NOW.isoformat())
        journal.facts.set(prefix + "trimmed", NOW.isoformat())  # no state left for it
        remembered = Remembered.load(journal)
        memory = remembered.memory([], [], {}, NOW, journal)
        assert getattr(memory, field) == frozenset({"gone-a-while"})
        assert set(journal.facts.with_prefix(prefix)) == {"gone-a-while"}
    finally:
        journal.close()
