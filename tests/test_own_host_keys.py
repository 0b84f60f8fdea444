"""Sessions whose sshd runs as the login (udocker's, a Slurm job's) present a host key of
their own: the start notice names its fingerprint, where the session listens, and no FTPS.

Pure: `ssh-keygen` for the keys, an outbox on a journal in a temporary folder
(nothing is sent), no engine, no server.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from support.configs import config_of

from gpuresa.config.sections import Config
from gpuresa.daemon.notices import Notices
from gpuresa.journal.guard import open_journal
from gpuresa.mail.outbox import Outbox
from gpuresa.mail.smtp import Notifier
from gpuresa.model import Session
from gpuresa.outputs.messages import start_details
from gpuresa.sessions.host_keys import fingerprint_in, fingerprint_of


def made_key(folder: Path, name: str = "key") -> Path:
    """A fresh ed25519 key pair in `folder`; the public half's path."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)], check=True
    )
    return folder / f"{name}.pub"


def test_the_fingerprint_is_the_one_ssh_shows_without_the_comment(tmp_path: Path) -> None:
    public = made_key(tmp_path)
    public.write_text(public.read_text().strip() + " visit https://evil.example/verify\n")
    shown = subprocess.run(
        ["ssh-keygen", "-l", "-E", "sha256", "-f", str(public)],
        check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    expected = f"{shown[0]} {shown[1]} {shown[-1]}"
    assert shown[1].startswith("SHA256:") and expected.endswith(" (ED25519)")
    assert fingerprint_of(public.read_text()) == expected
    assert fingerprint_in(public, os.getuid()) == expected
    with pytest.raises(subprocess.CalledProcessError):
        fingerprint_of("not a key\n")


def test_a_key_file_the_login_planted_is_never_followed_or_waited_on(tmp_path: Path) -> None:
    me = os.getuid()
    other = made_key(tmp_path, "other")
    link = tmp_path / "link.pub"
    link.symlink_to(other)
    assert fingerprint_in(link, me) is None
    fifo = tmp_path / "fifo.pub"
    os.mkfifo(fifo)
    assert fingerprint_in(fifo, me) is None  # returns at once: nobody writes to it
    assert fingerprint_in(tmp_path / "missing.pub", me) is None
    # a file of another's, or a hard link (to whatever file): not the login's key
    assert fingerprint_in(other, me + 1) is None
    os.link(other, tmp_path / "hard.pub")
    assert fingerprint_in(tmp_path / "hard.pub", me) is None
    (tmp_path / "hard.pub").unlink()
    assert fingerprint_in(other, me) == fingerprint_of(other.read_text())
    garbage = tmp_path / "garbage.pub"
    garbage.write_text("ssh-ed25519 AAAAnot-base64\n")
    assert fingerprint_in(garbage, me) == ""
    huge = tmp_path / "huge.pub"
    huge.write_bytes(b"#" * 100_000 + b"\n" + other.read_bytes())
    assert fingerprint_of(huge.read_text()) == fingerprint_in(other, me)  # were it all read
    assert fingerprint_in(huge, me) == ""  # read no further than a key's length


def config(engine: str) -> Config:
    return config_of(
        {"hosts": [{"name": "gpu1", "gpus": [0, 1], "engine": engine, "gpu_mode": "devices",
                    "public_name": "gpu1.lab.example"}]},
        {"storage": {"sftp_port": 2222}},
    )  # fmt: skip


def session(host_key: str = "", place: str = "") -> Session:
    now = datetime.now(UTC)
    return Session(
        key="booking-1", user="alice", host="gpu1", template="pytorch", cuda=None,
        gpu_count=1, gpu_indices=(0,),
        start=now, end=now + timedelta(hours=2), ssh_port=20001, ftp_port=0,
        ftp_passive_first=0, ftp_passive_last=0, state="running", output_dir=Path("/srv/out"),
        place=place, host_key=host_key,
    )  # fmt: skip


@pytest.mark.parametrize("engine", ["udocker", "slurm"])
def test_the_notice_names_the_sessions_own_key_and_no_certificate(engine: str) -> None:
    line = "256 SHA256:abcdefghijklmnopqrstuvwxyz0123456789ABCDEFG gpuresa-booking-1 (ED25519)"
    text = start_details(config(engine), session(line), "gpu1.lab.example")
    assert line in text
    assert "cert-authority" not in text and "FTPS" not in text
    # the output service is the daemon host's, whatever node the session ran on
    assert "sftp -P 2222 alice@gpu1.lab.example" in text
    # a key not known (yet): no fingerprint is made up
    assert "fingerprint" not in start_details(config(engine), session(), "gpu1.lab.example")


def test_a_slurm_sessions_notice_sends_the_user_to_its_node_with_sftp_not_ftps(
    tmp_path: Path,
) -> None:
    site = config("slurm")
    journal, _ = open_journal(tmp_path / "journal.sqlite")
    try:
        outbox = Outbox(journal, Notifier(site.notify, site.users))
        notices = Notices(site, Notifier(site.notify, site.users), outbox)
        notices.start(session("256 SHA256:xyz (ED25519)", place="node07"), "alice@lab.example")
        (message,) = outbox.pending()
    finally:
        journal.close()
    assert "\nssh -p 20001 alice@node07\n" in message.body
    assert "sftp -P 20001 alice@node07" in message.body
    assert "FTP password" not in message.body and "FTP port" not in message.body
    assert "256 SHA256:xyz (ED25519)" in message.body


def test_an_engine_sessions_notice_names_the_host_and_its_ftps_sidecar(tmp_path: Path) -> None:
    site = config("docker")
    journal, _ = open_journal(tmp_path / "journal.sqlite")
    try:
        outbox = Outbox(journal, Notifier(site.notify, site.users))
        notices = Notices(site, Notifier(site.notify, site.users), outbox)
        listed = dataclasses.replace(session(), ftp_port=21001, ftp_user="alice-ftp")
        notices.start(listed, "alice@lab.example")
        (message,) = outbox.pending()
    finally:
        journal.close()
    assert "\nssh -p 20001 alice@gpu1.lab.example\n" in message.body
    assert "FTP port:      21001" in message.body
