"""Sessions on Docker: create, start, check, adopt, message, stop and remove them.

A session is three Docker objects named after the host and the reservation key
(see `labels.session_name`): a network of its own, the main container (the
template's image with sshd for the booked login) and an FTP sidecar serving
the output folder. All three carry `gpuresa.*` labels, so `list_sessions()`
rebuilds every session from Docker alone and a restarted daemon adopts what
runs. What labels cannot say is kept on the host under `<state_dir>/sessions`:
a moved end time (`records`), and the banner, motd and messages the session
shows (`sessions.files`, mounted read-only in the main container).

Nothing here runs anything in a session or waits on one (the user is root
there): stops signal from the host (`stopping`), messages and new end times
are files. Every engine call is bounded in time (`engine`). The methods may be
called from several threads at once for different sessions.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Sequence
from datetime import UTC, datetime, timedelta
from signal import Signals
from typing import TYPE_CHECKING

from gpuresa.backends.engines import firewall, garbage, stopping
from gpuresa.backends.engines.engines import EngineKind
from gpuresa.backends.engines.host_sessions import HostSessions
from gpuresa.backends.engines.logins import session_used
from gpuresa.backends.engines.lookup import (
    Found,
    by_key,
    container_name,
    container_roles,
    status,
)
from gpuresa.backends.engines.namespaces import require_user_namespaces
from gpuresa.backends.engines.ownership import sessions_of_others
from gpuresa.backends.engines.starting import start_session
from gpuresa.config.capabilities import DOCKER, PODMAN, Capabilities
from gpuresa.config.sections import Config, HostConfig
from gpuresa.homes.store import detach, release_unused
from gpuresa.model import Session, SessionSpec
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.files import SessionFacts, end_text
from gpuresa.sessions.labels import utc_text
from gpuresa.sessions.specs import new_spec

if TYPE_CHECKING:
    from docker import DockerClient

__all__ = ["Runtime", "end_text", "require_user_namespaces"]

log = logging.getLogger(__name__)

# Networks younger than this are never collected: another process may be making their session.
NETWORK_MIN_AGE = timedelta(minutes=2)


class Runtime:
    """The sessions of this daemon's host, kept in Docker.

    Given the config and optionally a `docker.DockerClient` (else one is made
    from the environment on first use: making a Runtime never needs Docker;
    give one with a connection pool of 16 or more when several threads use
    it). Every method raises `RuntimeUnavailable` when the engine cannot be
    reached and `EngineTimeout` (a `SessionError`) when it does not answer in
    time; requests that cannot be served raise `SessionError` with the reason.
    """

    def __init__(self, config: Config, client: DockerClient | None = None) -> None:
        self.config = config
        # the parts that the making of sessions (`starting`, `sidecar`) is given
        self.sessions = HostSessions(config, client)
        self.kind: EngineKind = self.sessions.kind
        # root engines: GPUs gpuresa chooses, an FTPS sidecar per session, an output service
        self.capabilities: Capabilities = PODMAN if self.kind.name == "podman" else DOCKER
        self.engine = self.sessions.engine
        self.images = self.sessions.images
        self.ends = self.sessions.ends
        self.files = self.sessions.files

    # --- what the host has -----------------------------------------------------------------

    @property
    def host(self) -> HostConfig:
        """This daemon's [[hosts]] entry."""
        return self.sessions.host

    def host_gpus(self) -> tuple[int, ...]:
        """The GPU indices this host hands out (see `gpus.HostGpus.indices`)."""
        return self.sessions.host_gpus()

    def check(self) -> None:
        """Refuse, with a `SessionError`, an engine where sessions get no user namespace.

        See `HostSessions.check_engine`: asked of the engine each time.
        """
        self.sessions.check_engine()

    # --- images ----------------------------------------------------------------------------

    def ensure_image(self, template: str, cuda: str | None) -> str:
        """The image tag of `template`'s variant `cuda`, built if missing (see `Images`).

        For the daemon's build worker and `gpuresa templates build`: may take minutes.
        """
        return self.images.ensure_image(template, cuda)

    def image_present(self, template: str, cuda: str | None) -> bool:
        """Whether `ensure_image` would return at once: no pull, no build, never waits."""
        return self.images.image_present(template, cuda)

    def ensure_ftp_image(self) -> str:
        """The FTP sidecar's image tag, built if missing (may take minutes)."""
        return self.images.ensure_ftp_image()

    def ftp_image_present(self) -> bool:
        """Whether the FTP sidecar's current image is here (never builds, never waits)."""
        return self.images.ftp_present_tag() is not None

    def provisioned(self, template: str | None, cuda: str | None) -> bool:
        """Whether the images of `template` (None: the FTP sidecar's alone) are here.

        Never builds, never waits.
        """
        if template is None:
            return self.ftp_image_present()
        return self.image_present(template, cuda)

    def provision(self, template: str | None, cuda: str | None) -> None:
        """Build the image of `template` (None: the FTP sidecar's) when missing (minutes)."""
        if template is None:
            self.ensure_ftp_image()
        else:
            self.ensure_image(template, cuda)

    # --- reading sessions back from Docker -------------------------------------------------

    def list_sessions(self) -> list[Session]:
        """Every session of this host, rebuilt from its containers' labels.

        state: "running" (both containers run), "created" (prepared: the main
        container not yet started) or "stopped" (anything else: exited, half
        there). The end is the latest one `extend()` recorded, else the
        label's. Containers whose labels gpuresa did not write are logged and
        left out.
        """
        return self.sessions_and_units()[0]

    def sessions_and_units(self) -> tuple[list[Session], dict[str, tuple[str, str]]]:
        """`list_sessions()` and each of their containers' full id with (key, role).

        From one listing of the engine, so the two always agree (the GPU
        tracker tells a session's processes from others' by container id).
        """
        containers, _ = self.sessions.host_containers()
        sessions = []
        for key, found in by_key(containers).items():
            session = self.sessions.session_of(key, found)
            if session is not None:
                sessions.append(session)
        ordered = sorted(sessions, key=lambda session: (session.start, session.key))
        return ordered, container_roles(containers)

    def foreign_sessions(self) -> list[Session]:
        """The sessions of this host name that another installation made (see `ownership`).

        For `gpuresa plan` to show: nothing here stops, adopts or collects
        them. Unreadable ones are left out.
        """
        return sessions_of_others(self.sessions.host_containers()[1])

    def session(self, key: str) -> Session | None:
        """The session `key` of this host as Docker shows it, or None."""
        return self.sessions.session(key)

    def check_spec(self, spec: SessionSpec) -> None:
        """Refuse, with a `SessionError`, a spec this host cannot serve (see `specs.check_spec`)."""
        self.sessions.check_spec(spec)

    # --- the life of a session -------------------------------------------------------------

    def prepare(self, spec: SessionSpec, ready_timeout: float = 30) -> Session:
        """Make everything a session needs short of letting its user in; returns it ("created").

        The output folder and the session's files are made, the network and
        both containers created and started behind the login gate (see
        `sessions.files`), and sshd and FTP checked to answer: `start` then
        only opens the gate. Never builds or
        pulls: a missing image raises `ImageMissing` before anything is made.
        Idempotent: a session that is already created or running is returned
        as it is; one that stopped or is half there is removed and made again
        (its output folder is kept). Raises `SessionError` before creating
        anything for a spec that cannot be served (see `check_spec`, plus a
        login with no SSH key, an engine without user namespaces); a creation
        that fails midway is undone (`PortRefused` names the ports Docker
        could not publish).
        """
        key = spec.key
        found = self.sessions.find(key)
        running = found.complete and status(found.main) == status(found.ftp) == "running"
        if running and not self.files.gated(key):
            session = self.sessions.session_of(key, found)
            if session is not None:
                return session  # already let in: started meanwhile
        opens = end_text(spec.start, self.config.reservations.timezone)
        self.files.close_gate(key, f"gpuresa: this session opens at {opens}; try again then.")
        session = start_session(self.sessions, spec, ready_timeout)
        return dataclasses.replace(session, state="created")

    def start(self, spec: SessionSpec, ready_timeout: float = 30) -> Session:
        """Start the session of `spec` and return it once SSH and FTP answer.

        Prepares it first when needed (never building: `ImageMissing`). Ready
        means: sshd completes an SSH key exchange and the FTP server greets,
        both on the published ports. Idempotent: a running session is
        returned as it is; one whose FTP sidecar alone is down (exited or
        removed) gets it back and keeps its main container and the user's
        processes. On failure the session's containers and network are
        removed (ports freed, output kept) and `SessionError` says why, with
        the end of the containers' logs (`PortRefused` with the ports Docker
        could not publish).
        """
        key = spec.key
        found = self.sessions.find(key)
        ready = found.complete and status(found.main) == status(found.ftp) == "running"
        if ready and self.files.gated(key):
            # prepared ahead: its servers answer already, only the gate was closed
            self.files.open_gate(key)
            session = self.sessions.session_of(key, found)
            if session is not None:
                log.info("%s: let in (prepared ahead; ssh port %d)", key, session.ssh_port)
                return session
        self.files.open_gate(key)
        return start_session(self.sessions, spec, ready_timeout)

    def facts(self, session: Session | SessionSpec) -> SessionFacts:
        """What the session shows its user (see `HostSessions.facts`)."""
        return self.sessions.facts(session)

    # --- the end of a session --------------------------------------------------------------

    def stop(self, key: str, grace: timedelta) -> None:
        """End session `key`: its processes get SIGTERM and up to `grace` to exit, then all goes.

        From the host, waiting on nothing in the container (see `stopping`);
        the grace ends early once they are all gone. The output folder is kept
        (with storage.hand_output_to_user it is given to the login's host
        account). Idempotent: a session that is gone or going counts as stopped.
        """
        found = self.sessions.find(key)
        stopping.give_grace(key, found.main, grace)
        self._end(key, found)

    def kill(self, key: str) -> None:
        """End session `key` at once: SIGKILL from the host, forced removal; output kept.

        The escalation of a stop that takes too long; idempotent like `stop`.
        """
        self._end(key, self.sessions.find(key))

    def reset(self, key: str) -> None:
        """SIGKILL session `key`'s main container from the host and remove it; nothing else.

        The FTP sidecar, network and output stay: the session then shows as
        "stopped" and the daemon's next round makes it again (`Recreate`), with
        its devices granted anew. Idempotent: no main container is done.
        """
        if stopping.end_main(self.engine, key, self.sessions.find(key)):
            log.warning("%s: main container removed, to be made again", key)

    def _end(self, key: str, found: Found) -> None:
        session = self.sessions.session_of(key, found)
        stopping.end_containers(self.engine, key, found)
        self.sessions.remove_networks(key)
        detach(self.config, key)
        self.ends.forget(key)
        self.files.remove(key)
        if session is None:
            log.debug("%s: nothing to stop", key)
            return
        log.info("%s: stopped; its output goes to %s", key, session.output_dir)
        self.finish_stop(session)

    def finish_stop(self, session: Session) -> None:
        """What follows a session's removal: its output handed to its login's owner and dated.

        Also called for a stop that a daemon restart interrupted after the
        containers were gone. Logs, never raises (see `outputs.handover`).
        """
        # imported here: gpuresa.outputs builds on this package's gateway and output helpers
        from gpuresa.outputs.handover import finish_output

        finish_output(self.config, session)

    # --- during a session ------------------------------------------------------------------

    def message(self, key: str, text: str) -> None:
        """Show `text` to the session's user; returns at once, never waits on the container.

        The text is written on the host as the session's last message
        (/etc/gpuresa/session/message inside), and `wall` is started in the
        container without waiting for it (best effort: the user may have
        replaced it). Never fails the caller for a session that is not
        running; only `RuntimeUnavailable` and `EngineTimeout` of the lookup
        pass through.
        """
        found = self.sessions.find(key)
        if found.main is None or status(found.main) != "running":
            log.info("%s: not running; message not shown: %s", key, text)
            return
        try:
            self.files.show_message(key, text, datetime.now(UTC))
        except SessionError as error:
            log.warning("%s: %s", key, error)
        try:
            self.engine.execute_detached(
                container_name(found.main), ["wall", "-n", "--", text], key
            )
        except SessionError as error:
            log.warning("%s: could not start wall: %s", key, error)
            return
        log.info("%s: message shown: %s", key, text)

    def used(self, key: str) -> bool | None:
        """The protocol's `used`: the session's logs (`logins.session_used`)."""
        found = self.sessions.find(key)
        session = self.sessions.session_of(key, found)
        if session is None or session.state != "running":
            return None
        return session_used(self.engine, found, session.user, key)

    def signal(self, key: str, number: Signals) -> int:
        """The protocol's `signal`, sent from the host (`stopping.signal_processes`)."""
        return stopping.signal_processes(key, self.sessions.find(key).main, number)

    def extend(self, key: str, end: datetime) -> None:
        """Record that session `key` now ends at `end`, and show it in the session.

        `list_sessions()` returns the new end from then on; the login banner,
        motd and /etc/gpuresa/session/end show it (files written on the host:
        nothing runs in the container). A session that does not exist is left
        alone. Raises `SessionError` when the record cannot be written.
        """
        found = self.sessions.find(key)
        if not found.all:
            log.info("%s: no session to extend", key)
            return
        self.ends.record(key, end)
        session = self.sessions.session_of(key, found)
        if session is not None and found.main is not None:
            self.sessions.show_facts(key, session)
            self.sessions.renew_host_certificate(key, session.start, end)
        log.info("%s: now ends at %s", key, utc_text(end))

    # --- leftovers -------------------------------------------------------------------------

    def collect_garbage(
        self, busy: set[str], *, network_min_age: timedelta = NETWORK_MIN_AGE
    ) -> list[str]:
        """Remove what no session uses: leaked networks and their firewall rules, old images.

        Given the keys of the sessions with an action in flight (their
        networks are kept). Networks are this host's session networks with no
        container (see `garbage.leaked_networks`; younger than
        `network_min_age` ones are kept); rules those of gone networks (see
        `firewall`); images are those built for this host under
        `templates.image_prefix` whose tag is no template's current one and
        that no container uses. Returns the names, rules and tags removed.
        """
        host = self.config.daemon.host
        installation = self.sessions.installation
        removed = garbage.leaked_networks(self.engine, host, installation, busy, network_min_age)
        removed += firewall.collect(self.engine, host, installation)
        removed += release_unused(
            self.config, lambda: {session.key for session in self.list_sessions()} | busy
        )
        return removed + garbage.old_images(self.engine, self.images, host)

    def cleanup(self, busy: Collection[str]) -> list[str]:
        """The session protocol's `cleanup`: `collect_garbage` with the default ages."""
        return self.collect_garbage(set(busy))

    # --- for the admin commands ------------------------------------------------------------

    def new_spec(
        self,
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
        """A spec for an ad-hoc session with GPUs and ports free now (see `specs.new_spec`)."""
        return new_spec(
            self.config,
            self.list_sessions(),
            self.sessions.host_gpus(),
            user,
            template,
            end,
            cuda=cuda,
            gpus=gpus,
            start=start,
            key=key,
            email=email,
        )
