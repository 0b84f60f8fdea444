"""What gpuresa keeps on disk for each udocker session: its record and its sshd's files.

`<udocker root>/sessions/` is root's (mode 0711: traversed, never listed), and each
`<safe key>/` below it root's with the login's group (mode 0750: the login's sshd and
udocker read it, no other host user does): `record.json` (the
spec, the account, the container's name: what `list_sessions` of a restarted
daemon rebuilds the session from), `sshd_config`, `authorized_keys` (empty
while the login gate is closed), `container.pid` (the container's first
process, which logins enter), and `ssh/` (the user's, mode 0700: the
session's own SSH host key, which the user's sshd must read).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from gpuresa.access import Account
from gpuresa.model import Session, SessionSpec
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.host_keys import fingerprint_in, fingerprint_of
from gpuresa.sessions.labels import parse_instant, safe_key, utc_text

HOST_KEY = "ssh_host_ed25519_key"
# the sessions' folder and each session's (see the module): its logs (the login's
# connections, udocker's output) and its authorized_keys are no other user's to read
ROOT_MODE = 0o711
FOLDER_MODE = 0o750
# the host key's fingerprint, written by root beside the user's `ssh` folder
FINGERPRINT = "host_key.fingerprint"


@dataclass(frozen=True)
class Record:
    """A session as gpuresa made it: its spec, who runs it, where its output is."""

    spec: SessionSpec
    uid: int
    gid: int
    output_dir: Path
    container: str

    def session(self, state: str, end: datetime | None = None, host_key: str = "") -> Session:
        return Session.of(
            replace(self.spec, end=end or self.spec.end),
            state=state,
            output_dir=self.output_dir,
            containers=(self.container,),
            host_key=host_key,
        )


class Records:
    """The session folders under `root` (`<udocker root>/sessions`)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def folder(self, key: str) -> Path:
        return self.root / safe_key(key)

    def write(self, record: Record) -> Path:
        """Make the session's folder and write its record; returns the folder."""
        folder = self.folder(record.spec.key)
        spec = record.spec
        values = {
            "key": spec.key,
            "user": spec.user,
            "host": spec.host,
            "template": spec.template,
            "cuda": spec.cuda,
            # "gpus": the name the records of running sessions already have
            "gpus": list(spec.gpu_indices),
            "start": utc_text(spec.start),
            "end": utc_text(spec.end),
            "ssh_port": spec.ssh_port,
            "ftp_port": spec.ftp_port,
            "ftp_passive_first": spec.ftp_passive_first,
            "ftp_passive_last": spec.ftp_passive_last,
            "email": spec.email,
            "preemptible": spec.preemptible,
            "uid": record.uid,
            "gid": record.gid,
            "output_dir": str(record.output_dir),
            "container": record.container,
        }
        try:
            self.root.mkdir(mode=ROOT_MODE, parents=True, exist_ok=True)
            # an older install made both 0755: closed again on every write
            os.chmod(self.root, ROOT_MODE)
            folder.mkdir(mode=FOLDER_MODE, exist_ok=True)
            if folder.is_symlink() or not folder.is_dir():
                raise OSError(f"{folder} is not a folder")
            os.lchown(folder, 0, record.gid)
            os.chmod(folder, FOLDER_MODE)
            write_file(folder / "record.json", json.dumps(values, indent=1) + "\n")
        except OSError as error:
            raise SessionError(f"cannot write the record of {spec.key}: {error}") from None
        return folder

    def read(self, key: str) -> Record | None:
        return self._read(self.folder(key) / "record.json")

    def all(self) -> list[Record]:
        """Every readable record (an unreadable one is left out)."""
        try:
            files = sorted(self.root.glob("*/record.json"))
        except OSError:
            return []
        return [record for path in files if (record := self._read(path)) is not None]

    def _read(self, path: Path) -> Record | None:
        try:
            values = json.loads(path.read_text())
            spec = SessionSpec(
                key=str(values["key"]),
                user=str(values["user"]),
                host=str(values["host"]),
                template=str(values["template"]),
                cuda=values["cuda"],
                gpu_count=len(gpus := tuple(int(index) for index in values["gpus"])),
                gpu_indices=gpus,
                start=parse_instant(values["start"]),
                end=parse_instant(values["end"]),
                ssh_port=int(values["ssh_port"]),
                ftp_port=int(values["ftp_port"]),
                ftp_passive_first=int(values["ftp_passive_first"]),
                ftp_passive_last=int(values["ftp_passive_last"]),
                email=values.get("email"),
                preemptible=values.get("preemptible") is True,
            )
            return Record(
                spec,
                int(values["uid"]),
                int(values["gid"]),
                Path(values["output_dir"]),
                str(values["container"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def host_key(self, key: str, account: Account) -> Path:
        """The session's own SSH host key (made once), the user's, for the user's sshd.

        The `ssh` folder is the user's, so nothing in it is touched by path as
        root: the key is made in a root-only folder beside it, given to the user
        through its descriptor, and renamed into place (a rename replaces a link
        the user planted there, it never follows it).
        """
        try:
            return self._host_key(key, account)
        except (OSError, subprocess.SubprocessError) as error:
            raise SessionError(f"cannot make the session's SSH host key: {error}") from None

    def _host_key(self, key: str, account: Account) -> Path:
        session = self.folder(key)
        folder = session / "ssh"
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)
        details = folder.lstat()
        if not stat.S_ISDIR(details.st_mode):
            raise OSError(f"{folder} is not a folder")
        if (details.st_uid, details.st_gid) != (account.uid, account.gid):
            os.lchown(folder, account.uid, account.gid)
        path = folder / HOST_KEY
        if path.is_file():
            return path
        making = Path(tempfile.mkdtemp(prefix=".ssh-", dir=session))
        try:
            made = making / HOST_KEY
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"gpuresa-{key}"[:60],
                 "-f", str(made)],
                check=True, capture_output=True, timeout=30,
            )  # fmt: skip
            for name in (HOST_KEY, f"{HOST_KEY}.pub"):
                descriptor = os.open(making / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    os.fchown(descriptor, account.uid, account.gid)
                finally:
                    os.close(descriptor)
            # its fingerprint, for the start notice, from the key as made (the `ssh` folder is
            # the user's, and what is there later is theirs to change)
            public = (making / f"{HOST_KEY}.pub").read_text()
            write_file(session / FINGERPRINT, fingerprint_of(public) + "\n")
            # the public half first: the private key's presence says the pair is complete
            os.rename(making / f"{HOST_KEY}.pub", folder / f"{HOST_KEY}.pub")
            os.rename(making / HOST_KEY, path)
        finally:
            shutil.rmtree(making, ignore_errors=True)
        return path

    def fingerprint(self, key: str, owner: int) -> str:
        """The SHA-256 fingerprint of the session's host key, as made ("" before it is).

        A session made before fingerprints were kept has it taken once from the
        key's public half in the folder of its login (`owner`, a uid; see
        `host_keys.fingerprint_in`), and kept.
        """
        path = self.folder(key) / FINGERPRINT
        try:
            return path.read_text().strip()
        except OSError:
            pass
        found = fingerprint_in(self.folder(key) / "ssh" / f"{HOST_KEY}.pub", owner)
        if found is not None:
            with contextlib.suppress(OSError):
                write_file(path, found + "\n")
        return found or ""

    def log_tail(self, key: str) -> str:
        """The last lines of the session's udocker and sshd logs, to tell why it failed."""
        tails = []
        for name in ("udocker.log", "sshd.log"):
            try:
                text = _end_of(self.folder(key) / name).strip()
            except OSError:
                continue
            if text:
                tails.append(f"\n--- {name}:\n" + "\n".join(text.splitlines()[-15:]))
        return "".join(tails)

    def remove(self, key: str) -> None:
        shutil.rmtree(self.folder(key), ignore_errors=True)


def write_file(path: Path, text: str, mode: int = 0o644) -> None:
    """Replace `path` by a fresh root-owned file holding `text` (never following links)."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    descriptor = os.open(temporary, flags, mode)
    try:
        os.fchmod(descriptor, mode)
        os.write(descriptor, text.encode())
    finally:
        os.close(descriptor)
    os.replace(temporary, path)


def _end_of(path: Path, size: int = 65536) -> str:
    """The last `size` bytes of the log at `path` (the session writes there: it can be
    huge), never through a link."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(descriptor, "rb") as log_file:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return ""
        log_file.seek(max(0, os.fstat(descriptor).st_size - size))
        return log_file.read(size).decode(errors="replace")
