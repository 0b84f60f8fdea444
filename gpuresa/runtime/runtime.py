"""Sessions on Docker: create, start, check, adopt, message and remove them.

A session is three Docker objects named after the host and the reservation key
(see `payload.session_name`): a network of its own, the main container (the
template's image with sshd for the booked login) and an FTP sidecar serving
the output folder. All three carry `gpuresa.*` labels, so `list_sessions()`
rebuilds every session from Docker alone and a restarted daemon adopts what
runs. The one thing labels cannot say is a moved end time (labels are fixed
at creation): that is kept in `<state_dir>/sessions/<key>.json`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from gpuresa.access import (
    AccessError,
    authorized_keys,
    container_uid,
    ftp_credentials,
)
from gpuresa.config import Config, HostConfig
from gpuresa.model import Session, SessionSpec
from gpuresa.outputs.credentials import HostCredentials
from gpuresa.outputs.disk import apply_session_quota, start_refusal
from gpuresa.runtime.engine import Engine, EngineRefused, dumps
from gpuresa.runtime.errors import RuntimeUnavailable, SessionError
from gpuresa.runtime.images import Images
from gpuresa.runtime.output import output_path, prepare_output, remap_base
from gpuresa.runtime.payload import (
    FTP_ROLE,
    HOST_LABEL,
    KEY_LABEL,
    MAIN_ROLE,
    NETWORK_ROLE,
    ROLE_LABEL,
    GpuAccess,
    MainContainer,
    ftp_name,
    ftp_payload,
    gpu_access,
    main_payload,
    passive_address,
    session_from_labels,
    session_labels,
    session_name,
    utc_text,
)
from gpuresa.runtime.probes import ftp_greeting, ssh_handshake
from gpuresa.runtime.records import EndRecords
from gpuresa.runtime.specs import check_spec, new_spec
from gpuresa.runtime.templates import resolve_template

if TYPE_CHECKING:
    from docker import DockerClient


log = logging.getLogger(__name__)

# How often readiness is probed while a session starts.
PROBE_INTERVAL = 0.05
# How long `host_gpus()` trusts what nvidia-smi said.
GPU_LIST_LIFETIME = timedelta(minutes=5)
SET_END_COMMAND = "/opt/gpuresa/set-end.sh"


@dataclass(frozen=True)
class _Found:
    """A session's containers as Docker shows them, by role."""

    main: dict[str, Any] | None
    ftp: dict[str, Any] | None

    @property
    def all(self) -> list[dict[str, Any]]:
        return [container for container in (self.main, self.ftp) if container is not None]

    @property
    def complete(self) -> bool:
        return self.main is not None and self.ftp is not None


def _status(container: dict[str, Any] | None) -> str:
    if container is None:
        return "missing"
    return str(container.get("State", {}).get("Status", "unknown"))


def _name(container: dict[str, Any]) -> str:
    """A container's name (readable in logs and errors), else its id."""
    return str(container.get("Name") or container["Id"]).lstrip("/")


def _environment(container: dict[str, Any]) -> dict[str, str]:
    pairs = (item.partition("=") for item in container.get("Config", {}).get("Env") or [])
    return {name: value for name, _, value in pairs}


def end_text(end: datetime, timezone: str) -> str:
    """An end time for people: in the site's time zone, with UTC alongside."""
    local = end.astimezone(ZoneInfo(timezone))
    utc = end.astimezone(UTC)
    if timezone == "UTC":
        return f"{utc:%Y-%m-%d %H:%M} UTC"
    return f"{local:%Y-%m-%d %H:%M} {local.tzname()} ({utc:%H:%M} UTC)"


class Runtime:
    """The sessions of this daemon's host, kept in Docker.

    Given the config and optionally a `docker.DockerClient` (else one is made
    from the environment on first use: making a Runtime never needs Docker).
    Every method raises `RuntimeUnavailable` when the engine does not answer;
    requests that cannot be served raise `SessionError` with the reason.
    """

    def __init__(self, config: Config, client: DockerClient | None = None) -> None:
        self.config = config
        self.engine = Engine(client)
        self.images = Images(config.templates, self.engine)
        self.ends = EndRecords(config.daemon.state_dir / "sessions")
        self._remap: tuple[int, int] | None = None
        self._gpus: tuple[datetime, tuple[int, ...]] | None = None

    # --- what the host has -----------------------------------------------------------------

    @property
    def host(self) -> HostConfig:
        """This daemon's [[hosts]] entry."""
        return self.config.host()

    def host_gpus(self) -> tuple[int, ...]:
        """The GPU indices this host hands out.

        The configured list, or for "auto" what `nvidia-smi` reports (asked at
        most every few minutes); empty when gpu_mode is "none" or nvidia-smi is
        absent or fails.
        """
        host = self.host
        if host.gpu_mode == "none":
            return ()
        if isinstance(host.gpus, tuple):
            return host.gpus
        now = datetime.now(UTC)
        if self._gpus is not None and now - self._gpus[0] < GPU_LIST_LIFETIME:
            return self._gpus[1]
        command = ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=20, check=True)
            indices = tuple(int(line) for line in result.stdout.split() if line.strip().isdigit())
        except FileNotFoundError:
            log.warning('host %s: gpus = "auto" but nvidia-smi is not installed', host.name)
            indices = ()
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
            log.warning("host %s: nvidia-smi failed: %s", host.name, error)
            indices = ()
        self._gpus = (now, indices)
        return indices

    def remapped_ids(self) -> tuple[int, int]:
        """The host uid and gid of root in containers.

        Raises `SessionError` when the engine runs without user namespaces
        (see `require_user_namespaces`): sessions are never made there.
        """
        if self._remap is None:
            info = self.engine.info()
            require_user_namespaces(info)
            self._remap = remap_base(info)
        return self._remap

    # --- images ----------------------------------------------------------------------------

    def ensure_image(self, template: str, cuda: str | None) -> str:
        """The image tag of `template`'s variant `cuda`, built if missing (see `Images`)."""
        return self.images.ensure_image(template, cuda)

    def image_present(self, template: str, cuda: str | None) -> bool:
        """Whether `ensure_image` would return at once: no pull, no build."""
        return self.images.image_present(template, cuda)

    def ensure_ftp_image(self) -> str:
        """The FTP sidecar's image tag, built if missing."""
        return self.images.ensure_ftp_image()

    # --- reading sessions back from Docker -------------------------------------------------

    def list_sessions(self) -> list[Session]:
        """Every session of this host, rebuilt from its containers' labels.

        state: "running" (both containers run), "created" (prepared: the main
        container not yet started) or "stopped" (anything else: exited, half
        there). The end is
        the latest one `extend()` recorded, else the label's. Containers whose
        labels gpuresa did not write are logged and left out.
        """
        containers = self.engine.containers({"label": [f"{HOST_LABEL}={self.config.daemon.host}"]})
        grouped: dict[str, list[dict[str, Any]]] = {}
        for container in containers:
            key = container.get("Config", {}).get("Labels", {}).get(KEY_LABEL)
            if key is not None:
                grouped.setdefault(key, []).append(container)
        sessions = []
        for key, members in grouped.items():
            session = self._session(key, self._by_role(members))
            if session is not None:
                sessions.append(session)
        return sorted(sessions, key=lambda session: (session.start, session.key))

    def session(self, key: str) -> Session | None:
        """The session `key` of this host as Docker shows it, or None."""
        return self._session(key, self._find(key))

    def _find(self, key: str) -> _Found:
        containers = self.engine.containers(
            {"label": [f"{HOST_LABEL}={self.config.daemon.host}", f"{KEY_LABEL}={key}"]}
        )
        return self._by_role(containers)

    @staticmethod
    def _by_role(containers: list[dict[str, Any]]) -> _Found:
        main = ftp = None
        for container in containers:
            role = container.get("Config", {}).get("Labels", {}).get(ROLE_LABEL)
            if role == MAIN_ROLE:
                main = container
            elif role == FTP_ROLE:
                ftp = container
        return _Found(main, ftp)

    def _session(self, key: str, found: _Found) -> Session | None:
        reference = found.main or found.ftp
        if reference is None:
            return None
        main, sidecar = _status(found.main), _status(found.ftp)
        if main == sidecar == "running":
            state = "running"
        elif main == "created" and sidecar in ("created", "running"):
            # prepared: the sidecar may already run, the user's container not yet
            state = "created"
        else:
            # exited, killed, or half there
            state = "stopped"
        password = _environment(found.ftp).get("FTP_PASSWORD", "") if found.ftp else ""
        names = tuple(_name(container) for container in found.all)
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

    def _gpu_access(self, gpus: Sequence[int]) -> GpuAccess:
        """`gpu_access` with what this host's /dev and driver files hold."""
        host = self.host
        if host.gpu_mode != "devices" or not gpus:
            return gpu_access(host, gpus)
        devices = {str(path) for path in Path("/dev").glob("nvidia*")}
        libraries = _expand(host.driver_libraries, "driver_libraries")
        binaries = _expand(host.driver_binaries, "driver_binaries")
        return gpu_access(host, gpus, devices, libraries, binaries)

    # --- the life of a session -------------------------------------------------------------

    def prepare(self, spec: SessionSpec) -> Session:
        """Make everything a session needs short of starting it; returns it ("created").

        The image is built if missing, the output folder made, the network and
        both containers created, and the FTP sidecar started (it publishes most
        of the ports, so its start is the slow one; the main container, and so
        the user's SSH access, starts only with `start`). Idempotent: a session
        that is already created or running is returned as it is; one that
        stopped or is half there is removed and made again (its output folder
        is kept). Raises `SessionError` before creating anything for a spec
        that cannot be served (see `check_spec`, plus a login with no SSH key);
        a creation that fails midway is undone.
        """
        session, _ = self._prepare(spec, start_sidecar=True)
        return session

    def _prepare(self, spec: SessionSpec, *, start_sidecar: bool) -> tuple[Session, _Found]:
        key = spec.key
        self.check_spec(spec)
        # before anything is made: an engine without user namespaces is refused
        remapped_uid, remapped_gid = self.remapped_ids()
        found = self._find(key)
        existing = self._session(key, found)
        if existing is not None and found.complete and existing.state in ("created", "running"):
            log.debug("%s: already %s", key, existing.state)
            return existing, found
        if found.all:
            log.info(
                "%s: removing its %s containers to make them again",
                key,
                existing.state if existing else "unreadable",
            )
            self._remove(key, found)
        # a nearly full output disk refuses new sessions; running ones go on
        refusal = start_refusal(self.config, key)
        if refusal is not None:
            log.error("%s: refused: %s", key, refusal)
            raise SessionError(f"session {key}: {refusal}")
        users = self.config.users
        try:
            keys = authorized_keys(spec.user, users)
            uid = container_uid(spec.user, users)
            credentials = ftp_credentials(spec.user)
        except AccessError as error:
            raise SessionError(f"session {key}: {error}") from None
        template, variant = resolve_template(self.config.templates, spec.template, spec.cuda)
        gpu = self._gpu_access(spec.gpus)
        image = self.ensure_image(spec.template, variant.name)
        ftp_image = self.ensure_ftp_image()
        output_dir = output_path(self.config, spec)
        prepare_output(output_dir, remapped_uid + uid, remapped_gid + uid, key)
        apply_session_quota(self.config, output_dir, key)
        # the host's own SSH host keys and FTPS certificate, readable by the containers' root
        host_credentials = HostCredentials(self.config)
        host_keys = host_credentials.session_host_keys(remapped_uid, remapped_gid)
        tls = host_credentials.sidecar_tls(remapped_uid, remapped_gid)

        labelled = dataclasses.replace(spec, cuda=variant.name)
        labels = session_labels(labelled, uid, output_dir, credentials.user)
        main = MainContainer(
            image=image,
            uid=uid,
            authorized_keys=keys,
            output_dir=output_dir,
            end_text=end_text(spec.end, self.config.reservations.timezone),
            command=template.command or (),
            gpu=gpu,
            host_keys_dir=host_keys,
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
            self._announced_address(key),
            tls_dir=tls,
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
            raise SessionError(f"session {key} could not be prepared: {error}") from None
        self.ends.forget(key)
        log.info(
            "%s: prepared for %s (template %s %s, GPUs %s, ssh %d, ftp %d)",
            key, spec.user, spec.template, variant.name, list(spec.gpus),
            spec.ssh_port, spec.ftp_port,
        )  # fmt: skip
        found = self._find(key)
        session = self._session(key, found)
        if session is None:
            raise SessionError(f"session {key} was created but Docker does not list it")
        return session, found

    def start(self, spec: SessionSpec, ready_timeout: float = 30) -> Session:
        """Start the session of `spec` and return it once SSH and FTP answer.

        Prepares it first when needed. Ready means: sshd completes an SSH key
        exchange and the FTP server greets, both on the published ports.
        Idempotent: a running session is returned as it is. On failure the
        session's containers and network are removed (ports freed, output kept)
        and `SessionError` says why, with the end of the containers' logs.
        """
        key = spec.key
        started = time.monotonic()
        existing = self.session(key)
        if existing is not None and existing.state == "running":
            log.debug("%s: already running", key)
            return existing
        if existing is not None and self._restart_sidecar(key, existing, started + ready_timeout):
            return self.session(key) or existing
        # from nothing, both containers start at once below: faster than in turn
        session, found = self._prepare(spec, start_sidecar=False)
        waiting = {
            role: container
            for role, container in ((MAIN_ROLE, found.main), (FTP_ROLE, found.ftp))
            if container is not None and _status(container) != "running"
        }
        try:
            with ThreadPoolExecutor(max_workers=2) as pool:
                starting = {
                    role: pool.submit(self.engine.start_container, _name(container), key)
                    for role, container in waiting.items()
                }
                self._wait_ready(key, session, started + ready_timeout, starting)
            if found.main is not None:
                self._show_recorded_end(key, _name(found.main))
        except RuntimeUnavailable:
            raise
        except SessionError as error:
            logs = self._log_tails(found)
            log.error("%s: start failed: %s%s", key, error, logs)
            self._remove_quietly(key)
            raise SessionError(f"session {key} did not start: {error}{logs}") from None
        running = self.session(key) or session
        log.info(
            "%s: running for %s in %.2f s (ssh port %d, ftp port %d)",
            key, running.user, time.monotonic() - started, running.ssh_port, running.ftp_port,
        )  # fmt: skip
        return running

    def _restart_sidecar(self, key: str, session: Session, deadline: float) -> bool:
        """Start a session's exited FTP sidecar alone, leaving the user's container be.

        Returns False (and does nothing) unless the main container runs and the
        sidecar exists but does not: then the whole session is made again.
        """
        found = self._find(key)
        if _status(found.main) != "running" or found.ftp is None:
            return False
        if _status(found.ftp) == "running":
            return False
        log.warning("%s: the FTP sidecar had exited; starting it again", key)
        self.engine.start_container(_name(found.ftp), key)
        address = self._probe_address()
        while time.monotonic() < deadline:
            if ftp_greeting(address, session.ftp_port, 2.0):
                return True
            time.sleep(0.1)
        raise SessionError(f"session {key}: the restarted FTP server does not answer")

    def _show_recorded_end(self, key: str, container: str) -> None:
        """A session extended before it started shows its new end from the first login.

        A banner that cannot be written is logged: it never fails a start.
        """
        recorded = self.ends.recorded(key)
        if recorded is None:
            return
        try:
            self._set_end(key, container, recorded)
        except SessionError as error:
            log.warning("%s: %s", key, error)

    def _set_end(self, key: str, container: str, end: datetime) -> None:
        text = end_text(end, self.config.reservations.timezone)
        code, output = self.engine.execute(container, [SET_END_COMMAND, utc_text(end), text], key)
        if code != 0:
            raise SessionError(f"session {key}: could not write the new end time: {output.strip()}")

    def _announced_address(self, key: str) -> str:
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

    def _probe_address(self) -> str:
        address = self.host.bind_address
        return (
            "127.0.0.1" if address in ("0.0.0.0", "") else ("::1" if address == "::" else address)
        )

    def _wait_ready(
        self, key: str, session: Session, deadline: float, starting: dict[str, Future[None]]
    ) -> None:
        """Wait until sshd completes a key exchange and FTP greets; else `SessionError`.

        `starting` holds the container starts still under way, by role: a
        server is probed once its container's start returned, and a start that
        failed is raised at once.
        """
        address = self._probe_address()
        ssh_ready = ftp_ready = False
        next_check = time.monotonic() + 0.5

        def started(role: str) -> bool:
            future = starting.get(role)
            if future is None:
                return True
            if not future.done():
                return False
            future.result()  # raises what the start raised
            return True

        while True:
            remaining = min(2.0, max(deadline - time.monotonic(), 0.1))
            if not ssh_ready and started(MAIN_ROLE):
                ssh_ready = ssh_handshake(address, session.ssh_port, remaining)
            if not ftp_ready and started(FTP_ROLE):
                ftp_ready = ftp_greeting(address, session.ftp_port, remaining)
            if ssh_ready and ftp_ready:
                return
            if time.monotonic() >= deadline:
                late = " and ".join(
                    what
                    for what, ready in (("sshd", ssh_ready), ("the FTP server", ftp_ready))
                    if not ready
                )
                raise SessionError(f"{late} did not answer within the time allowed")
            if time.monotonic() >= next_check and all(
                future.done() for future in starting.values()
            ):
                self._check_still_running(key)
                next_check = time.monotonic() + 0.5
            time.sleep(PROBE_INTERVAL)

    def _check_still_running(self, key: str) -> None:
        found = self._find(key)
        for role, container in (("main container", found.main), ("FTP sidecar", found.ftp)):
            if _status(container) not in ("running", "created"):
                code = (container or {}).get("State", {}).get("ExitCode")
                raise SessionError(
                    f"the {role} stopped (status {_status(container)}, exit code {code})"
                )

    def _log_tails(self, found: _Found) -> str:
        parts = []
        for role, container in (("main container", found.main), ("FTP sidecar", found.ftp)):
            if container is None:
                continue
            text = self.engine.logs(_name(container), 15).strip()
            if text:
                parts.append(f"\n--- log of the {role}:\n{text}")
        return "".join(parts)

    def stop(self, key: str, grace: timedelta) -> None:
        """End session `key`: its processes get SIGTERM and `grace` to exit, then all is removed.

        Idempotent: a session that is gone or going counts as stopped. The
        output folder is never deleted: it is handed to its login's owner (see
        `outputs.handover`).
        """
        found = self._find(key)
        session = self._session(key, found)
        if found.main is not None and _status(found.main) == "running" and grace > timedelta(0):
            self._end_user_processes(key, found.main, grace)
        # the user's processes had their grace: what is left may be killed
        _in_parallel(
            [
                functools.partial(self.engine.remove_container, container["Id"], key)
                for container in found.all
            ]
        )
        self._remove_networks(key)
        self.ends.forget(key)
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

    def _end_user_processes(self, key: str, main: dict[str, Any], grace: timedelta) -> None:
        """SIGTERM every process of the session's login, then wait up to `grace` for them."""
        uid = main["Config"]["Labels"].get("gpuresa.uid", "")
        if not uid.isdigit():
            return
        container = _name(main)
        try:
            code, _ = self.engine.execute(container, ["pkill", "-TERM", "-U", uid], key)
            if code != 0:
                return  # nobody's processes (or no pkill in the image)
            log.info("%s: asked the user's processes to end; waiting up to %s", key, grace)
            deadline = time.monotonic() + grace.total_seconds()
            while time.monotonic() < deadline:
                code, _ = self.engine.execute(container, ["pgrep", "-U", uid], key)
                if code != 0:
                    return
                time.sleep(0.25)
            log.info("%s: the user's processes outlived the grace period; killing them", key)
        except EngineRefused as error:
            log.warning("%s: could not signal the user's processes: %s", key, error)

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

    def _remove(self, key: str, found: _Found | None = None) -> None:
        """Remove a session's containers and network at once (no grace, output kept)."""
        _in_parallel(
            [
                functools.partial(self.engine.remove_container, container["Id"], key)
                for container in (found or self._find(key)).all
            ]
        )
        self._remove_networks(key)

    def _remove_quietly(self, key: str) -> None:
        """Roll back after a failure; a failing rollback is logged, never hides the first error."""
        try:
            self._remove(key)
        except (SessionError, RuntimeUnavailable) as error:
            log.error("%s: rollback failed, leftovers may remain: %s", key, error)

    # --- during a session ------------------------------------------------------------------

    def message(self, key: str, text: str) -> None:
        """Write `text` on the terminals of the session's logged-in users (`wall`).

        Never fails the caller for a session that is not running or has nobody
        logged in; only `RuntimeUnavailable` passes through.
        """
        found = self._find(key)
        if found.main is None or _status(found.main) != "running":
            log.info("%s: not running; message not shown: %s", key, text)
            return
        try:
            code, output = self.engine.execute(_name(found.main), ["wall", "-n", "--", text], key)
        except EngineRefused as error:
            log.warning("%s: could not show a message: %s", key, error)
            return
        if code != 0:
            log.warning("%s: wall failed (%d): %s", key, code, output.strip())
        else:
            log.info("%s: message shown: %s", key, text)

    def extend(self, key: str, end: datetime) -> None:
        """Record that session `key` now ends at `end`, and show it in the session.

        `list_sessions()` returns the new end from then on; the login banner
        and motd show it (written in the running container). A session that
        does not exist is left alone.
        """
        found = self._find(key)
        if not found.all:
            log.info("%s: no session to extend", key)
            return
        self.ends.record(key, end)
        if found.main is not None and _status(found.main) == "running":
            self._set_end(key, _name(found.main), end)
        log.info("%s: now ends at %s", key, utc_text(end))

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


# SecurityOptions names under which root in a container is not root on the host
USER_NAMESPACE_OPTIONS = frozenset({"userns", "rootless"})


def require_user_namespaces(info: Mapping[str, Any]) -> None:
    """Check that the engine whose `docker info` is `info` runs containers in user namespaces.

    Given the engine's info; returns when its SecurityOptions name `userns`
    (userns-remap) or `rootless`. Raises `SessionError` otherwise: a session's
    user has sudo in its container, which without user namespaces is root on
    the host.
    """
    names = set()
    for option in info.get("SecurityOptions") or []:
        # "name=userns" since API 1.26, a bare "userns" before
        fields = dict(part.partition("=")[::2] for part in str(option).split(","))
        names.add(fields.get("name", str(option)))
    if not names & USER_NAMESPACE_OPTIONS:
        raise SessionError(
            "the Docker engine runs without user namespaces; set userns-remap (for example "
            '"userns-remap": "default" in /etc/docker/daemon.json) and restart Docker, or run '
            "Docker rootless: without them a session's root is root on the host"
        )


def _in_parallel(calls: Sequence[Callable[[], object]]) -> None:
    """Run `calls` at once and wait for all; the first failure is raised after."""
    if len(calls) <= 1:
        for call in calls:
            call()
        return
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
    errors = [future.exception() for future in futures]
    for error in errors:
        if error is not None:
            raise error


def _expand(paths: Sequence[Path], key: str) -> list[Path]:
    """Config paths with glob patterns expanded; a plain path that is missing is refused."""
    expanded: list[Path] = []
    for path in paths:
        text = str(path)
        if re.search(r"[*?\[]", text):
            matches = sorted(Path("/").glob(text.lstrip("/")))
            if not matches:
                log.warning("hosts.%s: %s matches no file", key, text)
            expanded.extend(matches)
        elif path.exists():
            expanded.append(path)
        else:
            raise SessionError(f"hosts.{key}: {path} does not exist on this host")
    return expanded
