"""This host's engine and its sessions there: the parts `Runtime` and the making of sessions share.

`Runtime` composes one `HostSessions` and hands it to `starting` and
`sidecar`, which so depend on the engine, images, session files and end
records they use, never on the `Runtime` that calls them. The methods may be
called from several threads at once for different sessions.
"""

from __future__ import annotations

import logging
import socket
import threading
from datetime import datetime
from typing import TYPE_CHECKING, Any

from gpuresa.backends.engines import stopping
from gpuresa.backends.engines.create_payloads import passive_address
from gpuresa.backends.engines.engine import Engine, EngineRefused
from gpuresa.backends.engines.engines import EngineKind, engine_kind
from gpuresa.backends.engines.firewall import unguard
from gpuresa.backends.engines.identity import installation_label
from gpuresa.backends.engines.images import Images
from gpuresa.backends.engines.lookup import Found, by_role, container_name, session_from
from gpuresa.backends.engines.ownership import UNLABELLED, labels_of, network_is_mine, split
from gpuresa.config.sections import Config, HostConfig
from gpuresa.gpus.devices import HostGpus
from gpuresa.homes.store import detach
from gpuresa.model import Session, SessionSpec
from gpuresa.outputs.host_ca import HostCA
from gpuresa.sessions.errors import RuntimeUnavailable, SessionError
from gpuresa.sessions.files import (
    HOST_KEYS_FOLDER,
    SessionFacts,
    SessionFiles,
    session_facts,
)
from gpuresa.sessions.labels import HOST_LABEL, INSTALLATION_LABEL, KEY_LABEL, session_name
from gpuresa.sessions.limits import HostTotals, totals_from_info
from gpuresa.sessions.records import EndRecords
from gpuresa.sessions.specs import check_spec

if TYPE_CHECKING:
    from docker import DockerClient

log = logging.getLogger(__name__)


class HostSessions:
    """The engine of this daemon's host, its images, and its sessions' files and records there.

    Given the config and optionally a `docker.DockerClient` (see `Runtime`:
    making one never needs the engine). Engine calls raise `RuntimeUnavailable`
    and `EngineTimeout` as `Runtime`'s do.
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
        self._installation = ""
        # another installation's sessions already logged: (its label, key)
        self._reported: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    @property
    def installation(self) -> str:
        """This installation's label value (see `identity`), made on first use.

        Raises `SessionError` when the id cannot be read or made.
        """
        if not self._installation:
            self._installation = installation_label(self.config.daemon.state_dir)
        return self._installation

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
        `engines`). Asked of Docker each time, of Podman once a minute (its
        answers take a second); each Podman main container is also checked for
        a range of its own as it is made.
        """
        self.kind.check(self.engine)

    # --- reading sessions back from the engine ----------------------------------------------

    def session(self, key: str) -> Session | None:
        """The session `key` of this host as Docker shows it, or None."""
        return self.session_of(key, self.find(key))

    def find(self, key: str) -> Found:
        """This installation's containers of session `key` (full `inspect`), by role.

        Another installation's containers of the same host and key are never
        among them (see `ownership`): nothing here stops or adopts them.
        """
        containers = self.engine.containers(
            {"label": [f"{HOST_LABEL}={self.config.daemon.host}", f"{KEY_LABEL}={key}"]}
        )
        mine, others = split(containers, self.installation, self.files.root)
        self.report_foreign(others)
        return by_role(mine)

    def host_containers(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """This host's containers (full `inspect`): this installation's, and all others.

        Others are logged once each (see `report_foreign`).
        """
        containers = self.engine.containers({"label": [f"{HOST_LABEL}={self.config.daemon.host}"]})
        mine, others = split(containers, self.installation, self.files.root)
        self.report_foreign(others)
        return mine, others

    def report_foreign(self, containers: list[dict[str, Any]]) -> None:
        """Log, once per session, containers of this host that another installation made."""
        for container in containers:
            labels = labels_of(container)
            owner = labels.get(INSTALLATION_LABEL) or UNLABELLED
            seen = (owner, labels.get(KEY_LABEL, ""))
            with self._lock:
                if seen in self._reported:
                    continue
                self._reported.add(seen)
            log.warning(
                "%s: container %s is another installation's (%s) on this engine and host "
                "name: left alone, never stopped; give each installation its own host name",
                seen[1], container_name(container), owner,
            )  # fmt: skip

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

    def check_spec(self, spec: SessionSpec) -> None:
        """Refuse, with a `SessionError`, a spec this host cannot serve (see `specs.check_spec`)."""
        check_spec(self.config, spec, self.host_gpus())

    # --- what a session shows and where it is reached ---------------------------------------

    def facts(self, session: Session | SessionSpec) -> SessionFacts:
        return session_facts(
            self.config.storage, session, self.ends.recorded(session.key) or session.end
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

    # --- removal ----------------------------------------------------------------------------

    def remove_now(self, key: str, found: Found | None = None) -> None:
        """Remove a session's containers and network at once (no grace, output kept)."""
        found = found or self.find(key)
        stopping.kill_from_host(key, found)
        stopping.remove_containers(self.engine, key, found)
        self.remove_networks(key)
        detach(self.config, key)

    def roll_back(self, key: str) -> None:
        """Roll back after a failure; a failing rollback is logged, never hides the first error."""
        try:
            self.remove_now(key)
        except (SessionError, RuntimeUnavailable) as error:
            # the session's files stay: containers that may remain keep their gate closed
            log.error("%s: rollback failed, leftovers may remain: %s", key, error)
            return
        self.files.remove(key)

    def remove_networks(self, key: str) -> None:
        """Remove session `key`'s networks, found by label and by name; gone counts as done."""
        host = self.config.daemon.host
        networks = self.engine.networks({"label": [f"{HOST_LABEL}={host}", f"{KEY_LABEL}={key}"]})
        named = self.engine.networks({"name": session_name(host, key)})
        networks += [network for network in named if network.get("Name") == session_name(host, key)]
        # another installation's network of the same name stays (see `ownership`)
        names = {
            str(network["Id"])
            for network in networks
            if network_is_mine(network, self.installation)
        }
        for network in names:
            self.engine.remove_network(network, key)
        # once the network is gone (a rule left meanwhile only closes an unused subnet)
        unguard(self.installation, session_name(host, key), key)

    def renew_host_certificate(self, key: str, start: datetime, end: datetime) -> None:
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
