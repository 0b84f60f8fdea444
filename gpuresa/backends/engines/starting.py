"""Making and starting a session: checks first, then network, containers, readiness.

Nothing here builds or pulls an image (`ImageMissing`); every failure after
something was made rolls the session back (its output folder is kept) and
keeps its kind (`PortRefused` with its ports, `EngineTimeout`…).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from gpuresa.access import AccessError, authorized_keys, container_uid, ftp_credentials
from gpuresa.backends.engines.create_payloads import MainContainer, ftp_payload, main_payload
from gpuresa.backends.engines.engine import dumps
from gpuresa.backends.engines.firewall import guard_network
from gpuresa.backends.engines.forwarding import remove_stale_forwarding
from gpuresa.backends.engines.host_sessions import HostSessions
from gpuresa.backends.engines.layers import layer_plan
from gpuresa.backends.engines.lookup import Found, container_name, status
from gpuresa.backends.engines.readiness import log_tails, wait_ready
from gpuresa.backends.engines.sidecar import revive_sidecar
from gpuresa.gpus.devices import host_gpu_access
from gpuresa.homes.store import attach, home_maps, reserve_view, show_home
from gpuresa.model import Session, SessionSpec
from gpuresa.outputs.capped import cap_output
from gpuresa.outputs.credentials import HostCredentials
from gpuresa.outputs.disk import start_refusal
from gpuresa.outputs.folder import make_output_folder, output_path, prepare_output, take_back
from gpuresa.outputs.host_ca import HostCA
from gpuresa.outputs.running_area import ensure_area, remember, running_path, stored_path
from gpuresa.sessions.errors import EngineTimeout, ImageMissing, PortRefused, SessionError
from gpuresa.sessions.files import FTP_PASSWORD_FILE, HOST_KEYS_FOLDER
from gpuresa.sessions.labels import (
    FTP_ROLE,
    INSTALLATION_LABEL,
    MAIN_ROLE,
    NETWORK_ROLE,
    ROLE_LABEL,
    ftp_name,
    session_labels,
    session_name,
)
from gpuresa.sessions.limits import session_limits
from gpuresa.sessions.templates import resolve_template
from gpuresa.sessions.tool_access import show_tools
from gpuresa.sessions.tools import SESSION_SOCKETS

log = logging.getLogger(__name__)


def prepare_session(
    sessions: HostSessions, spec: SessionSpec, *, start_sidecar: bool
) -> tuple[Session, Found]:
    """`Runtime.prepare` on this host's `sessions`; also gives the containers found after.

    `Runtime.prepare` says what it does and raises.
    """
    key = spec.key
    sessions.check_spec(spec)
    found = sessions.find(key)
    existing = sessions.session_of(key, found)
    if existing is not None and found.complete and existing.state in ("created", "running"):
        # made under the check below; an engine without user namespaces (another
        # data root) would not even list it
        log.debug("%s: already %s", key, existing.state)
        if existing.state == "created":
            # a host restart since it was prepared took its view of the home away: its
            # container would bind the empty folder under it
            _show_home(sessions, existing)
        return existing, found
    # before anything is made, every time: an engine without user namespaces is refused
    sessions.check_engine()
    template, variant = resolve_template(sessions.config.templates, spec.template, spec.cuda)
    # images are built by the daemon's build worker, never here
    image = sessions.images.require_image(spec.template, variant.name)
    ftp_image = sessions.images.require_ftp_image()
    if found.all:
        log.info(
            "%s: removing its %s containers to make them again",
            key,
            existing.state if existing else "unreadable",
        )
        sessions.remove_now(key, found)
    # a nearly full output disk refuses new sessions; running ones go on
    refusal = start_refusal(sessions.config, key)
    if refusal is not None:
        log.error("%s: refused: %s", key, refusal)
        raise SessionError(f"session {key}: {refusal}")
    users = sessions.config.users
    try:
        keys = authorized_keys(spec.user, users)
        uid = container_uid(spec.user, users)
        credentials = ftp_credentials(spec.user)
    except AccessError as error:
        raise SessionError(f"session {key}: {error}") from None
    gpu = host_gpu_access(sessions.host, spec.gpu_indices)
    # labels keep the final place; the containers get the root-only running one
    # (outputs.running_area)
    output_dir = output_path(sessions.config, spec)
    ensure_area(sessions.config)
    running = running_path(sessions.config, key)
    take_back(output_dir, stored_path(sessions.config, key), key)
    make_output_folder(running)
    # the login's folder exists from the start (root's, empty until the hand-over), so the
    # output service has its account before the session ends: no gap once it has
    with contextlib.suppress(FileExistsError):
        (sessions.config.storage.output_root / spec.user).mkdir(mode=0o750)
    remember(sessions.config, key, spec.user, output_dir)
    # the cap comes before anything of the session's can write there (refused without room)
    cap_output(
        sessions.config,
        key,
        running,
        spec.gpu_count,
        len(sessions.host_gpus()),
        spec.preemptible,
    )
    labelled = dataclasses.replace(spec, cuda=variant.name)
    sessions.ends.forget(key)
    files = sessions.files.show_facts(
        key, sessions.facts(labelled), sessions.config.reservations.timezone
    )
    # the keys are a root-only host file mounted read-only, never the container's own
    sessions.files.show_keys(key, keys)
    # the installation's label: what tells its objects from another's on a shared engine
    labels = {
        **session_labels(labelled, uid, output_dir, credentials.user),
        INSTALLATION_LABEL: sessions.installation,
    }
    host_credentials = HostCredentials(sessions.config)
    host_keys = files / HOST_KEYS_FOLDER
    host_keys.mkdir(mode=0o700, exist_ok=True)
    layer = layer_plan(sessions.config.limits.layer_size, sessions.engine_info())
    home = reserve_view(sessions.config, spec.user, key)
    main = MainContainer(
        image=image,
        uid=uid,
        output_dir=running,
        session_files=files,
        command=template.command or (),
        gpu=gpu,
        engine_settings={**sessions.kind.main_settings(sessions.config.limits), **layer.settings},
        limits=session_limits(sessions.config.limits, sessions.host_totals(), spec.gpu_count),
        # this session's own SSH host key, made for its root once its ids are known
        host_keys_dir=host_keys,
        home_dir=home,
    )
    main_config = main_payload(sessions.config, labelled, main, labels)
    log.debug("%s: main container %s", key, dumps(main_config))
    name = session_name(spec.host, key)
    sidecar = ftp_name(spec.host, key)
    if sessions.kind.leaves_forwarding:
        # a gone container's forwarding of these ports would take their traffic
        remove_stale_forwarding(
            published_ports(spec),
            lambda: {str(item["Id"]) for item in sessions.engine.container_summaries({})},
            ":" in sessions.host.bind_address,
            key,
        )
    try:
        network = sessions.engine.create_network(name, {**labels, ROLE_LABEL: NETWORK_ROLE}, key)
        # before anything listens there: host accounts reach only what is published
        guard_network(sessions.engine, sessions.installation, network, key)
        main_id = sessions.engine.create_container(name, main_config, key)
        # the session's host ids are known once its main container exists (Podman
        # chooses them then); its output is theirs before anything of the user's runs
        ids = sessions.kind.created(sessions.engine, main_id, spec.gpu_indices, key)
        layer.cap(sessions.engine, sessions.config.daemon.state_dir, main_id, key)
        base_uid, base_gid = (ids.uid, ids.gid) if ids else (0, 0)
        prepare_output(running, base_uid + uid, base_gid + uid, key)
        if home is not None:
            if ids is None:
                # a home is shown only through the session's own ids, never as host ids
                raise SessionError(f"session {key}: its ids are not known: no home is shown")
            attach(sessions.config, spec.user, key, uid, home_maps(ids), home)
        # the FTP password, for the login alone to read in the session
        sessions.files.show_secret(
            key, FTP_PASSWORD_FILE, credentials.password + "\n", base_uid + uid, base_gid + uid
        )
        # the browser tools' commands, token and login lines (the last two for the login alone)
        show_tools(
            sessions.config,
            sessions.files,
            labelled,
            SESSION_SOCKETS,
            (base_uid + uid, base_gid + uid),
        )
        # a fresh host key of its own, certified for its time only, readable by its root;
        # the FTPS certificate for the sidecar's root
        try:
            HostCA(sessions.config).issue_session_key(
                host_keys, base_uid, base_gid, key, spec.start, spec.end, spec.ssh_port
            )
        except (OSError, ValueError) as error:
            raise SessionError(f"its host key cannot be made: {error}") from None
        tls = host_credentials.sidecar_tls(base_uid, base_gid)
        sidecar_config = ftp_payload(
            sessions.config,
            labelled,
            ftp_image,
            uid,
            credentials.user,
            credentials.password,
            running,
            labels,
            sessions.announced_address(key),
            sessions.kind.sidecar_settings(ids, sessions.config.limits),
            tls_dir=tls,
        )
        log.debug("%s: FTP sidecar %s", key, dumps(sidecar_config))
        sessions.engine.create_container(sidecar, sidecar_config, key)
        if start_sidecar:
            sessions.engine.start_container(sidecar, key)
    except SessionError as error:
        sessions.roll_back(key)
        raise _same_kind(error, f"session {key} could not be prepared: {error}") from None
    log.info(
        "%s: prepared for %s (template %s %s, GPUs %s, ssh %d, ftp %d)",
        key, spec.user, spec.template, variant.name, list(spec.gpu_indices),
        spec.ssh_port, spec.ftp_port,
    )  # fmt: skip
    found = sessions.find(key)
    session = sessions.session_of(key, found)
    if session is None:
        raise SessionError(f"session {key} was created but Docker does not list it")
    return session, found


def _show_home(sessions: HostSessions, session: Session) -> None:
    """Mount `session`'s view of its user's home again where it is not (see `homes.store`)."""
    ids = session.id_range
    if ids is None:
        raise SessionError(f"session {session.key}: its ids are not known: no home is shown")
    show_home(sessions.config, session.user, session.key, lambda _: home_maps(ids))


def published_ports(spec: SessionSpec) -> list[int]:
    """The host ports a session publishes: SSH, FTP and the FTP passive range."""
    passive = range(spec.ftp_passive_first, spec.ftp_passive_last + 1)
    return [spec.ssh_port, spec.ftp_port, *passive]


def start_session(sessions: HostSessions, spec: SessionSpec, ready_timeout: float) -> Session:
    """`Runtime.start` on this host's `sessions` (`Runtime.start` says what it does and raises)."""
    key = spec.key
    started = time.monotonic()
    existing = sessions.session(key)
    if existing is not None and existing.state == "running":
        log.debug("%s: already running", key)
        return existing
    if existing is not None and revive_sidecar(sessions, key, started + ready_timeout):
        return sessions.session(key) or existing
    # from nothing, both containers start at once below: faster than in turn
    session, found = prepare_session(sessions, spec, start_sidecar=False)
    waiting = {
        role: container
        for role, container in ((MAIN_ROLE, found.main), (FTP_ROLE, found.ftp))
        if container is not None and status(container) != "running"
    }
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            starting = {
                role: pool.submit(sessions.engine.start_container, container_name(container), key)
                for role, container in waiting.items()
            }
            wait_ready(
                session,
                sessions.probe_address(),
                started + ready_timeout,
                starting,
                lambda: sessions.find(key),
            )
        sessions.show_facts(key, session)
    except SessionError as error:
        logs = log_tails(sessions.engine, found)
        log.error("%s: start failed: %s%s", key, error, logs)
        sessions.roll_back(key)
        raise _same_kind(error, f"session {key} did not start: {error}{logs}") from None
    running = sessions.session(key) or session
    log.info(
        "%s: running for %s in %.2f s (ssh port %d, ftp port %d)",
        key, running.user, time.monotonic() - started, running.ssh_port, running.ftp_port,
    )  # fmt: skip
    return running


def _same_kind(error: SessionError, message: str) -> SessionError:
    """A `SessionError` saying `message`, of the same kind as `error` (with its details)."""
    if isinstance(error, PortRefused):
        return PortRefused(message, error.ports)
    if isinstance(error, ImageMissing):
        return ImageMissing(message, error.template, error.cuda)
    if isinstance(error, EngineTimeout):
        return EngineTimeout(message)
    return SessionError(message)
