"""Session specs: checking one before anything is made, and making one for an ad-hoc session."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from datetime import UTC, datetime

from gpuresa.access import AccessError, check_login
from gpuresa.config.sections import Config
from gpuresa.model import AD_HOC_PREFIX, Session, SessionSpec
from gpuresa.planning.allocation import Holding, Ports, allocate_gpus, allocate_ports
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.labels import utc_text
from gpuresa.sessions.templates import resolve_template


def check_spec(config: Config, spec: SessionSpec, available: Sequence[int]) -> None:
    """Refuse, with a `SessionError`, a spec this host cannot serve; creates nothing.

    Checks the host, the login (again: defence in depth), the template and
    variant against the allowlist, the GPUs against the host's, and the
    ports against the host's ranges.
    """
    host = config.host()
    key = spec.key
    if spec.host != host.name:
        raise SessionError(f"session {key} is for host {spec.host!r}; this is {host.name!r}")
    try:
        check_login(spec.user)
    except AccessError as error:
        raise SessionError(f"session {key}: {error}") from None
    resolve_template(config.templates, spec.template, spec.cuda)
    if spec.gpu_count != len(spec.gpu_indices):
        # this host's GPUs are gpuresa's to choose: a count without its devices is no grant
        raise SessionError(
            f"session {key}: {spec.gpu_count} GPU(s) asked, but GPUs "
            f"{list(spec.gpu_indices)} chosen"
        )
    if len(set(spec.gpu_indices)) != len(spec.gpu_indices):
        raise SessionError(f"session {key}: GPUs {list(spec.gpu_indices)} repeat an index")
    unknown = sorted(set(spec.gpu_indices) - set(available))
    if unknown:
        raise SessionError(
            f"session {key}: host {host.name} has no GPU {', '.join(map(str, unknown))} "
            f"(it has {', '.join(map(str, available)) or 'none'})"
        )
    problems = []
    if spec.ssh_port not in host.ssh_ports:
        problems.append(f"SSH port {spec.ssh_port} is outside {host.ssh_ports}")
    if spec.ftp_port not in host.ftp_ports:
        problems.append(f"FTP port {spec.ftp_port} is outside {host.ftp_ports}")
    passive = host.ftp_passive_ports
    if not (
        spec.ftp_passive_first in passive
        and spec.ftp_passive_last in passive
        and spec.ftp_passive_first <= spec.ftp_passive_last
    ):
        problems.append(
            f"passive FTP ports {spec.ftp_passive_first}-{spec.ftp_passive_last} "
            f"are outside {passive}"
        )
    if problems:
        raise SessionError(f"session {key}: {'; '.join(problems)}")


def new_spec(
    config: Config,
    sessions: Sequence[Session],
    available: Sequence[int],
    user: str,
    template: str,
    end: datetime,
    *,
    cuda: str | None = None,
    gpus: Sequence[int] | int = 0,
    start: datetime | None = None,
    key: str | None = None,
    email: str | None = None,
) -> SessionSpec:
    """A spec for an ad-hoc session, with GPUs and ports free right now.

    `gpus` is a count (the lowest free indices) or explicit indices. Raises
    `SessionError` for a bad login, template or GPU choice, and
    `AllocationError` when no GPUs or ports are left.
    """
    start = start or datetime.now(UTC)
    if end <= start:
        raise SessionError(f"the end {utc_text(end)} is not after the start {utc_text(start)}")
    key = key or f"{AD_HOC_PREFIX}{secrets.token_hex(4)}"
    try:
        check_login(user)
    except AccessError as error:
        raise SessionError(str(error)) from None
    _, variant = resolve_template(config.templates, template, cuda)
    holdings = [
        Holding(session.key, session.gpu_indices, _ports(session), session.start, session.end)
        for session in sessions
    ]
    if isinstance(gpus, int):
        chosen = allocate_gpus(tuple(available), gpus, start, end, holdings) if gpus else ()
        if chosen is None:
            raise SessionError(
                f"{gpus} GPU(s) asked, but host {config.host().name} has only "
                f"{len(available)} and sessions use some of them"
            )
    else:
        chosen = tuple(gpus)
        unknown = sorted(set(chosen) - set(available))
        if unknown:
            raise SessionError(
                f"host {config.host().name} has no GPU {', '.join(map(str, unknown))} "
                f"(it has {', '.join(map(str, available)) or 'none'})"
            )
        busy = {
            index
            for holding in holdings
            if holding.start < end and start < holding.end
            for index in holding.gpus
        }
        if busy.intersection(chosen):
            raise SessionError(
                f"GPU(s) {sorted(busy.intersection(chosen))} are in use by another session"
            )
    ports = allocate_ports(config.host(), [_ports(session) for session in sessions])
    return SessionSpec(
        key=key,
        user=user,
        host=config.host().name,
        template=template,
        cuda=variant.name,
        gpu_count=len(chosen),
        gpu_indices=chosen,
        start=start,
        end=end,
        ssh_port=ports.ssh,
        ftp_port=ports.ftp,
        ftp_passive_first=ports.passive_first,
        ftp_passive_last=ports.passive_last,
        email=email,
    )


def _ports(session: Session) -> Ports:
    return Ports(
        session.ssh_port, session.ftp_port, session.ftp_passive_first, session.ftp_passive_last
    )
