"""How much a poll costs: reading 10,000 events, and what a CalDAV poll asks of the server.

Prints two tables:

1. Parse + expand + validate 10,000 events, a fifth of them recurring, for a
   14-day window: 10 calendars (one per host) of 1,000 CalDAV-style objects
   (one VCALENDAR with its VTIMEZONE each), bookings spread over a year
   around now, series started in the last months. "Cold" reads every object
   for the first time (a daemon's start); "warm" is a later poll, objects
   unchanged and the window moved on (each object is read once, by content).
   Times are the best of several runs (the machine is shared). "With rules"
   is the warm poll with every fair-share limit of [rules] on (each user's
   decision is remembered while their bookings are unchanged).
2. Requests and bytes of a poll against a real Radicale for an unchanged
   calendar, one changed event, and a full listing, with the sync token and
   after the server forgot it.

Run: `.venv/bin/python benchmarks/bench_reservations.py` (or `make bench`).
"""

from __future__ import annotations

import contextlib
import json
import random
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config
from gpuresa.fairshare.check import RuleFacts, apply_rules
from gpuresa.fairshare.ledger import decide_user
from gpuresa.ical import events, text
from gpuresa.ical.window import outside_window
from gpuresa.reservations.catalog import template_variants
from gpuresa.reservations.rules import read_reservations
from gpuresa.reservations.sources.caldav import CalDAVSource

EVENTS = 10_000
HOSTS = 10
RUNS = 5
PARIS_VTIMEZONE = """BEGIN:VTIMEZONE
TZID:Europe/Paris
BEGIN:DAYLIGHT
TZOFFSETFROM:+0100
TZOFFSETTO:+0200
TZNAME:CEST
DTSTART:19700329T020000
RRULE:FREQ=YEARLY;BYMONTH=3;BYDAY=-1SU
END:DAYLIGHT
BEGIN:STANDARD
TZOFFSETFROM:+0200
TZOFFSETTO:+0100
TZNAME:CET
DTSTART:19701025T030000
RRULE:FREQ=YEARLY;BYMONTH=10;BYDAY=-1SU
END:STANDARD
END:VTIMEZONE
"""
RULES = [
    "RRULE:FREQ=WEEKLY;BYDAY=MO,WE;COUNT=30",
    "RRULE:FREQ=WEEKLY;UNTIL={until}\nEXDATE;TZID=Europe/Paris:{exdate}",
    "RRULE:FREQ=DAILY;INTERVAL=2;COUNT=60",
    "RRULE:FREQ=MONTHLY;BYDAY=1TU",
    "RRULE:FREQ=WEEKLY;INTERVAL=2;BYDAY=FR",
]


def calendar_object(
    number: int, start: datetime, hours: int, rule: str | None, randomness: random.Random
) -> bytes:
    """One booking as a CalDAV server stores it: a VCALENDAR with its VTIMEZONE."""
    end = start + timedelta(hours=hours)
    lines = [
        "BEGIN:VCALENDAR",
        "VERSION:2.0",
        "PRODID:-//IDN nextcloud.com//Calendar app 4.7.4//EN",
        PARIS_VTIMEZONE.strip(),
        "BEGIN:VEVENT",
        f"UID:booking-{number:05d}@bench.example.org",
        f"CREATED:{start - timedelta(days=20):%Y%m%dT%H%M%S}Z",
        "DTSTAMP:20260101T000000Z",
        f"DTSTART;TZID=Europe/Paris:{start:%Y%m%dT%H%M%S}",
        f"DTEND;TZID=Europe/Paris:{end:%Y%m%dT%H%M%S}",
        f"SUMMARY:user{randomness.randrange(60):02d}",
        "DESCRIPTION:Training run.\\ntemplate: "
        + randomness.choice(["pytorch", "tensorflow", "digits"])
        + f"\\ngpus: {randomness.choice([1, 1, 2, 2, 4])}",
        "STATUS:CONFIRMED",
        "SEQUENCE:0",
    ]
    if rule is not None:
        until = start + timedelta(days=120)
        exdate = start + timedelta(days=14)
        lines.append(rule.format(until=f"{until:%Y%m%dT%H%M%S}Z", exdate=f"{exdate:%Y%m%dT%H%M%S}"))
    lines += ["END:VEVENT", "END:VCALENDAR", ""]
    return "\r\n".join(lines).replace("\n", "\r\n").replace("\r\r\n", "\r\n").encode()


def corpus(now: datetime) -> dict[str, list[tuple[str, bytes]]]:
    """10 calendars of 1,000 objects; a fifth are series started in the last months."""
    randomness = random.Random(20260310)
    calendars: dict[str, list[tuple[str, bytes]]] = {f"gpu{index}": [] for index in range(HOSTS)}
    local_now = now.replace(tzinfo=None, minute=0, second=0, microsecond=0)
    for number in range(EVENTS):
        recurring = number % 5 == 0
        if recurring:
            start = local_now - timedelta(days=randomness.randrange(0, 300))
            rule: str | None = randomness.choice(RULES)
        else:
            start = local_now + timedelta(days=randomness.randrange(-183, 183))
            rule = None
        start = start.replace(hour=randomness.randrange(7, 20))
        hours = randomness.choice([2, 3, 4, 8])
        host = f"gpu{number % HOSTS}"
        calendars[host].append(
            (f"booking-{number:05d}.ics", calendar_object(number, start, hours, rule, randomness))
        )
    return calendars


# fair-share rules for the "with rules" row: every limit, a group of a third of the users
BENCH_RULES: dict[str, Any] = {
    "max_gpus": 8,
    "max_gpu_hours": 400,
    "max_ahead": "30d",
    "max_bookings": 40,
    "min_gap": "5m",
    "max_duration": "1d",
    "groups": {"students": {"members": [f"user{index:02d}" for index in range(0, 60, 3)],
                            "max_gpu_hours": 200, "max_gpus": 4}},
}  # fmt: skip


def bench_config(rules: dict[str, Any] | None = None) -> Config:
    return parse_config(
        {
            "daemon": {"host": "gpu0"},
            "reservations": {"timezone": "Europe/Paris"},
            "hosts": [{"name": f"gpu{index}", "gpus": list(range(8))} for index in range(HOSTS)],
            "calendars": [
                {"name": f"gpu{index}", "url": f"/bench/gpu{index}", "kind": "ics",
                 "host": f"gpu{index}"}
                for index in range(HOSTS)
            ],
            "rules": rules or {},
        }
    )  # fmt: skip


def best_of(
    runs: int, work: Callable[[], Any], before: Callable[[], None] | None = None
) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each run; CPU time is what the machine's other load leaves alone."""
    durations = []
    for _ in range(runs):
        if before is not None:
            before()
        began, began_cpu = time.perf_counter(), time.process_time()
        work()
        durations.append((time.perf_counter() - began, time.process_time() - began_cpu))
    return durations


def reading_table() -> None:
    config = bench_config()
    variants = template_variants(config)
    now = datetime(2026, 3, 10, 12, tzinfo=UTC)
    calendars = corpus(now)
    window = (now - timedelta(days=1), now + timedelta(days=14))
    site = ZoneInfo("Europe/Paris")

    def read_all(start: datetime, end: datetime) -> Any:
        return read_reservations(config, calendars, start, end, variants=variants)

    def parse_every_object() -> None:
        # the reader's raw throughput: every object, none passed over
        for objects in calendars.values():
            for _, data in objects:
                text.parse_object(data)

    def expand_only() -> None:
        for objects in calendars.values():
            parsed = [(href, text.parse_object(data)) for href, data in objects]
            events.expand(parsed, *window, site)

    result = read_all(*window)
    occurrences = sum(
        len(events.expand([(h, text.parse_object(d)) for h, d in objects], *window, site)[0])
        for objects in calendars.values()
    )
    passed_over = sum(
        outside_window(data, *window) is not None
        for objects in calendars.values()
        for _, data in objects
    )
    clear = text.parse_object.cache_clear
    cold = best_of(RUNS, lambda: read_all(*window), clear)
    moves = iter(range(1, 100))

    def warm_poll() -> None:
        # a later poll: same objects, the window 30 s further on
        shift = timedelta(seconds=30 * next(moves))
        read_all(window[0] + shift, window[1] + shift)

    warm = best_of(RUNS, warm_poll)
    # the same warm poll with every fair-share limit on, as the daemon reads: each booking
    # first seen a day before the poll, none holding a session
    ruled = bench_config(BENCH_RULES)
    seen = {item.key: now - timedelta(days=1) for item in result.reservations}

    def warm_poll_with_rules() -> None:
        shift = timedelta(seconds=30 * next(moves))
        read_reservations(
            ruled,
            calendars,
            window[0] + shift,
            window[1] + shift,
            variants=variants,
            first_seen=seen,
            rule_facts=RuleFacts(now + shift),
        )

    with_rules = best_of(RUNS, warm_poll_with_rules)

    def rules_only() -> None:
        apply_rules(result.reservations, ruled.rules, RuleFacts(now), site, first_seen=seen)

    # each user's answer is remembered while their bookings stay as they were (a later poll)
    rules_first = best_of(RUNS, rules_only, decide_user.cache_clear)
    rules_again = best_of(RUNS, rules_only)
    _, refused = apply_rules(
        result.reservations, ruled.rules, RuleFacts(now), site, first_seen=seen
    )
    parse = best_of(RUNS, parse_every_object, clear)
    expand_time = best_of(RUNS, expand_only)
    print(
        f"Reading {EVENTS:,} events ({EVENTS // 5:,} recurring) in {HOSTS} calendars for a "
        f"15-day window: {passed_over:,} objects passed over unread (single events far from "
        f"the window), {occurrences:,} occurrences, {len(result.reservations):,} reservations, "
        f"{len(result.rejected):,} rejected (over-booking)"
    )
    rows = [
        ("cold: read + expand + validate + conflicts", cold, "target < 1 s"),
        ("warm poll: objects unchanged, window moved on", warm, ""),
        ("warm poll with rules (every limit, a group)", with_rules, ""),
        (
            f"  the rules alone, {len(result.reservations)} bookings, first time",
            rules_first,
            f"{len(refused):,} refused",
        ),
        ("  the rules alone, the same bookings again", rules_again, ""),
        ("  parse all 10,000 objects (none passed over)", parse, ""),
        ("  expand all 10,000 objects (already read)", expand_time, ""),
    ]
    print(f"  {'step':<50} {'wall best':>10} {'median':>8} {'CPU best':>9}")
    for label, durations, note in rows:
        walls = [wall for wall, _ in durations]
        cpus = [cpu for _, cpu in durations]
        print(
            f"  {label:<50} {min(walls):9.3f}s {statistics.median(walls):7.3f}s "
            f"{min(cpus):8.3f}s  {note}"
        )


# --- CalDAV against a real Radicale -------------------------------------------------------------


@contextlib.contextmanager
def radicale(directory: Path) -> Iterator[tuple[str, str, Path, Path]]:
    """A Radicale server with one user; yields (base URL, user, password file, storage)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    user, password = "bench", secrets.token_urlsafe(12)
    (directory / "users").write_text(f"{user}:{password}\n")
    (directory / "password").write_text(password + "\n")
    storage = directory / "collections"
    (directory / "config").write_text(
        f"[server]\nhosts = 127.0.0.1:{port}\n[auth]\ntype = htpasswd\n"
        f"htpasswd_filename = {directory / 'users'}\nhtpasswd_encryption = plain\n"
        f"[storage]\nfilesystem_folder = {storage}\n[logging]\nlevel = warning\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "radicale", "--config", str(directory / "config")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
                break
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/", user, directory / "password", storage
    finally:
        process.terminate()
        process.wait(10)


def caldav_table(objects: int = 500) -> None:
    now = datetime(2026, 3, 10, 12, tzinfo=UTC)
    sample = corpus(now)["gpu0"][:objects]
    with tempfile.TemporaryDirectory(prefix="gpuresa-bench-") as folder:
        root = Path(folder)
        with radicale(root) as (url, user, password_file, storage):
            # the calendar's objects go straight into Radicale's storage, as its PUTs would
            collection = storage / "collection-root" / user / "gpu0"
            collection.mkdir(parents=True)
            (collection / ".Radicale.props").write_text(json.dumps({"tag": "VCALENDAR"}))
            for name, data in sample:
                (collection / name).write_bytes(data)
            calendar_url = f"{url}{user}/gpu0/"
            config = parse_config(
                {
                    "calendars": [
                        {"name": "gpu0", "url": calendar_url, "username": user,
                         "password_file": str(password_file)}
                    ]
                }
            )  # fmt: skip
            # Radicale builds its own item cache on first use: do that before measuring, as
            # a server that has been running would have it
            import requests

            requests.request(
                "PROPFIND",
                calendar_url,
                headers={"Depth": "1"},
                auth=(user, password_file.read_text().strip()),
                timeout=600,
            )
            source = CalDAVSource(config.calendars[0], root / "state", timeout=600)
            rows = []

            def poll(label: str) -> None:
                began = time.perf_counter()
                result = source.poll()
                rows.append((label, result.requests, result.bytes_received,
                             time.perf_counter() - began))  # fmt: skip

            poll(f"full listing ({objects} objects, first poll)")
            poll("unchanged calendar (sync token)")
            name, data = sample[0]
            (collection / name).write_bytes(data.replace(b"SEQUENCE:0", b"SEQUENCE:1"))
            poll("one changed event (sync token)")
            poll("unchanged calendar again")
            shutil.rmtree(collection / ".Radicale.cache" / "sync-token")
            (collection / name).write_bytes(data.replace(b"SEQUENCE:0", b"SEQUENCE:2"))
            poll("one changed event, token expired (listing + ETags)")
    print(f"\nCalDAV polls against Radicale ({objects} objects of about {len(sample[0][1])} bytes)")
    print(f"  {'poll':<52} {'requests':>8} {'bytes':>10} {'time':>8}")
    for label, count, received, duration in rows:
        print(f"  {label:<52} {count:>8} {received:>10,} {duration:7.3f}s")


if __name__ == "__main__":
    reading_table()
    caldav_table()
