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
from typing import TYPE_CHECKING

from gpuresa.access import AccessError, authorized_keys, container_uid, ftp_credentials
from gpuresa.model import Session, SessionSpec
from gpuresa.outputs.capped import cap_output
from gpuresa.outputs.credentials import HostCredentials
from gpuresa.outputs.disk import start_refusal
from gpuresa.outputs.host_ca import HostCA
from gpuresa.runtime.create_payloads import MainContainer, ftp_payload, main_payload
from gpuresa.runtime.engine import dumps
from gpuresa.runtime.errors import EngineTimeout, ImageMissing, PortRefused, SessionError
from gpuresa.runtime.gpus import host_gpu_access
from gpuresa.runtime.layers import layer_plan
from gpuresa.runtime.limits import session_limits
from gpuresa.runtime.lookup import Found, container_name, status
from gpuresa.runtime.output import make_output_folder, output_path, prepare_output, take_back
from gpuresa.runtime.output_area import ensure_area, remember, running_path, stored_path
from gpuresa.runtime.payload import (
    FTP_ROLE,
    MAIN_ROLE,
    NETWORK_ROLE,
    ROLE_LABEL,
    ftp_name,
    session_labels,
    session_name,
)
from gpuresa.runtime.readiness import log_tails, wait_ready
from gpuresa.runtime.session_files import FTP_PASSWORD_FILE
from gpuresa.runtime.sidecar import revive_sidecar
from gpuresa.runtime.templates import resolve_template

if TYPE_CHECKING:
    from gpuresa.runtime.runtime import Runtime

log = logging.getLogger(__name__)

# in a session's host-side folder: its own SSH host key and certificate (see outputs.host_ca)
HOST_KEYS_FOLDER = "host-keys"


def prepare_session(
    runtime: Runtime, spec: SessionSpec, *, start_sidecar: bool
) -> tuple[Session, Found]:
    """`Runtime.prepare`, which says what it does; also gives the containers found after."""
    key = spec.key
    runtime.check_spec(spec)
    found = runtime.find(key)
    existing = runtime.session_of(key, found)
    if existing is not None and found.complete and existing.state in ("created", "running"):
        # made under the check below; an engine without user namespaces (another
        # data root) would not even list it
        log.debug("%s: already %s", key, existing.state)
        return existing, found
    # before anything is made, every time: an engine without user namespaces is refused
    runtime.check_engine()
    template, variant = resolve_template(runtime.config.templates, spec.template, spec.cuda)
    # images are built by the daemon's build worker, never here
    image = runtime.images.require_image(spec.template, variant.name)
    ftp_image = runtime.images.require_ftp_image()
    if found.all:
        log.info(
            "%s: removing its %s containers to make them again",
            key,
            existing.state if existing else "unreadable",
        )
        runtime.remove_now(key, found)
    # a nearly full output disk refuses new sessions; running ones go on
    refusal = start_refusal(runtime.config, key)
    if refusal is not None:
        log.error("%s: refused: %s", key, refusal)
        raise SessionError(f"session {key}: {refusal}")
    users = runtime.config.users
    try:
        keys = authorized_keys(spec.user, users)
        uid = container_uid(spec.user, users)
        credentials = ftp_credentials(spec.user)
    except AccessError as error:
        raise SessionError(f"session {key}: {error}") from None
    gpu = host_gpu_access(runtime.host, spec.gpus)
    # labels keep the final place; the containers get the root-only running one (output_area)
    output_dir = output_path(runtime.config, spec)
    ensure_area(runtime.config)
    running = running_path(runtime.config, key)
    take_back(output_dir, stored_path(runtime.config, key), key)
    make_output_folder(running)
    # the login's folder exists from the start (root's, empty until the hand-over), so the
    # output service has its account before the session ends: no gap once it has
    with contextlib.suppress(FileExistsError):
        (runtime.config.storage.output_root / spec.user).mkdir(mode=0o750)
    remember(runtime.config, key, spec.user, output_dir)
    # the cap comes before anything of the session's can write there (refused without room)
    cap_output(runtime.config, key, running, len(spec.gpus), len(runtime.host_gpus()))
    labelled = dataclasses.replace(spec, cuda=variant.name)
    runtime.ends.forget(key)
    files = runtime.files.show_facts(
        key, runtime.facts(labelled), runtime.config.reservations.timezone
    )
    # the keys are a root-only host file mounted read-only, never the container's own
    runtime.files.show_keys(key, keys)
    labels = session_labels(labelled, uid, output_dir, credentials.user)
    host_credentials = HostCredentials(runtime.config)
    host_keys = files / HOST_KEYS_FOLDER
    host_keys.mkdir(mode=0o700, exist_ok=True)
    layer = layer_plan(runtime)
    main = MainContainer(
        image=image,
        uid=uid,
        output_dir=running,
        session_files=files,
        command=template.command or (),
        gpu=gpu,
        engine_settings={**runtime.kind.main_settings(runtime.config.limits), **layer.settings},
        limits=session_limits(runtime.config.limits, runtime.host_totals(), len(spec.gpus)),
        # this session's own SSH host key, made for its root once its ids are known
        host_keys_dir=host_keys,
    )
    main_config = main_payload(runtime.config, labelled, main, labels)
    log.debug("%s: main container %s", key, dumps(main_config))
    name = session_name(spec.host, key)
    sidecar = ftp_name(spec.host, key)
    try:
        runtime.engine.create_network(name, {**labels, ROLE_LABEL: NETWORK_ROLE}, key)
        main_id = runtime.engine.create_container(name, main_config, key)
        # the session's host ids are known once its main container exists (Podman
        # chooses them then); its output is theirs before anything of the user's runs
        ids = runtime.kind.created(runtime.engine, main_id, spec.gpus, key)
        layer.cap(runtime, main_id, key)
        base_uid, base_gid = (ids.uid, ids.gid) if ids else (0, 0)
        prepare_output(running, base_uid + uid, base_gid + uid, key)
        # the FTP password, for the login alone to read in the session
        runtime.files.show_secret(
            key, FTP_PASSWORD_FILE, credentials.password + "\n", base_uid + uid, base_gid + uid
        )
        # a fresh host key of its own, certified for its time only, readable by its root;
        # the FTPS certificate for the sidecar's root
        try:
            HostCA(runtime.config).issue_session_key(
                host_keys, base_uid, base_gid, key, spec.start, spec.end
            )
        except (OSError, ValueError) as error:
            raise SessionError(f"its host key cannot be made: {error}") from None
        tls = host_credentials.sidecar_tls(base_uid, base_gid)
        sidecar_config = ftp_payload(
            runtime.config,
            labelled,
            ftp_image,
            uid,
            credentials.user,
            credentials.password,
            running,
            labels,
            runtime.announced_address(key),
            runtime.kind.sidecar_settings(ids, runtime.config.limits),
            tls_dir=tls,
        )
        log.debug("%s: FTP sidecar %s", key, dumps(sidecar_config))
        runtime.engine.create_container(sidecar, sidecar_config, key)
        if start_sidecar:
            runtime.engine.start_container(sidecar, key)
    except SessionError as error:
        runtime.roll_back(key)
        raise _same_kind(error, f"session {key} could not be prepared: {error}") from None
    log.info(
        "%s: prepared for %s (template %s %s, GPUs %s, ssh %d, ftp %d)",
        key, spec.user, spec.template, variant.name, list(spec.gpus),
        spec.ssh_port, spec.ftp_port,
    )  # fmt: skip
    found = runtime.find(key)
    session = runtime.session_of(key, found)
    if session is None:
        raise SessionError(f"session {key} was created but Docker does not list it")
    return session, found


def start_session(runtime: Runtime, spec: SessionSpec, ready_timeout: float) -> Session:
    """`Runtime.start`, which says what it does."""
    key = spec.key
    started = time.monotonic()
    existing = runtime.session(key)
    if existing is not None and existing.state == "running":
        log.debug("%s: already running", key)
        return existing
    if existing is not None and revive_sidecar(runtime, key, started + ready_timeout):
        return runtime.session(key) or existing
    # from nothing, both containers start at once below: faster than in turn
    session, found = prepare_session(runtime, spec, start_sidecar=False)
    waiting = {
        role: container
        for role, container in ((MAIN_ROLE, found.main), (FTP_ROLE, found.ftp))
        if container is not None and status(container) != "running"
    }
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            starting = {
                role: pool.submit(runtime.engine.start_container, container_name(container), key)
                for role, container in waiting.items()
            }
            wait_ready(
                session,
                runtime.probe_address(),
                started + ready_timeout,
                starting,
                lambda: runtime.find(key),
            )
        runtime.show_facts(key, session)
    except SessionError as error:
        logs = log_tails(runtime.engine, found)
        log.error("%s: start failed: %s%s", key, error, logs)
        runtime.roll_back(key)
        raise _same_kind(error, f"session {key} did not start: {error}{logs}") from None
    running = runtime.session(key) or session
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
