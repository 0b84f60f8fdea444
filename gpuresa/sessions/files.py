"""What a session shows its user, written on the host: banner, motd, end time, last message.

Also the login gate: while the file `nologin` is there, sshd refuses every
login (PAM's pam_nologin reads it, see templates/access/install.sh). A session
is prepared ahead with its containers running behind the gate, so starting it
at its start time is only the removal of that file: no Docker call, and as
fast for eight sessions at once as for one.

Each session has a folder `<state_dir>/sessions/<safe key>/`, bind-mounted
read-only at `/etc/gpuresa/session` in its main container: sshd's `Banner`
and `/etc/motd` point there. gpuresa rewrites these files when the end moves
or a warning is due, and never runs anything in the container to do it (the
user is root there and may have replaced any program).

The session's authorized keys are there too (`authorized_keys`): sshd reads
them with `AuthorizedKeysCommand` (see templates/access/sshd_config), never
from the container's own layer, which on Docker belongs to the one host uid
that is root in every session. The file stays root's on the host, so it shows
as nobody's in the session; sshd's ownership checks (StrictModes) apply to
`AuthorizedKeysFile` only, not to what a command prints, so nothing of it has
to be given to the session's root.

The user cannot use the folder against the host: it is read-only in the
container, owned by root on the host (nobody in the container's user
namespace), and below `sessions/`, which is root's with mode 0700: no host
process (not even one running as a session's root uid) reaches it by its
path, and the mount in the session is read-only. Files are written through a
descriptor of the folder (opened without following links), into a fresh file
made with O_EXCL|O_NOFOLLOW, then renamed over the old one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePath
from zoneinfo import ZoneInfo

from gpuresa.config.sections import StorageConfig
from gpuresa.mail.notices import FTP_PASSWORD_PATH, printable
from gpuresa.model import Session, SessionSpec
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.labels import safe_key, utc_text

log = logging.getLogger(__name__)

FOLDER_MODE = 0o755
# `<state_dir>/sessions` itself: only root traverses it (the containers reach their
# own folder through its bind mount, which does not check the folders above)
ROOT_MODE = 0o700
# the session's authorized keys, read by sshd's AuthorizedKeysCommand
KEYS = "authorized_keys"
# the login gate's file name (see the module)
GATE = "nologin"
FILE_MODE = 0o644
# a secret (the FTP password): its owner may read it, nobody else
SECRET_MODE = 0o400
# the file of a session's folder holding its FTP password
FTP_PASSWORD_FILE = FTP_PASSWORD_PATH.name
# in a session's host-side folder: its own SSH host key and certificate (see outputs.host_ca)
HOST_KEYS_FOLDER = "host-keys"


def end_text(end: datetime, timezone: str) -> str:
    """An end time for people: in the site's time zone, with UTC alongside."""
    local = end.astimezone(ZoneInfo(timezone))
    utc = end.astimezone(UTC)
    if timezone == "UTC":
        return f"{utc:%Y-%m-%d %H:%M} UTC"
    return f"{local:%Y-%m-%d %H:%M} {local.tzname()} ({utc:%H:%M} UTC)"


@dataclass(frozen=True)
class SessionFacts:
    """What the banner and motd say about a session."""

    user: str
    template: str
    cuda: str | None
    gpu_count: int
    # () where a scheduler chooses them on its node
    gpu_indices: Sequence[int]
    end: datetime
    output_target: PurePath
    input_targets: Sequence[PurePath] = ()


def session_facts(
    storage: StorageConfig, session: Session | SessionSpec, end: datetime
) -> SessionFacts:
    """What a session shows its user, with `end` its latest end (a recorded extension)."""
    return SessionFacts(
        user=session.user,
        template=session.template,
        cuda=session.cuda,
        gpu_count=session.gpu_count,
        gpu_indices=session.gpu_indices,
        end=end,
        output_target=storage.output_target,
        input_targets=tuple(mount.target for mount in storage.inputs),
    )


def banner_text(facts: SessionFacts, timezone: str) -> str:
    """sshd's login banner: one line with who, what and until when."""
    template = facts.template + (f" (CUDA {facts.cuda})" if facts.cuda else "")
    text = end_text(facts.end, timezone)
    return printable(f"gpuresa session of {facts.user}, template {template}: ends at {text}\n")


def motd_text(facts: SessionFacts, timezone: str) -> str:
    """The message of the day after login: the session, its end, where to keep results."""
    template = facts.template + (f" (CUDA {facts.cuda})" if facts.cuda else "")
    gpus = ",".join(str(index) for index in facts.gpu_indices) or (
        f"{facts.gpu_count} on this node" if facts.gpu_count else "none"
    )
    output = facts.output_target
    lines = [
        "",
        f"  gpuresa session of {facts.user}: template {template}, GPUs: {gpus}",
        f"  Ends at {end_text(facts.end, timezone)}; the container and everything outside "
        f"{output} are then deleted.",
        f"  Keep your results in {output} (also served by FTP, kept after the session).",
        f"  FTP password of this session: cat {FTP_PASSWORD_PATH}",
    ]
    if facts.input_targets:
        inputs = " ".join(str(target) for target in facts.input_targets)
        lines.append(f"  Input data (read-only): {inputs}")
    return printable("\n".join([*lines, "", ""]))


class SessionFiles:
    """The per-session folders under `root` (`<state_dir>/sessions`).

    `root_mode` and `folder_mode` are the modes the root and each folder are
    kept at (a backend whose sessions run as host users gives their folders
    to each login's group, under a root they traverse but cannot list).
    """

    def __init__(
        self, root: Path, root_mode: int = ROOT_MODE, folder_mode: int = FOLDER_MODE
    ) -> None:
        self.root = root
        self.root_mode = root_mode
        self.folder_mode = folder_mode

    def path(self, key: str) -> Path:
        """The folder of session `key` on the host (what is mounted in the container)."""
        return self.root / safe_key(key)

    def show_facts(self, key: str, facts: SessionFacts, timezone: str) -> Path:
        """Write the banner, motd and end of session `key`; returns its folder.

        Raises `SessionError` when the folder cannot be made or written safely.
        """
        with self._folder(key) as folder:
            _write(folder, "end", utc_text(facts.end) + "\n")
            _write(folder, "banner", banner_text(facts, timezone))
            _write(folder, "motd", motd_text(facts, timezone))
        return self.path(key)

    def show_keys(self, key: str, text: str) -> None:
        """Write the public keys that may log in to session `key` (authorized_keys lines).

        Raises `SessionError` when the folder cannot be made or written safely.
        """
        with self._folder(key) as folder:
            _write(folder, KEYS, text.rstrip("\n") + "\n")

    def show_message(self, key: str, text: str, now: datetime) -> None:
        """Keep `text` as the session's last message (`message`, with when it was sent)."""
        with self._folder(key) as folder:
            _write(folder, "message", printable(f"[{utc_text(now)}] {text.rstrip()}\n"))

    def show_secret(self, key: str, name: str, text: str, uid: int, gid: int) -> None:
        """Keep `text` in the file `name` of session `key`, readable by host uid `uid` only.

        Given the host ids of the session's login (its container uid mapped
        onto the host): the login and its sudo read the file in the session;
        no other host user can, and no other session has the folder. Raises
        `SessionError` when it cannot be written.
        """
        with self._folder(key) as folder:
            _write(folder, name, text, mode=SECRET_MODE, owner=(uid, gid))

    def show_file(self, key: str, name: str, text: str) -> None:
        """Write another file the session's user reads (`authorized_keys` of a Slurm job)."""
        with self._folder(key) as folder:
            _write(folder, name, text)

    def close_gate(self, key: str, text: str) -> None:
        """Refuse logins to session `key`, showing `text` to who tries."""
        with self._folder(key) as folder:
            _write(folder, GATE, printable(text.rstrip() + "\n"))

    def open_gate(self, key: str) -> None:
        """Let the user of session `key` log in (nothing happens when it is open)."""
        with self._folder(key) as folder, contextlib.suppress(FileNotFoundError):
            os.unlink(GATE, dir_fd=folder)

    def gated(self, key: str) -> bool:
        """Whether logins to session `key` are refused for now.

        A session without its folder counts as gated (fails closed): its
        containers cannot be told apart from ones whose gate was lost.
        """
        folder = self.path(key)
        return (folder / GATE).is_file() or not folder.is_dir()

    def remove(self, key: str) -> None:
        """Delete the folder of session `key` (never following links); logs, never raises."""
        path = self.path(key)
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as error:
            log.warning("%s: cannot remove %s: %s", key, path, error)

    @contextlib.contextmanager
    def _folder(self, key: str) -> Iterator[int]:
        """A descriptor of the session's folder, made if missing, checked to be root's alone."""
        path = self.path(key)
        try:
            self.root.mkdir(mode=self.root_mode, parents=True, exist_ok=True)
            parent = _open_folder(self.root)
            try:
                # an older install made it 0755: closed on every write
                os.fchmod(parent, self.root_mode)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path.name, self.folder_mode, dir_fd=parent)
                folder = _open_folder(Path(path.name), parent)
            finally:
                os.close(parent)
            try:
                os.fchmod(folder, self.folder_mode)
                yield folder
            finally:
                os.close(folder)
        except OSError as error:
            raise SessionError(
                f"cannot write the session files of {key} in {path}: {error}"
            ) from None


def _open_folder(path: Path, parent: int | None = None) -> int:
    """Open a folder that must be ours alone: no link, owned by us, writable by nobody else."""
    descriptor = os.open(
        path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent
    )
    details = os.fstat(descriptor)
    if details.st_uid != os.geteuid() or details.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.close(descriptor)
        raise PermissionError(
            f"{path} must belong to uid {os.geteuid()} and be writable by it only"
        )
    return descriptor


def _write(
    folder: int,
    name: str,
    text: str,
    *,
    mode: int = FILE_MODE,
    owner: tuple[int, int] | None = None,
) -> None:
    """Replace `name` in the folder `folder` by a fresh file holding `text`, with
    `mode` and (when given) `owner`'s uid and gid set before anything is written."""
    temporary = f".{name}.{secrets.token_hex(6)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    # made unreadable to all; opened for the owner only once it is theirs
    descriptor = os.open(temporary, flags, 0, dir_fd=folder)
    try:
        if owner is not None:
            os.fchown(descriptor, *owner)
        os.fchmod(descriptor, mode)
        os.write(descriptor, text.encode("utf-8"))
    finally:
        os.close(descriptor)
    os.replace(temporary, name, src_dir_fd=folder, dst_dir_fd=folder)
