"""Cost of `gpuresa report` on a generated year: 100 users, 10 hosts of 8 GPUs.

One journal holds every host's year (ten daemons' journals in one file: the
worst case for the queries, which must skip the other hosts' rows), with what
a daemon writes for each booking: the reservation, its state changes (booked,
preparing, running, warned, stopping, ended or cancelled), its start action,
and, in the usage store, its telemetry. Each user books about once per working
day (1-4 GPUs, 1-8 hours); 5 % of the bookings are cancelled, 5 % refused.

Timed (median of `--runs`, each reading both files afresh and computing the
report, as `gpuresa report` does after its start-up): a week, a month and the
year of one host, by user, group, host and GPU; and the year of all ten hosts
(ten reports, one per host, as each host's daemon would make).
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpuresa.gpus.usage_store import USAGE_FILE, UsageStore
from gpuresa.journal.store import Journal
from gpuresa.journal.times import to_text
from gpuresa.reports.reading import read_facts
from gpuresa.reports.usage import By, Period, usage_report

USERS, HOSTS, GPUS = 100, 10, 8
YEAR_START = datetime(2025, 1, 6, tzinfo=UTC)  # a Monday
DAYS = 364
REASONS = (
    "overlaps another booking on host gpu1 from 2025-03-02 09:00 UTC which was booked first",
    "rule max_gpu_hours (group students): alice has 2 of 40 GPU-hours left this week",
    "unknown template 'tf' (templates: pytorch)",
    "it lasts 30d, longer than the site's maximum of 14d",
)


def generate(state: Path, seed: int = 7) -> dict[str, int]:
    """Write the year's journal and usage store under `state`; the row counts."""
    rng = random.Random(seed)
    Journal(state / "journal.sqlite").close()  # the schema, as the daemon makes it
    UsageStore(state / USAGE_FILE).close()
    reservations, states, rejections, usage = [], [], [], []
    events: list[tuple[str, str, str, str, str | None, str | None]] = []
    groups = {f"user{n:03}": f"group{n % 8}" for n in range(USERS)}
    for day in range(DAYS):
        if day % 7 >= 5:
            continue  # weekends: nobody books
        for user in groups:
            if rng.random() > 0.9:
                continue
            host = f"gpu{rng.randrange(HOSTS)}"
            key = f"{user}-{day}"
            gpus = rng.choice((1, 1, 2, 4))
            start = YEAR_START + timedelta(days=day, hours=rng.randrange(7, 18))
            end = start + timedelta(hours=rng.randrange(1, 9))
            seen = to_text(start - timedelta(days=2))
            if rng.random() < 0.05:
                reason = rng.choice(REASONS)
                row = (key, key, host, reason, user, to_text(start), to_text(end), seen, seen, seen)
                rejections.append(row)
                continue
            times = (to_text(start), to_text(end), seen, seen)
            reservations.append((key, key, host, host, user, "pytorch", gpus, *times))
            changes = [("booked", start - timedelta(days=2))]
            if rng.random() < 0.05:
                changes.append(("cancelled", start - timedelta(hours=5)))
            else:
                indices = rng.sample(range(GPUS), gpus)
                description = f"start {key} for {user} (GPUs {indices}, ssh 2201, ftp 2301)"
                events.append((key, to_text(start), "action", description, None, "ok"))
                changes += [
                    ("preparing", start - timedelta(minutes=5)),
                    ("running", start),
                    ("warned", end - timedelta(minutes=15)),
                    ("stopping", end),
                    ("ended", end + timedelta(seconds=20)),
                ]
                mean = rng.choice((0.0, rng.uniform(5, 100), rng.uniform(40, 100)))
                samples = int((end - start).total_seconds() // 60)
                span = (to_text(start), to_text(end))
                usage.append((key, user, *span, samples, mean * samples, 0.0, span[1]))
            previous = None
            for name, instant in changes:
                events.append((key, to_text(instant), "state", name, previous, None))
                previous = name
            states.append((key, changes[-1][0], to_text(changes[-1][1])))
    with sqlite3.connect(state / "journal.sqlite") as connection:
        connection.executemany(
            "INSERT INTO reservations (key, uid, calendar, host, user, template, gpus, start_at, "
            "end_at, first_seen, last_seen) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            reservations,
        )
        connection.executemany(
            "INSERT INTO events (key, at, kind, name, previous, result) VALUES (?, ?, ?, ?, ?, ?)",
            events,
        )
        connection.executemany("INSERT INTO states (key, state, since) VALUES (?, ?, ?)", states)
        connection.executemany(
            "INSERT INTO rejections (key, uid, calendar, reason, user, start_at, end_at, "
            "first_seen, last_seen, reason_since) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            rejections,
        )
    connection.close()
    with sqlite3.connect(state / USAGE_FILE) as connection:
        connection.executemany(
            "INSERT INTO usage (key, user, first, last, samples, utilization_sum, memory_sum, "
            "ended) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            usage,
        )
    connection.close()
    return {
        "bookings": len(reservations),
        "events": len(events),
        "refusals": len(rejections),
        "sessions with telemetry": len(usage),
    }


def timed(
    state: Path, period: Period, by: By, hosts: list[str], runs: int
) -> tuple[float, float, int]:
    """The median wall and CPU seconds of the reports of `hosts` over `period`, and the rows
    of the last (CPU time is steadier on a machine shared with other work)."""
    calendars = {f"gpu{n}": f"gpu{n}" for n in range(HOSTS)}

    def group_of(user: str) -> str:
        return f"group{int(user[4:]) % 8}"

    walls, cpus, rows = [], [], 0
    for _ in range(runs):
        began, began_cpu = time.perf_counter(), time.process_time()
        for host in hosts:
            facts = read_facts(
                state / "journal.sqlite", state / USAGE_FILE, period, host, calendars
            )
            report = usage_report(facts, period, by, group_of, period.end)
            rows = len(report.rows)
        walls.append(time.perf_counter() - began)
        cpus.append(time.process_time() - began_cpu)
    return statistics.median(walls), statistics.median(cpus), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuresa-bench-report-") as folder:
        state = Path(folder)
        began = time.perf_counter()
        counts = generate(state)
        listing = ", ".join(f"{count} {name}" for name, count in counts.items())
        print(f"generated in {time.perf_counter() - began:.1f} s: {listing}")
        size = (state / "journal.sqlite").stat().st_size + (state / USAGE_FILE).stat().st_size
        print(f"journal and usage store: {size / 2**20:.1f} MiB\n")
        middle = YEAR_START + timedelta(days=182)
        periods = {
            "a week": Period(middle, middle + timedelta(days=7)),
            "a month": Period(middle, middle + timedelta(days=30)),
            "the year": Period(YEAR_START, YEAR_START + timedelta(days=DAYS)),
        }
        print("| period | hosts | by | rows | median time (ms) | CPU (ms) |")
        print("| --- | --- | --- | --- | --- | --- |")
        ways: tuple[By, ...] = ("user", "group", "host", "gpu")
        for name, period in periods.items():
            for by in ways:
                wall, cpu, rows = timed(state, period, by, ["gpu0"], arguments.runs)
                print(f"| {name} | 1 | {by} | {rows} | {wall * 1000:.1f} | {cpu * 1000:.1f} |")
        every = [f"gpu{n}" for n in range(HOSTS)]
        wall, cpu, rows = timed(state, periods["the year"], "user", every, arguments.runs)
        print(
            f"| the year | {HOSTS} (one report each) | user | {rows} | {wall * 1000:.1f} "
            f"| {cpu * 1000:.1f} |"
        )


if __name__ == "__main__":
    main()
