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
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from gpuresa.access import (
    AccessError,
    authorized_keys,
    container_uid,
    ftp_credentials,
    host_account,
)
from gpuresa.config import Config, HostConfig
from gpuresa.model import Session, SessionSpec
from gpuresa.runtime import garbage, stopping
from gpuresa.runtime.engine import Engine, dumps
from gpuresa.runtime.errors import (
    EngineTimeout,
    ImageMissing,
    PortRefused,
    RuntimeUnavailable,
    SessionError,
)
from gpuresa.runtime.gpus import HostGpus, host_gpu_access
from gpuresa.runtime.images import Images
from gpuresa.runtime.lookup import Found, by_role, container_name, environment, status
from gpuresa.runtime.namespaces import require_user_namespaces
from gpuresa.runtime.output import hand_over, output_path, prepare_output, remap_base
from gpuresa.runtime.payload import (
    FTP_ROLE,
    HOST_LABEL,
    KEY_LABEL,
    MAIN_ROLE,
    NETWORK_ROLE,
    ROLE_LABEL,
    MainContainer,
    ftp_name,
    ftp_payload,
    main_payload,
    passive_address,
    session_from_labels,
    session_labels,
    session_name,
    utc_text,
)
from gpuresa.runtime.readiness import log_tails, wait_ready
from gpuresa.runtime.records import EndRecords
from gpuresa.runtime.session_files import SessionFacts, SessionFiles, end_text
from gpuresa.runtime.sidecar import revive_sidecar
from gpuresa.runtime.specs import check_spec, new_spec
from gpuresa.runtime.templates import resolve_template

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
        self.engine = Engine(client)
        self.images = Images(config.templates, self.engine, config.daemon.host)
        self.ends = EndRecords(config.daemon.state_dir / "sessions")
        self.files = SessionFiles(config.daemon.state_dir / "sessions")
        self._gpus = HostGpus()

    # --- what the host has -----------------------------------------------------------------

    @property
    def host(self) -> HostConfig:
        """This daemon's [[hosts]] entry."""
        return self.config.host()

    def host_gpus(self) -> tuple[int, ...]:
        """The GPU indices this host hands out (see `gpus.HostGpus.indices`)."""
        return self._gpus.indices(self.host)

    def remapped_ids(self) -> tuple[int, int]:
        """The host uid and gid of root in containers, asked of the engine each time.

        Raises `SessionError` when the engine runs without user namespaces
        (see `require_user_namespaces`): sessions are never made there. Never
        cached: an engine restarted without userns-remap is refused at once.
        """
        info = self.engine.info()
        require_user_namespaces(info)
        return remap_base(info)

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

    # --- reading sessions back from Docker -------------------------------------------------

    def list_sessions(self) -> list[Session]:
        """Every session of this host, rebuilt from its containers' labels.

        state: "running" (both containers run), "created" (prepared: the main
        container not yet started) or "stopped" (anything else: exited, half
        there). The end is the latest one `extend()` recorded, else the
        label's. Containers whose labels gpuresa did not write are logged and
        left out.
        """
        containers = self.engine.containers({"label": [f"{HOST_LABEL}={self.config.daemon.host}"]})
        grouped: dict[str, list[dict[str, Any]]] = {}
        for container in containers:
            key = container.get("Config", {}).get("Labels", {}).get(KEY_LABEL)
            if key is not None:
                grouped.setdefault(key, []).append(container)
        sessions = []
        for key, members in grouped.items():
            session = self._session(key, by_role(members))
            if session is not None:
                sessions.append(session)
        return sorted(sessions, key=lambda session: (session.start, session.key))

    def session(self, key: str) -> Session | None:
        """The session `key` of this host as Docker shows it, or None."""
        return self._session(key, self.find(key))

    def find(self, key: str) -> Found:
        """The containers of session `key` (full `inspect`), by role."""
        containers = self.engine.containers(
            {"label": [f"{HOST_LABEL}={self.config.daemon.host}", f"{KEY_LABEL}={key}"]}
        )
        return by_role(containers)

    def _session(self, key: str, found: Found) -> Session | None:
        reference = found.main or found.ftp
        if reference is None:
            return None
        main, sidecar = status(found.main), status(found.ftp)
        if main == sidecar == "running":
            state = "running"
        elif main == "created" and sidecar in ("created", "running"):
            # prepared: the sidecar may already run, the user's container not yet
            state = "created"
        else:
            # exited, killed, or half there
            state = "stopped"
        password = environment(found.ftp).get("FTP_PASSWORD", "") if found.ftp else ""
        names = tuple(container_name(container) for container in found.all)
        try:
            return session_from_labels(
                reference["Config"]["Labels"], state, names, password, self.ends.recorded(key)
            )
        except (KeyError, ValueError) as error:
            log.warning("%s: containers %s have labels gpuresa cannot read (%s)", key, names, error)
            return None

    # --- checks before anything is made ----------------------------------------------------

    def check_spec(self, spec: SessionSpec) -> None:
        """Refuse, with a `SessionError`, a spec this host cannot serve (see `specs.check_spec`)."""
        check_spec(self.config, spec, self.host_gpus())

    # --- the life of a session -------------------------------------------------------------

    def prepare(self, spec: SessionSpec) -> Session:
        """Make everything a session needs short of starting it; returns it ("created").

        The output folder and the session's files are made, the network and
        both containers created, and the FTP sidecar started (it publishes most
        of the ports, so its start is the slow one; the main container, and so
        the user's SSH access, starts only with `start`). Never builds or
        pulls: a missing image raises `ImageMissing` before anything is made.
        Idempotent: a session that is already created or running is returned
        as it is; one that stopped or is half there is removed and made again
        (its output folder is kept). Raises `SessionError` before creating
        anything for a spec that cannot be served (see `check_spec`, plus a
        login with no SSH key, an engine without user namespaces); a creation
        that fails midway is undone (`PortRefused` names the ports Docker
        could not publish).
        """
        session, _ = self._prepare(spec, start_sidecar=True)
        return session

    def _prepare(self, spec: SessionSpec, *, start_sidecar: bool) -> tuple[Session, Found]:
        key = spec.key
        self.check_spec(spec)
        # before anything is made: an engine without user namespaces is refused
        remapped_uid, remapped_gid = self.remapped_ids()
        found = self.find(key)
        existing = self._session(key, found)
        if existing is not None and found.complete and existing.state in ("created", "running"):
            log.debug("%s: already %s", key, existing.state)
            return existing, found
        template, variant = resolve_template(self.config.templates, spec.template, spec.cuda)
        # images are built by the daemon's build worker, never here
        image = self.images.require_image(spec.template, variant.name)
        ftp_image = self.images.require_ftp_image()
        if found.all:
            log.info(
                "%s: removing its %s containers to make them again",
                key,
                existing.state if existing else "unreadable",
            )
            self._remove(key, found)
        users = self.config.users
        try:
            keys = authorized_keys(spec.user, users)
            uid = container_uid(spec.user, users)
            credentials = ftp_credentials(spec.user)
        except AccessError as error:
            raise SessionError(f"session {key}: {error}") from None
        gpu = host_gpu_access(self.host, spec.gpus)
        output_dir = output_path(self.config, spec)
        prepare_output(output_dir, remapped_uid + uid, remapped_gid + uid, key)
        labelled = dataclasses.replace(spec, cuda=variant.name)
        self.ends.forget(key)
        files = self.files.show_facts(key, self._facts(labelled), self.config.reservations.timezone)
        labels = session_labels(labelled, uid, output_dir, credentials.user)
        main = MainContainer(
            image=image,
            uid=uid,
            authorized_keys=keys,
            output_dir=output_dir,
            session_files=files,
            command=template.command or (),
            gpu=gpu,
        )
        main_config = main_payload(self.config, labelled, main, labels)
        sidecar_config = ftp_payload(
            self.config,
            labelled,
            ftp_image,
            uid,
            credentials.user,
            credentials.password,
            output_dir,
            labels,
            self.announced_address(key),
        )
        log.debug("%s: main container %s", key, dumps(main_config))
        log.debug("%s: FTP sidecar %s", key, dumps(sidecar_config))
        name = session_name(spec.host, key)
        sidecar = ftp_name(spec.host, key)
        try:
            self.engine.create_network(name, {**labels, ROLE_LABEL: NETWORK_ROLE}, key)
            self.engine.create_container(sidecar, sidecar_config, key)
            self.engine.create_container(name, main_config, key)
            if start_sidecar:
                self.engine.start_container(sidecar, key)
        except SessionError as error:
            self._remove_quietly(key)
            raise _same_kind(error, f"session {key} could not be prepared: {error}") from None
        log.info(
            "%s: prepared for %s (template %s %s, GPUs %s, ssh %d, ftp %d)",
            key, spec.user, spec.template, variant.name, list(spec.gpus),
            spec.ssh_port, spec.ftp_port,
        )  # fmt: skip
        found = self.find(key)
        session = self._session(key, found)
        if session is None:
            raise SessionError(f"session {key} was created but Docker does not list it")
        return session, found

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
        started = time.monotonic()
        existing = self.session(key)
        if existing is not None and existing.state == "running":
            log.debug("%s: already running", key)
            return existing
        if existing is not None and revive_sidecar(self, key, started + ready_timeout):
            return self.session(key) or existing
        # from nothing, both containers start at once below: faster than in turn
        session, found = self._prepare(spec, start_sidecar=False)
        waiting = {
            role: container
            for role, container in ((MAIN_ROLE, found.main), (FTP_ROLE, found.ftp))
            if container is not None and status(container) != "running"
        }
        try:
            with ThreadPoolExecutor(max_workers=2) as pool:
                starting = {
                    role: pool.submit(self.engine.start_container, container_name(container), key)
                    for role, container in waiting.items()
                }
                wait_ready(
                    session,
                    self.probe_address(),
                    started + ready_timeout,
                    starting,
                    lambda: self.find(key),
                )
            self._show_facts(key, session)
        except SessionError as error:
            logs = log_tails(self.engine, found)
            log.error("%s: start failed: %s%s", key, error, logs)
            self._remove_quietly(key)
            raise _same_kind(error, f"session {key} did not start: {error}{logs}") from None
        running = self.session(key) or session
        log.info(
            "%s: running for %s in %.2f s (ssh port %d, ftp port %d)",
            key, running.user, time.monotonic() - started, running.ssh_port, running.ftp_port,
        )  # fmt: skip
        return running

    def _facts(self, session: Session | SessionSpec) -> SessionFacts:
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

    def _show_facts(self, key: str, session: Session) -> None:
        """Rewrite the session's banner, motd and end on the host (the recorded end wins)."""
        self.files.show_facts(key, self._facts(session), self.config.reservations.timezone)

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

    def _end(self, key: str, found: Found) -> None:
        session = self._session(key, found)
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
        """What follows a session's removal: its output handed to the login, if configured.

        Also called for a stop that a daemon restart interrupted after the
        containers were gone. Logs, never raises.
        """
        key = session.key
        if self.config.storage.hand_output_to_user:
            account = host_account(session.user)
            if account is None:
                log.warning(
                    "%s: %s has no account on this host: output stays with gpuresa",
                    key,
                    session.user,
                )
            elif session.output_dir.is_dir():
                hand_over(session.output_dir, account.uid, account.gid, key)

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

    def _remove(self, key: str, found: Found | None = None) -> None:
        """Remove a session's containers and network at once (no grace, output kept)."""
        found = found or self.find(key)
        stopping.kill_from_host(key, found)
        stopping.remove_containers(self.engine, key, found)
        self._remove_networks(key)

    def _remove_quietly(self, key: str) -> None:
        """Roll back after a failure; a failing rollback is logged, never hides the first error."""
        try:
            self._remove(key)
        except (SessionError, RuntimeUnavailable) as error:
            log.error("%s: rollback failed, leftovers may remain: %s", key, error)
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
        session = self._session(key, found)
        if session is not None and found.main is not None:
            self._show_facts(key, session)
        log.info("%s: now ends at %s", key, utc_text(end))

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


def _same_kind(error: SessionError, message: str) -> SessionError:
    """A `SessionError` saying `message`, of the same kind as `error` (with its details)."""
    if isinstance(error, PortRefused):
        return PortRefused(message, error.ports)
    if isinstance(error, ImageMissing):
        return ImageMissing(message, error.template, error.cuda)
    if isinstance(error, EngineTimeout):
        return EngineTimeout(message)
    return SessionError(message)
