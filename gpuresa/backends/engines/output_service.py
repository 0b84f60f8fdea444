"""The output service: one SFTP container per host serving every finished output.

`OutputService(config, backend)` is what the daemon holds. `ensure_running()`
(on a worker thread: it may build an image and waits for sshd) writes the
accounts, keys and login folders, then starts, checks or remakes the
container named `gpuresa-<host>-outputs-<installation>` (labels `gpuresa.host`,
`gpuresa.role=outputs` and `gpuresa.installation`, so a restarted daemon finds
it, and never takes another installation's of the same host name on the same
engine). The container's payload is hashed into a label: a changed port, image or
mount remakes it.

Why the container shares the host's user namespace (`UsernsMode: host`): its
logins must have the uids outputs are handed to, which are host uids; under
`userns-remap` it would see them as nobody. What keeps it small instead: the
output root mounted read-only, tmpfs for what sshd writes, every
capability dropped but the five sshd needs, no-new-privileges, limits on
processes and memory, and sshd itself allowing nothing but `internal-sftp -R`
in a per-login chroot.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from gpuresa.access import AccessError, authorized_keys
from gpuresa.backends.engines.engine import Engine
from gpuresa.backends.engines.engines import EngineKind
from gpuresa.backends.engines.identity import installation_label
from gpuresa.backends.engines.output_container import (
    OUTPUTS_ROLE,
    PAYLOAD_LABEL,
    PORT_LABEL,
    accounts_text,
    probe_address,
    service_name,
    service_payload,
    services_split,
)
from gpuresa.backends.engines.probes import ssh_handshake
from gpuresa.config.capabilities import Capabilities
from gpuresa.config.sections import Config
from gpuresa.model import Session
from gpuresa.outputs.capped import discard_image
from gpuresa.outputs.credentials import HostCredentials
from gpuresa.outputs.disk import DiskState, measure
from gpuresa.outputs.folder import hand_over
from gpuresa.outputs.host_ca import HostCA
from gpuresa.outputs.owners import (
    HANDED_UID,
    Owner,
    output_owner,
    prepare_login_folder,
    prepare_root,
)
from gpuresa.outputs.records import (
    OutputFolder,
    OutputRecords,
    folders_below,
    login_names,
    notice_due,
    pattern_depth,
    planned_removal,
    recently_changed,
    removal_due,
    scan,
)
from gpuresa.outputs.tree import remove_tree
from gpuresa.reservations import catalog
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.labels import HOST_LABEL, INSTALLATION_LABEL, ROLE_LABEL
from gpuresa.sessions.templates import (
    FTP_DEFAULT_BASE_IMAGE,
    context_archive,
    image_digest,
    image_tag,
)

log = logging.getLogger(__name__)

READY_TIMEOUT = 30.0
# the other installations' services already told of in the log (by container id)
_TOLD: set[str] = set()


@dataclass(frozen=True)
class ServiceState:
    """What `ensure_running` found and did."""

    action: str  # "running", "started", "made", "off"
    port: int
    logins: tuple[str, ...]


def _write_if_changed(path: Path, text: str, mode: int) -> bool:
    try:
        if path.read_text(encoding="utf-8") == text:
            return False
    except OSError:
        pass
    temporary = path.with_name(f".{path.name}.new")
    temporary.write_text(text, encoding="utf-8")
    os.chmod(temporary, mode)
    os.replace(temporary, path)
    return True


class OutputBackend(Protocol):
    """What the output service uses of a session backend: what it can do, its sessions."""

    @property
    def capabilities(self) -> Capabilities: ...

    def list_sessions(self) -> list[Session]: ...


@runtime_checkable
class ServiceEngine(Protocol):
    """What a backend that leaves its outputs to the service has besides: the container
    engine the service runs on, and that engine's kind (the settings it accepts)."""

    engine: Engine
    kind: EngineKind


class OutputService:
    """The output service of this daemon's host, and the outputs it serves.

    Given the config and the session backend (for its container engine and to
    know which output folders sessions use now). Methods may raise
    `RuntimeUnavailable` when Docker does not answer and `SessionError` when
    the service cannot be made.
    """

    def __init__(self, config: Config, runtime: OutputBackend) -> None:
        self.config = config
        self.runtime = runtime
        self.credentials = HostCredentials(config)
        self.records = OutputRecords(config.daemon.state_dir / "outputs")
        self.accounts = config.daemon.state_dir / "output-service"

    @property
    def _service_engine(self) -> ServiceEngine:
        """The backend's container engine (asked for on use: making a service needs none).

        Raises `SessionError` for a backend that serves outputs itself: its
        logins read them through their own accounts, and it has no engine.
        """
        if self.runtime.capabilities.serves_outputs or not isinstance(self.runtime, ServiceEngine):
            raise SessionError(
                "the output service runs on a Docker or Podman engine; this host's sessions "
                "serve their outputs themselves (storage.sftp_port must be 0 here)"
            )
        return self.runtime

    @property
    def engine(self) -> Engine:
        """The backend's Docker gateway (see `_service_engine`)."""
        return self._service_engine.engine

    @property
    def enabled(self) -> bool:
        """With `sftp_port` set, on a host whose backend leaves its outputs to the service
        (a container engine's). One whose sessions serve outputs themselves has none."""
        return self.config.storage.sftp_port != 0 and not self.runtime.capabilities.serves_outputs

    def busy_folders(self) -> set[Path]:
        """The output folders of this host's sessions (created, running or stopped)."""
        return {session.output_dir for session in self.runtime.list_sessions()}

    # --- accounts and folders -----------------------------------------------------------------

    def refresh_accounts(self, busy: Collection[Path] | None = None) -> tuple[str, ...]:
        """Write the service's accounts and keys; make login folders and hand outputs over.

        Every login with a folder in the output root and an SSH key gets an
        account; a finished output that is not its login's owner's (a session
        stopped without hand-over, a login that got a host account since) is
        handed over now. Returns the logins served.
        """
        busy = self.busy_folders() if busy is None else busy
        prepare_root(self.config)
        keys_folder = self.accounts / "keys"
        keys_folder.mkdir(parents=True, exist_ok=True)
        for folder in (self.accounts, keys_folder):
            os.chown(folder, 0, 0)
            os.chmod(folder, 0o755)
        owners: list[Owner] = []
        served_keys: dict[str, str] = {}
        for login in login_names(self.config.storage.output_root):
            try:
                owner = output_owner(login, self.config)
                keys = authorized_keys(login, self.config.users)
                prepare_login_folder(self.config, owner)
            except AccessError as error:
                log.info("outputs of %s are not served: %s", login, error)
                continue
            except OSError as error:
                log.warning("outputs of %s are not served: %s", login, error)
                continue
            self._hand_over_leftovers(owner, busy)
            owners.append(owner)
            served_keys[login] = keys
        passwd, group = accounts_text(owners, self.config.storage.output_uid_base - 1)
        _write_if_changed(self.accounts / "passwd", passwd, 0o644)
        _write_if_changed(self.accounts / "group", group, 0o644)
        for login, keys in served_keys.items():
            _write_if_changed(keys_folder / login, keys, 0o644)
        for stale in keys_folder.iterdir():
            if stale.name not in served_keys:
                stale.unlink(missing_ok=True)
        return tuple(sorted(served_keys))

    def _hand_over_leftovers(self, owner: Owner, busy: Collection[Path]) -> None:
        top = self.config.storage.output_root / owner.login
        for path in folders_below(top, pattern_depth(self.config.storage)):
            if path == top or path in busy:
                continue
            relative = path.relative_to(self.config.storage.output_root).as_posix()
            if self.records.read(relative) is None and recently_changed(path):
                continue  # maybe a session being made: its containers are not there yet
            details = path.lstat()
            if (details.st_uid, details.st_gid) != (HANDED_UID, owner.gid):
                # an output of an earlier gpuresa (the login's, writable) is made read-only too
                hand_over(path, HANDED_UID, owner.gid, f"outputs of {owner.login}", owner.uid)

    # --- the container ------------------------------------------------------------------------

    def ensure_image(self) -> str:
        """The service's image tag, built from gpuresa's `outputs/` folder if missing."""
        templates = self.config.templates
        base = templates.base_image or FTP_DEFAULT_BASE_IMAGE
        directory = catalog.SHIPPED_TEMPLATES / OUTPUTS_ROLE
        base_id = self.engine.image_id(base)
        if base_id is None:
            base_id = self.engine.pull(base)
        digest = image_digest(["outputs", base, base_id], directory)
        tag = image_tag(templates.image_prefix, "outputs", digest[:12])
        if self.engine.image_id(tag) is None:
            log.info("building image %s (output service on %s)", tag, base)
            self.engine.build(
                context_archive(directory),
                tag,
                {"BASE_IMAGE": base},
                {"gpuresa.base-image": base, "gpuresa.image-hash": digest},
            )
        return tag

    @functools.cached_property
    def installation(self) -> str:
        return installation_label(self.config.daemon.state_dir)

    def find(self) -> dict[str, Any] | None:
        """This installation's service container as the engine shows it, or None.

        Another installation's on this engine and host name (a test daemon beside
        the real one) is told once in the log and never started, remade or removed here.
        """
        containers = self.engine.containers(
            {"label": [f"{HOST_LABEL}={self.config.daemon.host}", f"{ROLE_LABEL}={OUTPUTS_ROLE}"]}
        )
        mine, others = services_split(
            containers, self.installation, self.config.storage.output_root
        )
        for other in others:
            if other["Id"] not in _TOLD:
                _TOLD.add(other["Id"])
                log.warning(
                    "another installation's output service %s is on this engine (never "
                    "removed here)", str(other.get("Name", other["Id"])).lstrip("/"),
                )  # fmt: skip
        return dict(mine[0]) if mine else None

    def ensure_running(self) -> ServiceState:
        """Start, check or remake the service so that it serves the current outputs.

        Idempotent and safe to call every round from a worker thread. Returns
        what it did; raises `SessionError` when the service does not answer
        after being (re)made.
        """
        if not self.enabled:
            return ServiceState("off", 0, ())
        logins = self.refresh_accounts()
        # its own host key; the certificate is signed again here when it nears its end
        host_keys = HostCA(self.config).service_keys()
        image = self.ensure_image()
        labels = {
            HOST_LABEL: self.config.daemon.host,
            ROLE_LABEL: OUTPUTS_ROLE,
            INSTALLATION_LABEL: self.installation,
            PORT_LABEL: str(self.config.storage.sftp_port),
        }
        payload = service_payload(self.config, image, self.accounts, host_keys, labels)
        payload["HostConfig"].update(self._service_engine.kind.service_settings(self.config.limits))
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
        payload["Labels"][PAYLOAD_LABEL] = digest
        name = service_name(self.config.daemon.host, self.installation)
        found = self.find()
        port = self.config.storage.sftp_port
        if found is not None and found["Config"]["Labels"].get(PAYLOAD_LABEL) == digest:
            status = found.get("State", {}).get("Status")
            if status == "running" and self._answers(1.0):
                return ServiceState("running", port, logins)
            if status != "running":
                log.warning("the output service was %s; starting it again", status)
                self.engine.start_container(str(found["Id"]), OUTPUTS_ROLE)
                if self._answers(READY_TIMEOUT):
                    return ServiceState("started", port, logins)
            log.warning("the output service does not answer; making it again")
        if found is not None:
            self.engine.remove_container(str(found["Id"]), OUTPUTS_ROLE)
        self.engine.create_container(name, payload, OUTPUTS_ROLE)
        self.engine.start_container(name, OUTPUTS_ROLE)
        if not self._answers(READY_TIMEOUT):
            tail = self.engine.logs(name, 20).strip()
            raise SessionError(f"the output service does not answer on port {port}:\n{tail}")
        log.info("output service running on port %d for %d login(s)", port, len(logins))
        return ServiceState("made", port, logins)

    def _answers(self, timeout: float) -> bool:
        address = probe_address(self.config.host().bind_address)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if ssh_handshake(address, self.config.storage.sftp_port, max(min(remaining, 2.0), 0.2)):
                return True
            if remaining <= 0:
                return False
            time.sleep(0.1)

    def remove(self) -> None:
        """Remove the service's container (outputs and records are kept)."""
        found = self.find()
        if found is not None:
            self.engine.remove_container(str(found["Id"]), OUTPUTS_ROLE)

    # --- retention ----------------------------------------------------------------------------

    def folders(self, now: datetime | None = None) -> list[OutputFolder]:
        """Every output folder with its dates; with `now`, unrecorded ones start their retention."""
        return scan(self.config.storage, self.records, self.busy_folders(), now)

    def due_removal_notices(self, now: datetime) -> list[OutputFolder]:
        """Finished outputs whose users must now be told of the coming removal.

        After sending (or deciding there is nobody to send to), the daemon
        calls `notice_sent(folder, now)`; until then the folder is not removed.
        """
        storage = self.config.storage
        return [folder for folder in self.folders(now) if notice_due(folder, now, storage)]

    def notice_sent(self, folder: OutputFolder, when: datetime) -> None:
        self.records.record_notice(folder.relative, when)

    def due_removals(self, now: datetime) -> list[OutputFolder]:
        """Finished outputs whose retention is over and whose notice went out long enough ago."""
        storage = self.config.storage
        return [folder for folder in self.folders(now) if removal_due(folder, now, storage)]

    def prune(self, now: datetime, dry_run: bool = False) -> list[OutputFolder]:
        """Remove every output `due_removals` names (unless `dry_run`); returns them.

        Removal never follows a link and goes to any depth (`tree.remove_tree`);
        a folder that cannot be removed is logged and left.
        """
        removed = []
        for folder in self.due_removals(now):
            if dry_run:
                removed.append(folder)
                continue
            try:
                if folder.image is not None:
                    # never copied out of its image: the image and its leftovers go
                    discard_image(self.config, folder.key)
                else:
                    remove_tree(folder.path)
            except FileNotFoundError:
                pass
            except OSError as error:
                log.error("could not remove output %s: %s", folder.path, error)
                continue
            self.records.forget(folder.relative)
            log.info("removed output %s of %s (retention over)", folder.path, folder.user)
            removed.append(folder)
        return removed

    def disk_state(self) -> DiskState:
        """The output filesystem now (see `disk.measure`); raises `OSError` if unreadable."""
        return measure(self.config.storage, self.config.daemon.state_dir)

    def removal_date(self, ended: datetime) -> datetime | None:
        """When an output that ended at `ended` will be removed (None: kept forever)."""
        return planned_removal(ended, self.config.storage)
