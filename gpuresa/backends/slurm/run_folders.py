"""A Slurm session's folders on the shared folder, as the daemon makes and reads them.

Its files (authorized keys, facts; root's, the login's group may read), its
output folder (the login's, under its own folder), and its run folder (the
login's: the job writes its log there, where the job's sshd logs each login).
"""

from __future__ import annotations

import os
from pathlib import Path

from gpuresa.access import AccessError, authorized_keys, host_account
from gpuresa.backends.slurm.records import Record
from gpuresa.config.sections import Config
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.files import SessionFiles
from gpuresa.sessions.logins import read_log, ssh_login_seen


def make_run_folders(config: Config, files: SessionFiles, runs: Path, record: Record) -> None:
    """Make `record`'s files, output folder and run folder (under `runs`); raises
    `SessionError` when its login has no account or no key."""

    account = host_account(record.user)
    if account is None:
        raise SessionError(f"{record.user!r} has no account on the cluster")
    try:
        keys = authorized_keys(record.user, config.users)
    except AccessError as error:
        raise SessionError(str(error)) from None
    files.show_file(record.key, "authorized_keys", keys)
    os.chown(files.path(record.key), 0, account.gid)
    output = Path(record.output)
    owner_dir = config.storage.output_root / record.user
    owner_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
    os.chown(owner_dir, 0, account.gid)
    output.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chown(output, account.uid, account.gid)
    run = runs / record.name
    # traversed by each job to its own run folder (the login's, with its log), never listed
    runs.mkdir(mode=0o711, parents=True, exist_ok=True)
    os.chmod(runs, 0o711)
    run.mkdir(mode=0o700, exist_ok=True)
    os.chown(run, account.uid, account.gid)


def login_in_job_log(runs: Path, record: Record) -> bool | None:
    """Whether the job's log shows its login let in; None while it cannot be read (not
    written yet, not reachable from here, or not a plain file: nothing to tell). The run
    folder is the login's: `read_log` reads what it finds there with care."""
    text = read_log(runs / record.name / "job.log")
    return None if text is None else ssh_login_seen(text, record.user)
