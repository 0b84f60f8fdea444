"""Sessions on Docker: create, start, check, adopt, message, stop and remove them.

A session is three Docker objects named after the host and the reservation key
(see `payload.session_name`): a network of its own, the main container (the
template's image with sshd for the booked login) and an FTP sidecar serving
the output folder. All three carry `gpuresa.*` labels, so `list_sessions()`
rebuilds every session from Docker alone and a restarted daemon adopts what
runs. What labels cannot say is kept on the host under `<state_dir>/sessions`:
a moved end time (`records`), and the banner, motd and messages the session
shows (`session_files`, mounted read-only in the main container).

Nothing here runs anything in a session or waits on one (the user is root
there): stops signal from the host (`stopping`), messages and new end times
are files. Every engine call is bounded in time (`engine`). The methods may be
called from several threads at once for different sessions.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Collection, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from gpuresa.config.sections import Config, HostConfig
from gpuresa.model import Session, SessionSpec
from gpuresa.outputs.host_ca import HostCA
from gpuresa.runtime import garbage, stopping
from gpuresa.runtime.create_payloads import passive_address
from gpuresa.runtime.engine import Engine, EngineRefused
from gpuresa.runtime.engines import EngineKind, engine_kind
from gpuresa.runtime.errors import (
    RuntimeUnavailable,
    SessionError,
)
from gpuresa.runtime.gpus import HostGpus
from gpuresa.runtime.images import Images
from gpuresa.runtime.limits import HostTotals, totals_from_info
from gpuresa.runtime.lookup import (
    Found,
    by_key,
    by_role,
    container_name,
    container_roles,
    session_from,
    status,
)
from gpuresa.runtime.namespaces import require_user_namespaces
from gpuresa.runtime.payload import HOST_LABEL, KEY_LABEL, session_name, utc_text
from gpuresa.runtime.records import EndRecords
from gpuresa.runtime.session_files import SessionFacts, SessionFiles, end_text
from gpuresa.runtime.specs import check_spec, new_spec
from gpuresa.runtime.starting import HOST_KEYS_FOLDER, start_session

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
        host = next((host for host in config.hosts if host.name == config.daemon.host), None)
        self.kind: EngineKind = engine_kind(host.engine if host else "docker")
        socket = (host.engine_socket if host else None) or self.kind.default_socket
        self.engine = Engine(client, base_url=None if client else socket)
        self.images = Images(config.templates, self.engine, config.daemon.host)
        self.ends = EndRecords(config.daemon.state_dir / "sessions")
        self.files = SessionFiles(config.daemon.state_dir / "sessions")
        self._gpus = HostGpus()
        self._info: dict[str, Any] | None = None

    # --- what the host has -----------------------------------------------------------------

    @property
    def host(self) -> HostConfig:
        """This daemon's [[hosts]] entry."""
        return self.config.host()

    def host_gpus(self) -> tuple[int, ...]:
        """The GPU indices this host hands out (see `gpus.HostGpus.indices`)."""
        return self._gpus.indices(self.host)

    def host_totals(self) -> HostTotals:
        """The CPUs and memory of the engine's host (asked once) and the GPUs it hands out."""
        return totals_from_info(self.engine_info(), len(self.host_gpus()))

    def engine_info(self) -> dict[str, Any]:
        """The engine's `info`, asked once per `Runtime` (CPUs, memory, storage driver)."""
        if self._info is None:
            self._info = self.engine.info()
        return self._info

    def check_engine(self) -> None:
        """Refuse, with a `SessionError`, an engine where sessions get no user namespace.

        Docker must run with userns-remap (see `require_user_namespaces`);
        Podman must be the rootful service with a `containers` id range (see
        `engines`). Asked of the engine each time: one restarted without them
        is refused at once.
        """
        self.kind.check(self.engine)

    def check(self) -> None:
        """The session protocol's name for `check_engine`."""
        self.check_engine()

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
        containers = self.engine.containers({"label": [f"{HOST_LABEL}={self.config.daemon.host}"]})
        sessions = []
        for key, found in by_key(containers).items():
            session = self.session_of(key, found)
            if session is not None:
                sessions.append(session)
        ordered = sorted(sessions, key=lambda session: (session.start, session.key))
        return ordered, container_roles(containers)

    def session(self, key: str) -> Session | None:
        """The session `key` of this host as Docker shows it, or None."""
        return self.session_of(key, self.find(key))

    def find(self, key: str) -> Found:
        """The containers of session `key` (full `inspect`), by role."""
        containers = self.engine.containers(
            {"label": [f"{HOST_LABEL}={self.config.daemon.host}", f"{KEY_LABEL}={key}"]}
        )
        return by_role(containers)

    def session_of(self, key: str, found: Found) -> Session | None:
        """The session that containers `found` make up, with its recorded end (see `lookup`)."""
        try:
            id_range = self.kind.session_range(self.engine, found.main) if found.main else None
        except EngineRefused as error:
            log.debug("%s: id range not readable: %s", key, error)
            id_range = None
        return session_from(
            key, found, self.ends.recorded(key), gated=self.files.gated(key), id_range=id_range
        )

    # --- checks before anything is made ----------------------------------------------------

    def check_spec(self, spec: SessionSpec) -> None:
        """Refuse, with a `SessionError`, a spec this host cannot serve (see `specs.check_spec`)."""
        check_spec(self.config, spec, self.host_gpus())

    # --- the life of a session -------------------------------------------------------------

    def prepare(self, spec: SessionSpec, ready_timeout: float = 30) -> Session:
        """Make everything a session needs short of letting its user in; returns it ("created").

        The output folder and the session's files are made, the network and
        both containers created and started behind the login gate (see
        `session_files`), and sshd and FTP checked to answer: `start` then
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
        found = self.find(key)
        running = found.complete and status(found.main) == status(found.ftp) == "running"
        if running and not self.files.gated(key):
            session = self.session_of(key, found)
            if session is not None:
                return session  # already let in: started meanwhile
        self.files.close_gate(key, self._gate_text(spec))
        session = start_session(self, spec, ready_timeout)
        return dataclasses.replace(session, state="created")

    def _gate_text(self, spec: SessionSpec) -> str:
        timezone = self.config.reservations.timezone
        return f"gpuresa: this session opens at {end_text(spec.start, timezone)}; try again then."

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
        found = self.find(key)
        ready = found.complete and status(found.main) == status(found.ftp) == "running"
        if ready and self.files.gated(key):
            # prepared ahead: its servers answer already, only the gate was closed
            self.files.open_gate(key)
            session = self.session_of(key, found)
            if session is not None:
                log.info("%s: let in (prepared ahead; ssh port %d)", key, session.ssh_port)
                return session
        self.files.open_gate(key)
        return start_session(self, spec, ready_timeout)

    def facts(self, session: Session | SessionSpec) -> SessionFacts:
        storage = self.config.storage
        return SessionFacts(
            user=session.user,
            template=session.template,
            cuda=session.cuda,
            gpus=session.gpus,
            end=self.ends.recorded(session.key) or session.end,
            output_target=storage.output_target,
            input_targets=tuple(mount.target for mount in storage.inputs),
        )

    def show_facts(self, key: str, session: Session) -> None:
        """Rewrite the session's banner, motd and end on the host (the recorded end wins)."""
        self.files.show_facts(key, self.facts(session), self.config.reservations.timezone)

    def announced_address(self, key: str) -> str:
        """The IPv4 address PASV replies announce: `passive_address`, resolved on this host."""
        name = passive_address(self.host)
        if not name:
            return ""
        try:
            return socket.gethostbyname(name)
        except OSError as error:
            log.warning(
                "%s: cannot resolve %s for FTP passive mode (%s); clients must use the "
                "control connection's address",
                key, name, error,
            )  # fmt: skip
            return ""

    def probe_address(self) -> str:
        """Where this host's published ports are probed: the bound address, or loopback."""
        address = self.host.bind_address
        return (
            "127.0.0.1" if address in ("0.0.0.0", "") else ("::1" if address == "::" else address)
        )

    # --- the end of a session --------------------------------------------------------------

    def stop(self, key: str, grace: timedelta) -> None:
        """End session `key`: its processes get SIGTERM and up to `grace` to exit, then all goes.

        Runs nothing in the container and waits on nothing in it: every
        process of the main container (but its init and sshd) gets SIGTERM
        from the host, the grace ends early once they are all gone, then the
        containers' inits are SIGKILLed (the kernel kills everything left)
        and Docker removes the containers and the network. The output folder
        is kept (with storage.hand_output_to_user it is given to the login's
        host account). Idempotent: a session that is gone or going counts as
        stopped.
        """
        found = self.find(key)
        if found.main is not None and grace > timedelta(0):
            stopping.give_grace(key, found.main, grace)
        self._end(key, found)

    def kill(self, key: str) -> None:
        """End session `key` at once: SIGKILL from the host, forced removal; output kept.

        The escalation of a stop that takes too long; idempotent like `stop`.
        """
        self._end(key, self.find(key))

    def reset(self, key: str) -> None:
        """SIGKILL session `key`'s main container from the host and remove it; nothing else.

        The FTP sidecar, network and output stay: the session then shows as
        "stopped" and the daemon's next round makes it again (`Recreate`), with
        its devices granted anew. Idempotent: no main container is done.
        """
        found = self.find(key)
        if found.main is None:
            return
        main_only = Found(found.main, None)
        stopping.kill_from_host(key, main_only)
        stopping.remove_containers(self.engine, key, main_only)
        log.warning("%s: main container removed, to be made again", key)

    def _end(self, key: str, found: Found) -> None:
        session = self.session_of(key, found)
        stopping.kill_from_host(key, found)
        stopping.remove_containers(self.engine, key, found)
        self._remove_networks(key)
        self.ends.forget(key)
        self.files.remove(key)
        if session is None:
            log.debug("%s: nothing to stop", key)
            return
        log.info("%s: stopped; output kept in %s", key, session.output_dir)
        self.finish_stop(session)

    def finish_stop(self, session: Session) -> None:
        """What follows a session's removal: its output handed to its login's owner and dated.

        Also called for a stop that a daemon restart interrupted after the
        containers were gone. Logs, never raises (see `outputs.handover`).
        """
        # imported here: gpuresa.outputs builds on this package's gateway and output helpers
        from gpuresa.outputs.handover import finish_output

        finish_output(self.config, session)

    def _remove_networks(self, key: str) -> None:
        host = self.config.daemon.host
        networks = self.engine.networks({"label": [f"{HOST_LABEL}={host}", f"{KEY_LABEL}={key}"]})
        names = {str(network["Id"]) for network in networks}
        named = self.engine.networks({"name": session_name(host, key)})
        names.update(
            str(network["Id"])
            for network in named
            if network.get("Name") == session_name(host, key)
        )
        for network in names:
            self.engine.remove_network(network, key)

    def remove_now(self, key: str, found: Found | None = None) -> None:
        """Remove a session's containers and network at once (no grace, output kept)."""
        found = found or self.find(key)
        stopping.kill_from_host(key, found)
        stopping.remove_containers(self.engine, key, found)
        self._remove_networks(key)

    def roll_back(self, key: str) -> None:
        """Roll back after a failure; a failing rollback is logged, never hides the first error."""
        try:
            self.remove_now(key)
        except (SessionError, RuntimeUnavailable) as error:
            # the session's files stay: containers that may remain keep their gate closed
            log.error("%s: rollback failed, leftovers may remain: %s", key, error)
            return
        self.files.remove(key)

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
        found = self.find(key)
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

    def extend(self, key: str, end: datetime) -> None:
        """Record that session `key` now ends at `end`, and show it in the session.

        `list_sessions()` returns the new end from then on; the login banner,
        motd and /etc/gpuresa/session/end show it (files written on the host:
        nothing runs in the container). A session that does not exist is left
        alone. Raises `SessionError` when the record cannot be written.
        """
        found = self.find(key)
        if not found.all:
            log.info("%s: no session to extend", key)
            return
        self.ends.record(key, end)
        session = self.session_of(key, found)
        if session is not None and found.main is not None:
            self.show_facts(key, session)
            self._renew_host_certificate(key, session.start, end)
        log.info("%s: now ends at %s", key, utc_text(end))

    def _renew_host_certificate(self, key: str, start: datetime, end: datetime) -> None:
        """Sign the session's host key again up to its new end (sshd reads it per connection)."""
        folder = self.files.path(key) / HOST_KEYS_FOLDER
        try:
            HostCA(self.config).renew_session_certificate(folder, key, start, end)
        except FileNotFoundError:
            # made by an earlier version, with the shared keys: nothing to renew
            log.warning("%s: has no host key of its own; its certificate is not renewed", key)
        except (OSError, ValueError) as error:
            raise SessionError(
                f"session {key}: cannot renew its host certificate: {error}"
            ) from None

    # --- leftovers -------------------------------------------------------------------------

    def collect_garbage(
        self, busy: set[str], *, network_min_age: timedelta = NETWORK_MIN_AGE
    ) -> list[str]:
        """Remove what no session uses: leaked networks, images of old template versions.

        Given the keys of the sessions with an action in flight (their
        networks are kept). Networks are this host's session networks with no
        container (see `garbage.leaked_networks`; younger than
        `network_min_age` ones are kept); images are those built for this host
        under `templates.image_prefix` whose tag is no template's current one
        and that no container uses. Returns the names and tags removed.
        """
        host = self.config.daemon.host
        removed = garbage.leaked_networks(self.engine, host, busy, network_min_age)
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
            self.host_gpus(),
            user,
            template,
            end,
            cuda=cuda,
            gpus=gpus,
            start=start,
            key=key,
            email=email,
        )
