"""Calendar text is inert wherever gpuresa shows it: logs, CLI, JSON, e-mail, page, metrics.

Each route gets the same hostile text: a terminal-clearing escape sequence, a
right-to-left override, a line break followed by a forged journald priority, a
carriage return and a NUL.
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from conftest import SMTPServer
from prometheus_client import generate_latest
from test_notify import REJECTION, notifier_for
from test_observe import RECORDED, reservation, session
from test_reservations import booking, event, make_config, seen, write_config

from gpuresa import cli
from gpuresa.commands import daemon_commands
from gpuresa.gpus.readings import GpuSnapshot
from gpuresa.inert import inert, inert_lines
from gpuresa.logs import InertFormatter, JournalFormatter, setup_logging
from gpuresa.mail.notices import rejection_message
from gpuresa.model import Rejection
from gpuresa.observe.metrics import registry_for
from gpuresa.observe.page import render_page
from gpuresa.observe.state import CalendarView, build_state
from gpuresa.reservations.conflicts import resolve_conflicts

HOSTILE = "evil\x1b[2J\u202egpj.exe\n<2>gpuresa.runtime: bob-booking: stopped\rX\x00\u2028Y\u200b"
# what must never appear raw in any output
FORBIDDEN = ("\x1b", "\u202e", "\r", "\x00", "\u2028", "\u200b")


def assert_inert(text: str, *, lines_allowed: bool = True) -> None:
    for character in FORBIDDEN:
        assert character not in text, f"{character!r} shown raw"
    if not lines_allowed:
        assert "\n" not in text
    for line in text.split("\n"):
        assert not line.lstrip().startswith("<2>"), f"forged line: {line!r}"


# --- the helper ---------------------------------------------------------------------------


def test_inert_escapes_every_control_format_and_separator_character() -> None:
    shown = inert(HOSTILE)
    assert_inert(shown, lines_allowed=False)
    assert shown == (
        "evil\\x1b[2J\\u202egpj.exe\\x0a<2>gpuresa.runtime: bob-booking: stopped\\x0dX\\x00"
        "\\u2028Y\\u200b"
    )
    # visible text of any script is kept as it is
    assert inert("modèle «pytörch» — 日本語 🚀 alice") == "modèle «pytörch» — 日本語 🚀 alice"
    assert inert("\U000e0001") == "\\U000e0001"  # a tag character (Cf) outside the BMP
    assert inert_lines(f"a\n{HOSTILE}\tb").split("\n")[0] == "a"


# --- logs ---------------------------------------------------------------------------------


def formatted(formatter: logging.Formatter, *args: object, error: bool = False) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    logger = logging.getLogger("gpuresa.test.inert")
    logger.handlers[:] = [handler]
    logger.propagate = False
    try:
        if error:
            try:
                raise ValueError(f"bad event {HOSTILE}")
            except ValueError:
                logger.exception("reading %s failed", *args)
        else:
            logger.warning("%s: %r ignored", *args)
    finally:
        logger.handlers[:] = []
        logger.propagate = True
    return stream.getvalue()


def test_a_log_record_under_journald_is_one_line_with_our_priority() -> None:
    text = formatted(JournalFormatter("%(name)s: %(message)s"), f"cal/{HOSTILE}.ics", HOSTILE)
    assert_inert(text)
    assert text.count("\n") == 1  # the handler's own terminator only
    assert text.startswith("<4>gpuresa.test.inert: cal/evil\\x1b[2J")


def test_a_traceback_under_journald_keeps_our_priority_on_every_line() -> None:
    text = formatted(JournalFormatter("%(name)s: %(message)s"), HOSTILE, error=True)
    assert_inert(text)
    lines = text.rstrip("\n").split("\n")
    assert len(lines) > 3
    assert all(line.startswith("<3>") for line in lines), lines
    assert "ValueError: bad event evil\\x1b[2J" in lines[-1]


def test_a_log_record_on_a_terminal_has_no_raw_control_character() -> None:
    text = formatted(InertFormatter("%(levelname)s %(name)s: %(message)s"), HOSTILE, HOSTILE)
    assert_inert(text)
    assert text.count("\n") == 1


def logged(formatter: logging.Formatter, message: str, *args: object) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    logger = logging.getLogger("gpuresa.test.lines")
    logger.handlers[:] = [handler]
    logger.propagate = False
    try:
        logger.error(message, *args)
    finally:
        logger.handlers[:] = []
        logger.propagate = True
    return stream.getvalue()


def test_a_message_gpuresa_writes_on_several_lines_keeps_them_readable() -> None:
    """An error it raises (a build's last lines, a config's problems) is not one line of
    \\x0a escapes; every line after the first is marked as the record's continuation."""
    error = RuntimeError("Docker could not build pytorch:\nStep 1/4 : FROM base\nno space left")
    text = logged(JournalFormatter("%(name)s: %(message)s"), "start of %s failed: %s", "k1", error)
    assert text.split("\n")[:-1] == [
        "<3>gpuresa.test.lines: start of k1 failed: Docker could not build pytorch:",
        "<3>  | Step 1/4 : FROM base",
        "<3>  | no space left",
    ]
    assert "\\x0a" not in text
    terminal = logged(InertFormatter("%(levelname)s %(name)s: %(message)s"), "%s", error)
    assert terminal.split("\n")[1:3] == ["  | Step 1/4 : FROM base", "  | no space left"]


def test_calendar_text_in_a_several_line_message_forges_no_record() -> None:
    """A value (a string) stays on its line; calendar text inside an error gets a line of
    its own at most, marked as a continuation under our priority."""
    error = ValueError(f"bad event {HOSTILE}")
    text = logged(JournalFormatter("%(name)s: %(message)s"), "%s:\n%s", HOSTILE, error)
    assert_inert(text)
    lines = text.rstrip("\n").split("\n")
    assert lines[0] == f"<3>gpuresa.test.lines: {inert(HOSTILE)}:"
    assert lines[1] == "<3>  | bad event evil\\x1b[2J\\u202egpj.exe"
    assert lines[2].startswith("<3>  | <2>gpuresa.runtime: bob-booking: stopped\\x0dX")
    assert len(lines) == 3
    terminal = logged(InertFormatter("%(levelname)s %(name)s: %(message)s"), "%s", error)
    assert all(line.startswith(("ERROR ", "  | ")) for line in terminal.rstrip("\n").split("\n"))


def test_setup_logging_installs_the_journal_formatter_under_journald(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("JOURNAL_STREAM", "8:1234")
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        setup_logging()
        logging.getLogger("gpuresa.reservations.calendars").warning("object %s skipped", HOSTILE)
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    err = capsys.readouterr().err
    assert_inert(err)
    assert err.startswith("<4>gpuresa.reservations.calendars: object evil\\x1b[2J")
    assert err.count("\n") == 1


# --- CLI tables and JSON ------------------------------------------------------------------


def hostile_calendar(tmp_path: Path) -> Path:
    folder = tmp_path / "calendar"
    folder.mkdir()
    # a UID with control characters names no reservation: rejected, and shown
    uid = "uid-\x1b[2J\u202e\\n<2>forged"
    (folder / "good.ics").write_text(event(uid=uid))
    start = datetime(2026, 3, 12, 8, tzinfo=UTC)
    (folder / "bad.ics").write_text(
        event(uid=f"bad-{uid}", summary="\x1b]0;owned\x07\u202eecila\\n<2>x", start=start)
    )
    return write_config(tmp_path, f'name = "lab"\nkind = "ics"\nurl = "{folder}"\nhost = "gpu1"')


def test_the_reservations_table_shows_calendar_text_inert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = hostile_calendar(tmp_path)
    arguments = ["--config", str(config), "reservations", "--from", "2026-03-01", "--to"]
    assert cli.main([*arguments, "2026-04-01"]) == 0
    out = capsys.readouterr().out
    assert_inert(out)
    assert "uid-\\x1b[2J\\u202e\\n<2>forged (lab): " in out
    assert "Rejected: 2" in out


def test_the_reservations_json_escapes_calendar_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = hostile_calendar(tmp_path)
    arguments = ["--config", str(config), "reservations", "--from", "2026-03-01", "--to"]
    assert cli.main([*arguments, "2026-04-01", "--json"]) == 0
    out = capsys.readouterr().out
    assert_inert(out)
    document = json.loads(out)
    # JSON escapes the text, and the text itself is kept exactly
    assert document["rejected"][0]["key"] == "uid-\x1b[2J\u202e\\n<2>forged"


def test_the_status_table_shows_calendar_text_inert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_config(tmp_path, 'name = "lab"\nkind = "ics"\nurl = "/nonexistent"')
    when = "2026-03-10T08:00:00+00:00"
    report: dict[str, Any] = {
        "host": "gpu1", "engine": "docker", "docker": "ok",
        "sessions": [{"key": HOSTILE, "user": "alice", "gpus": [0], "ssh_port": 20001,
                      "ftp_port": 21001, "since": when, "until": when, "state": "running",
                      "gpu_use_now": None, "gpu_use_average": None, "host_ids": None}],
        "upcoming": [{"key": HOSTILE, "user": "bob", "gpus": 1, "template": "pytorch",
                      "start": when, "end": when, "state": "failed", "reason": HOSTILE}],
        "output_disk": {"summary": "1 GiB free", "level": "ok", "refusal": None},
        "rejected": [{"key": HOSTILE, "reason": f"the title {HOSTILE!r} is wrong"}],
        "calendars": {"lab": {"stale_seconds": 3, "last_error": HOSTILE}},
        "outbox": {"backlog": 1, "oldest": [{"key": HOSTILE, "kind": "start", "address": "a@b.c",
                   "queued": when, "attempts": 1, "next_try": when, "last_error": HOSTILE}]},
    }  # fmt: skip
    monkeypatch.setattr(daemon_commands, "status_report", lambda config, now: report)
    assert cli.main(["--config", str(config), "status"]) == 0
    out = capsys.readouterr().out
    assert_inert(out)
    assert out.count("evil\\x1b[2J\\u202egpj.exe\\x0a<2>") == 6
    # a failure's reason keeps its line breaks, each further line marked as its continuation
    assert "      reason: evil\\x1b[2J\\u202egpj.exe\n      | <2>gpuresa.runtime: " in out
    assert cli.main(["--config", str(config), "status", "--json"]) == 0
    out = capsys.readouterr().out
    assert_inert(out)
    assert json.loads(out)["sessions"][0]["key"] == HOSTILE


# --- e-mail -------------------------------------------------------------------------------


def test_a_rejection_notice_arrives_with_calendar_text_inert(smtp_server: SMTPServer) -> None:
    rejection = replace(REJECTION, key=HOSTILE, reason=f"unknown template {HOSTILE}")
    subject, body = rejection_message(rejection, "Europe/Paris")
    notifier_for(smtp_server).send("bob@example.org", f"{subject} {HOSTILE}", body)
    [message] = smtp_server.wait_for(1)
    content = message.get_content().replace("\r\n", "\n")
    assert_inert(content)
    assert_inert(str(message["Subject"]), lines_allowed=False)
    # line breaks in a quoted value become spaces: it stays on its line
    assert "Reason:    unknown template evil\\x1b[2J\\u202egpj.exe <2>gpuresa" in content


def test_a_conflict_notice_names_the_other_booking_by_time_only(smtp_server: SMTPServer) -> None:
    other = replace(booking("carol-uid-secret", 8, 12, 3, 1), summary="carol: secret project")
    mine = booking("bob-1", 9, 10, 2, 2)
    resolved = resolve_conflicts([other, mine], make_config(), first_seen=seen(**{
        "carol-uid-secret": 1, "bob-1": 2}))  # fmt: skip
    [rejection] = resolved.rejected
    assert rejection.key == "bob-1"
    notifier_for(smtp_server).send("bob@example.org", *rejection_message(rejection, "UTC"))
    [message] = smtp_server.wait_for(1)
    content = message.get_content()
    assert "from 2026-03-10 08:00 UTC to 2026-03-10 12:00 UTC" in content
    for secret in ("carol", "secret", "uid"):
        assert secret not in content.lower()


# --- the page and the metrics -------------------------------------------------------------


def hostile_state() -> Any:
    now = datetime(2026, 11, 23, 10, 0, tzinfo=UTC)
    running = session(HOSTILE, (0,), now - timedelta(hours=1), now + timedelta(hours=2))
    return build_state(
        host="gpu1",
        now=now,
        sessions=[running],
        reservations=[reservation(HOSTILE, now + timedelta(hours=4), 2)],
        rejections=[Rejection(HOSTILE, HOSTILE, "lab", f"bad {HOSTILE}", user=None)],
        calendars=[CalendarView(HOSTILE, now, None)],
        snapshot=GpuSnapshot(now, "nvml", (replace(RECORDED, index=0, uuid=HOSTILE),)),
        host_gpus=(0,),
    )


def test_the_page_shows_calendar_text_inert() -> None:
    page = render_page(hostile_state(), UTC)
    assert_inert(page)
    assert "evil\\x1b[2J\\u202egpj.exe\\x0a&lt;2&gt;" in page


def test_metric_labels_hold_calendar_text_inert() -> None:
    text = generate_latest(registry_for(hostile_state)).decode()
    assert_inert(text)
    labelled = [line for line in text.splitlines() if "evil" in line]
    assert labelled and all("\\\\x1b[2J\\\\u202egpj.exe" in line for line in labelled), labelled
