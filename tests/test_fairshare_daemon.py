"""End to end: the daemon refuses a booking by a fair-share rule and e-mails its user.

A real daemon process reads an ICS folder, journals, and mails through a
real SMTP server; `gpuresa plan` and `gpuresa reservations` beside it show
the same refusal. The bookings lie days ahead: no session is started.
"""

from __future__ import annotations

import contextlib
import json
from datetime import UTC, datetime, time, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

from conftest import TEST_HOST, DockerHarness, SMTPServer
from daemon_stage import DaemonProcess
from support.configs import write_daemon_config
from support.waiting import wait_for
from test_daemon_cli import gpuresa, ics_event

from gpuresa.backends.engines import Runtime
from gpuresa.config.reading import load_config
from gpuresa.errors import UserError
from gpuresa.fairshare.periods import period_name, period_of
from gpuresa.journal.store import Journal


def journal_state(config_file: Path, key: str) -> str | None:
    config = load_config(config_file)
    path = config.daemon.state_dir / "journal.sqlite"
    if not path.exists():
        return None
    try:
        journal = Journal(path, read_only=True)
    except UserError:
        return None  # made, not yet brought to its schema by the starting daemon
    with contextlib.closing(journal):
        return journal.states.get(key)


def test_a_rule_refuses_the_booking_seen_last_and_its_user_is_told(
    tmp_path: Path, docker_harness: DockerHarness, smtp_server: SMTPServer
) -> None:
    config_file = write_daemon_config(
        tmp_path,
        host=TEST_HOST,
        gpus=(0, 1),
        extra=f"""[notify]
enabled = true
smtp_host = "127.0.0.1"
smtp_port = {smtp_server.port}
[users.emails]
alice = "alice@example.org"
[rules]
max_gpu_hours = 6
""",
    )
    runtime = Runtime(load_config(config_file))
    runtime.ensure_image("pytorch", None)
    runtime.ensure_ftp_image()
    day = datetime.combine((datetime.now(UTC) + timedelta(days=3)).date(), time(), tzinfo=UTC)
    calendar = tmp_path / "calendar"
    first_start = day + timedelta(hours=10)
    (calendar / "first.ics").write_text(
        ics_event("fs-first", first_start, first_start + timedelta(hours=4), "alice", "gpus: 1")
    )
    daemon = DaemonProcess(config_file, tmp_path / "daemon.log")
    try:
        wait_for(
            lambda: journal_state(config_file, "fs-first") == "booked", 30, "the first booking"
        )
        # the second starts earlier the same day but is seen later: it is the one refused
        second_start = day + timedelta(hours=6)
        (calendar / "second.ics").write_text(
            ics_event(
                "fs-second", second_start, second_start + timedelta(hours=4), "alice", "gpus: 1"
            )
        )
        week = period_name(period_of(day, "week", UTC), "week", ZoneInfo("UTC"))
        reason = (
            f"rule max_gpu_hours (default): alice has 2 of 6 GPU-hours left in {week}; "
            "this booking asks for 4"
        )
        [mail] = smtp_server.wait_for(1, timeout=30)
        assert "rejected" in str(mail["Subject"]).lower()
        assert mail["To"] == "alice@example.org"
        assert reason in mail.get_content()
        assert journal_state(config_file, "fs-second") == "rejected"
        assert journal_state(config_file, "fs-first") == "booked"

        # the commands weigh the bookings as the daemon does, from its journal
        plan = gpuresa(config_file, "plan")
        assert plan.returncode == 0, plan.stderr
        assert f"refuse fs-second (alice): {reason}" in plan.stdout
        listed = gpuresa(config_file, "reservations", "--json")
        assert listed.returncode == 0, listed.stderr
        report = json.loads(listed.stdout)
        assert [item["key"] for item in report["reservations"]] == ["fs-first"]
        assert {item["key"]: item["reason"] for item in report["rejected"]} == {"fs-second": reason}
    finally:
        daemon.terminate()
