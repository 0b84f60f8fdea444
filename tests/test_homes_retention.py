"""Homes unused for their retention are removed, each user told once before.

The rules on files as the daemon leaves them (an image per login, its time of
last use, a notice beside it), with the clock given.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config
from gpuresa.homes import paths
from gpuresa.homes.retention import removal_of, review

LAST_USE = datetime(2026, 1, 1, tzinfo=UTC)


def config_at(tmp_path: Path, **storage: str) -> Config:
    return parse_config(
        {
            "daemon": {"state_dir": str(tmp_path / "state")},
            "storage": {"output_root": str(tmp_path / "output"), **storage},
        },
        "test.toml",
    )


class Mailbox:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str, str, str, str]] = []

    def __call__(
        self, key: str, kind: str, login: str, email: str | None, message: tuple[str, str]
    ) -> bool:
        self.sent.append((key, kind, login, *message))
        return True


def home_used(config: Config, login: str, when: datetime) -> Path:
    image = paths.image_path(config, login)
    image.parent.mkdir(parents=True, exist_ok=True)
    image.write_bytes(b"")
    os.utime(image, (when.timestamp(), when.timestamp()))
    return image


@pytest.mark.parametrize(
    ("noticed_after", "expected_after"),
    [(None, timedelta(days=180)), (timedelta(days=166), timedelta(days=180)),
     (timedelta(days=200), timedelta(days=214))],
    ids=["no-notice", "notice-in-time", "notice-late"],
)  # fmt: skip
def test_a_home_goes_after_its_retention_and_never_before_its_notice_had_its_time(
    tmp_path: Path, noticed_after: timedelta | None, expected_after: timedelta
) -> None:
    config = config_at(tmp_path)  # the defaults: 180 days, told 14 days before
    noticed = LAST_USE + noticed_after if noticed_after is not None else None
    assert removal_of(LAST_USE, noticed, config) == LAST_USE + expected_after


def test_forever_keeps_every_home(tmp_path: Path) -> None:
    config = config_at(tmp_path, home_retention="forever")
    image = home_used(config, "alice", LAST_USE)
    mailbox = Mailbox()
    assert review(config, LAST_USE + timedelta(days=5000), mailbox) == "homes kept"
    assert image.exists() and mailbox.sent == []
    assert removal_of(LAST_USE, None, config) is None


def test_the_user_is_told_once_then_the_home_goes_and_another_users_stays(
    tmp_path: Path,
) -> None:
    config = config_at(tmp_path, home_retention="30d", home_removal_notice="7d")
    image = home_used(config, "alice", LAST_USE)
    recent = home_used(config, "bob", LAST_USE + timedelta(days=20))
    mailbox = Mailbox()
    # before the notice is due: nothing
    review(config, LAST_USE + timedelta(days=22), mailbox)
    assert mailbox.sent == [] and image.exists()
    # the notice is due 7 days before day 30
    review(config, LAST_USE + timedelta(days=23, hours=1), mailbox)
    [(key, _, login, subject, body)] = mailbox.sent
    assert (key, login) == ("home-alice", "alice")
    assert "will be removed" in subject and "/home/alice" in body
    # told once, however many rounds
    review(config, LAST_USE + timedelta(days=25), mailbox)
    assert len(mailbox.sent) == 1 and image.exists()
    # told an hour after it was due: the removal waits the notice's whole 7 days
    review(config, LAST_USE + timedelta(days=30, minutes=1), mailbox)
    assert image.exists()
    review(config, LAST_USE + timedelta(days=30, hours=1, minutes=1), mailbox)
    assert not image.exists() and not image.with_suffix(".notice").exists()
    assert recent.exists()


def test_a_notice_sent_late_gives_its_whole_time_before_the_removal(tmp_path: Path) -> None:
    """A daemon that was down when the notice was due: the home stays the notice's time."""
    config = config_at(tmp_path, home_retention="30d", home_removal_notice="7d")
    image = home_used(config, "alice", LAST_USE)
    mailbox = Mailbox()
    late = LAST_USE + timedelta(days=40)
    review(config, late, mailbox)
    assert len(mailbox.sent) == 1 and image.exists()
    assert "removed with everything in it on" in mailbox.sent[0][4]
    review(config, late + timedelta(days=6), mailbox)
    assert image.exists()
    review(config, late + timedelta(days=7, minutes=1), mailbox)
    assert not image.exists()


def test_a_home_in_use_or_used_again_is_kept_and_noticed_again_later(tmp_path: Path) -> None:
    config = config_at(tmp_path, home_retention="30d", home_removal_notice="7d")
    image = home_used(config, "alice", LAST_USE)
    mailbox = Mailbox()
    review(config, LAST_USE + timedelta(days=24), mailbox)
    assert len(mailbox.sent) == 1
    # a session of alice runs: her home has a view; nothing happens to it
    view = paths.view_path(config, "alice", "k1")
    view.mkdir(parents=True)
    review(config, LAST_USE + timedelta(days=90), mailbox)
    assert image.exists() and len(mailbox.sent) == 1
    # the session ended: the home was used then, and its time starts again
    view.rmdir()
    used_again = LAST_USE + timedelta(days=90)
    os.utime(image, (used_again.timestamp(), used_again.timestamp()))
    review(config, used_again + timedelta(days=10), mailbox)
    assert image.exists() and len(mailbox.sent) == 1
    review(config, used_again + timedelta(days=24), mailbox)
    assert len(mailbox.sent) == 2 and mailbox.sent[1][1] != mailbox.sent[0][1]


def test_files_that_are_not_a_logins_home_are_left_alone(tmp_path: Path) -> None:
    config = config_at(tmp_path, home_retention="1d", home_removal_notice="0s")
    stranger = paths.images_folder(config) / "not a login!.img"
    stranger.parent.mkdir(parents=True)
    stranger.write_bytes(b"")
    os.utime(stranger, (LAST_USE.timestamp(), LAST_USE.timestamp()))
    image = home_used(config, "alice", LAST_USE)
    mailbox = Mailbox()
    review(config, LAST_USE + timedelta(days=3), mailbox)
    assert stranger.exists() and not image.exists() and mailbox.sent == []


def test_homes_list_shows_each_home_its_use_and_its_removal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuresa.cli import main

    config_file = tmp_path / "config.toml"
    config_file.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n'
        f'[storage]\noutput_root = "{tmp_path / "output"}"\nhome_retention = "30d"\n'
    )
    config = config_at(tmp_path, home_retention="30d")
    alice = home_used(config, "alice", LAST_USE)
    alice.write_bytes(b"x" * 8192)
    os.utime(alice, (LAST_USE.timestamp(), LAST_USE.timestamp()))
    home_used(config, "bob", LAST_USE)
    paths.view_path(config, "bob", "k1").mkdir(parents=True)
    assert main(["homes", "list", "--config", str(config_file), "--json"]) == 0
    listed = {home["login"]: home for home in json.loads(capsys.readouterr().out)}
    assert listed["alice"]["removal"] == (LAST_USE + timedelta(days=30)).isoformat()
    assert listed["alice"]["used_bytes"] >= 8192 and listed["alice"]["sessions"] == 0
    assert listed["bob"]["sessions"] == 1 and listed["bob"]["removal"] is None
    assert main(["homes", "list", "--config", str(config_file)]) == 0
    table = capsys.readouterr().out
    assert "in use by 1 session(s)" in table and "alice" in table
