"""Which daemon e-mails a rejected booking when several hosts read one calendar."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SMTPServer

from gpuresa.config.reading import parse_config
from gpuresa.daemon.state import Context
from gpuresa.journal.guard import open_journal
from gpuresa.mail.outbox import Outbox
from gpuresa.mail.smtp import Notifier
from gpuresa.model import Rejection


@pytest.mark.parametrize(("this_host", "mails"), [("gpu1", 1), ("gpu2", 0)])
def test_a_location_calendars_rejections_are_mailed_by_the_first_host_only(
    tmp_path: Path, smtp_server: SMTPServer, this_host: str, mails: int
) -> None:
    calendar = tmp_path / "calendar"
    calendar.mkdir()
    config = parse_config(
        {
            "daemon": {"host": this_host, "state_dir": str(tmp_path / "state")},
            "calendars": [{"name": "shared", "kind": "ics", "url": str(calendar)}],
            "hosts": [
                {"name": "gpu1", "gpus": [0]},
                {"name": "gpu2", "gpus": [0], "ssh_ports": "20000-20099"},
            ],
            "users": {"emails": {"alice": "alice@example.org"}},
            "notify": {"enabled": True, "smtp_host": "127.0.0.1", "smtp_port": smtp_server.port},
        }
    )
    journal, _ = open_journal(tmp_path / "state" / "journal.sqlite")
    outbox = Outbox(journal, Notifier(config.notify, config.users))
    outbox.start()
    context = Context(config, journal, outbox)
    try:
        rejection = Rejection(
            key="r-1", uid="r-1", calendar="shared", reason="unknown host 'gpu9'", user="alice"
        )
        context.reject(rejection)
        assert journal.states.get("r-1") == "rejected"
        if mails:
            messages = smtp_server.wait_for(1)
            assert "gpu9" in messages[0].get_content()
        else:
            # nothing queued, so nothing is ever sent (the outbox sends only what it holds)
            assert outbox.backlog() == 0 and outbox.pending() == []
            assert smtp_server.messages == []
    finally:
        outbox.stop()
        journal.close()
