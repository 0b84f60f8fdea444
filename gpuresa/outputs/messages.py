"""The words of the outputs: what the start and end e-mails add, and the notices of their own.

Pure functions, in the style of `gpuresa.mail.notices` (sent the same way): given the
config, a session or an output folder and the site's time zone, they return
text or (subject, body). Reading the host CA and the FTPS certificate
(`start_details`) is the only file access.
"""

from __future__ import annotations

from datetime import datetime

from gpuresa.config.capabilities import Capabilities, host_capabilities
from gpuresa.config.sections import Config
from gpuresa.errors import UserError
from gpuresa.mail.notices import SUBJECT_PREFIX
from gpuresa.mail.wording import format_remaining, format_time, one_line
from gpuresa.model import Session
from gpuresa.outputs.credentials import HostCredentials
from gpuresa.outputs.disk import DiskState
from gpuresa.outputs.host_ca import HostCA
from gpuresa.outputs.records import OutputFolder, planned_removal


def sftp_command(config: Config, login: str, public_host: str) -> str:
    """The exact command that lists a login's outputs: `sftp -P PORT login@host`."""
    return f"sftp -P {config.storage.sftp_port} {login}@{public_host}"


def _retention(config: Config) -> str:
    retention = config.storage.output_retention
    if retention == "forever":
        return "kept until an administrator removes them"
    return f"kept {format_remaining(retention)} after the end of their session"


def start_details(config: Config, session: Session, public_host: str) -> str:
    """The host CAs' known_hosts lines, the FTPS fingerprint, where outputs can be fetched.

    Raises `OSError` when the CA or the FTPS certificate cannot be read (the
    caller sends the notice without them rather than not at all).
    """
    if session_capabilities(config, session).own_host_key:
        text = _session_host_key(session)
    else:
        text = _certified_host_keys(config, public_host)
    if config.storage.sftp_port:
        text += f"""
Your outputs of this host, during and after your sessions, read-only
({_retention(config)}):

  {sftp_command(config, session.user, public_host)}
"""
    return text


def session_capabilities(config: Config, session: Session) -> Capabilities:
    """The capabilities of the backend of `session`'s host (a root engine's when that host
    is no longer configured: a certified sshd and an FTPS sidecar, as before any other)."""
    try:
        return host_capabilities(config.host(session.host))
    except UserError:
        return host_capabilities(None)


def _session_host_key(session: Session) -> str:
    """A session's own host key (udocker's, a Slurm job's: the login's sshd has no certificate)."""
    if not session.host_key:
        return ""
    return f"""
Your session's SSH server presents a host key of its own; its fingerprint
(check it when ssh asks):

  {session.host_key}
"""


def _certified_host_keys(config: Config, public_host: str) -> str:
    lines = HostCA(config).known_hosts_text().splitlines()
    block = "\n".join(f"  {line}" for line in lines)
    credentials = HostCredentials(config)
    text = f"""
Every session of {public_host} (and its output service) presents a host key
certified by the SSH certificate authority of its port, valid for that
session's time only. Add these lines to ~/.ssh/known_hosts once (one per
port); they stay valid for all your sessions on this host. Replace any
older line of this host that ends its names with ":*" (it trusted a
certificate on every port, even one a stranger serves):

{block}

The FTPS certificate's SHA-256 fingerprint (check it when your FTP client asks):

  {credentials.tls_fingerprint()}

Clients that check certificates against a file (lftp: `set ssl:ca-file FILE`,
curl: `--cacert FILE`) take this one, saved as a file (also printed by
`gpuresa trust ftps-certificate` on the host):

{credentials.tls_files()[0].read_text(encoding="ascii").strip()}
"""
    return text


def end_details(config: Config, session: Session, public_host: str, ended: datetime) -> str:
    """How to download the output after the end, and when it will be removed."""
    if not config.storage.sftp_port:
        return ""
    removal = planned_removal(ended, config.storage)
    timezone = config.reservations.timezone
    when = (
        f"It will be removed on {format_time(removal, timezone)}; you will be\n"
        f"reminded {format_remaining(config.storage.output_removal_notice)} before."
        if removal is not None
        else "It is kept until an administrator removes it."
    )
    return f"""
Download it (with your SSH key, no password) with:

  {sftp_command(config, session.user, public_host)}

then `cd {session.output_dir.name}` and `get -r .`. {when}
"""


def removal_notice_message(
    folder: OutputFolder, config: Config, public_host: str, removal: datetime
) -> tuple[str, str]:
    """The notice sent before an output folder is removed at the end of its retention."""
    timezone = config.reservations.timezone
    how = "Copy what you need before then (ask the administrators how).\n"
    if config.storage.sftp_port:
        how = f"""Download what you need before then:

  {sftp_command(config, folder.user, public_host)}

then `get -r {folder.path.name}`.
"""
    subject = (
        f"{SUBJECT_PREFIX} Your output {folder.path.name} on {config.daemon.host} will be removed"
    )
    body = f"""\
Hello {folder.user},

the output of your GPU session on {config.daemon.host} in

  {folder.path.name}

will be removed on {format_time(removal, timezone)}.
{how}
Reservation: {one_line(folder.key) or "unknown"}
"""
    return subject, body


def disk_warning_message(session: Session, state: DiskState, host: str) -> tuple[str, str]:
    """The notice to a running session's user when the output disk runs low."""
    subject = f"{SUBJECT_PREFIX} The output disk of {host} is nearly full"
    body = f"""\
Hello {session.user},

the disk that holds session outputs on {host} is nearly full:

  {state.summary}

Your session goes on, but writing to the output folder may soon fail. Please
download what you no longer need on {host} and delete it there.

Reservation: {one_line(session.key)}
"""
    return subject, body


def disk_admin_message(state: DiskState, host: str) -> tuple[str, str]:
    """The notice to the admin when the output disk crosses a threshold (subject unprefixed)."""
    what = "refuses new sessions" if state.level == "refuse" else "is nearly full"
    # no "[gpuresa]" prefix: the daemon's admin notices add it
    subject = f"The output disk of {host} {what}"
    body = f"""\
The output disk of {host}: {state.summary}
(storage.free_warn and storage.free_refuse set the thresholds).

{state.refusal or "New sessions still start; their users and running sessions' users are told."}

`gpuresa outputs list` shows what takes the space; `gpuresa outputs prune
--dry-run` what the retention would remove now.
"""
    return subject, body
