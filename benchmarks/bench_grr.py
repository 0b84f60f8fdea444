"""What polling a GRR database costs: an unchanged poll, and a poll that reads 10,000 rows.

Makes a database with GRR's tables on `make setup`'s MariaDB (removed at the
end), fills one room with `--rows` bookings inside the daemon's window and as
many outside it, and prints a table: time, queries and bytes of an unchanged
poll (the median of `--runs`), of a poll that reads every row of the window,
and of reading those rows into reservations.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from grr_database import GRRDatabase

from gpuresa.config.reading import parse_config
from gpuresa.reservations.rules import read_reservations
from gpuresa.reservations.sources import open_source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=20)
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        database = GRRDatabase.create(Path(directory))
        try:
            run(database, Path(directory), arguments.rows, arguments.runs)
        finally:
            database.drop()


def run(database: GRRDatabase, directory: Path, rows: int, runs: int) -> None:
    room = database.add_room("GPU 1", database.add_area("GPU"))
    database.add_user("alice", "alice@example.org")
    now = datetime.now(UTC).replace(microsecond=0)
    ahead = timedelta(days=14)
    step = ahead / rows
    values = []
    for number in range(rows):
        inside = now + number * step
        outside = now + timedelta(days=30) + number * step  # not read: outside the window
        for start in (inside, outside):
            values.append(
                (int(start.timestamp()), int((start + step).timestamp()), room,
                 "ALICE", "ALICE", "template: pytorch\ngpus: 1")
            )  # fmt: skip
    database.execute("SET SESSION unique_checks = 0")
    cursor = database.execute("SELECT 1")
    cursor.executemany(
        f"INSERT INTO `{database.name}`.{database.prefix}entry (start_time, end_time, room_id, "
        "create_by, beneficiaire, description) VALUES (%s, %s, %s, %s, %s, %s)",
        values,
    )
    time.sleep(2.1)  # the rows' stamps settle (one second's resolution)
    config = parse_config(
        {
            "daemon": {"host": "gpu1"},
            "hosts": [{"name": "gpu1", "gpus": [0, 1, 2, 3]}],
            "calendars": [database.calendar({"GPU 1": "gpu1"})],
        }
    )
    source = open_source(config.calendars[0], directory / "state")
    began = time.perf_counter()
    full = source.poll(now)
    full_seconds = time.perf_counter() - began
    began = time.perf_counter()
    found = read_reservations(
        config,
        {"grr": list(full.objects.items())},
        now - timedelta(days=1),
        now + ahead,
        variants={"pytorch": ("12.4",)},
    )
    read_seconds = time.perf_counter() - began
    unchanged = []
    for run_number in range(runs):
        began = time.perf_counter()
        result = source.poll(now + timedelta(seconds=run_number))
        unchanged.append(time.perf_counter() - began)
        assert not result.changed and result.requests == 1
    print(f"GRR database: {rows} rows in the window, {rows} more outside it (MariaDB, socket)")
    print(f"{'poll':<40} {'time':>10} {'queries':>8} {'bytes':>11}")
    print(
        f"{'unchanged (median of ' + str(runs) + ')':<40} "
        f"{statistics.median(unchanged) * 1000:>8.2f}ms {1:>8} {0:>11}"
    )
    print(
        f"{'changed: reads the window':<40} {full_seconds * 1000:>8.0f}ms "
        f"{full.requests:>8} {full.bytes_received:>11}"
    )
    print(
        f"{'rows to reservations (read_reservations)':<40} {read_seconds * 1000:>8.0f}ms "
        f"{'-':>8} {'-':>11}"
    )
    print(f"objects read: {len(full.objects)}; reservations: {len(found.reservations)}")


if __name__ == "__main__":
    main()
