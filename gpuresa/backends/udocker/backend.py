"""Sessions without a root engine: udocker (runc mode), run as the booking login's own account.

A session is: a udocker container in the login's own repository (`tools`),
started as the login in a cgroup gpuresa owns (`cgroups`, `launch`), and the
session's port, bound by root and served by the login's own `sshd -i` for each
connection (`listening`), whose ForceCommand enters the container. Inside, the
login is root of the session's user namespace, which maps that one id onto the
login's own host uid. What gpuresa keeps per session (`records`) and the
cgroup tree are all a restarted daemon needs to adopt it.
The banner, motd, end, message and login gate are the same host-written files
as for the engines (`gpuresa.sessions.files`), mounted read-only.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import socket
import time
from collections.abc import Collection
from datetime import UTC, datetime, timedelta
from pathlib import Path, PurePosixPath
from signal import Signals

from gpuresa.access import AccessError, Account, authorized_keys, host_account
from gpuresa.backends.engines.identity import installation_label
from gpuresa.backends.udocker import cgroups, launch, listening, spares, stopping, tools
from gpuresa.backends.udocker.cgroups import SessionCgroup
from gpuresa.backends.udocker.devices import denied_devices
from gpuresa.backends.udocker.host import check_host, login_output, session_account
from gpuresa.backends.udocker.images import UdockerImages, container_exists, make_container
from gpuresa.backends.udocker.records import Record, Records, write_file
from gpuresa.backends.udocker.run_command import start_container
from gpuresa.backends.udocker.sockets import make_tool_folder, remove_tool_folder
from gpuresa.config.capabilities import UDOCKER
from gpuresa.config.sections import Config, HostConfig
from gpuresa.gpus.devices import HostGpus, host_gpu_access
from gpuresa.homes.idmap import IdMaps
from gpuresa.homes.paths import DISK_ID_BASE
from gpuresa.homes.store import detach, release_unused, show_home
from gpuresa.model import Session, SessionSpec
from gpuresa.outputs.disk import start_refusal
from gpuresa.sessions.cgroup_folders import CGROUP_ROOT, host_folder
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.files import SessionFacts, SessionFiles, end_text, session_facts
from gpuresa.sessions.labels import MAIN_ROLE, safe_key, utc_text
from gpuresa.sessions.limits import SessionLimits, local_totals, session_limits
from gpuresa.sessions.logins import read_log, ssh_login_seen
from gpuresa.sessions.records import EndRecords
from gpuresa.sessions.specs import check_spec, new_spec
from gpuresa.sessions.tool_access import show_tools

log = logging.getLogger(__name__)


class UdockerBackend:
    """The sessions of a host with `engine = "udocker"` (see the module and the protocol)."""

    capabilities = UDOCKER

    def __init__(self, config: Config, cgroup_root: Path = CGROUP_ROOT) -> None:
        self.config = config
        self.root = tools.udocker_root(config)
        self.records = Records(self.root / "sessions")
        # each session's folder is its login's group's (0750) under a root that host
        # users traverse but cannot list: the login's runc binds it, its sshd reads it
        self.files = SessionFiles(self.root / "files", root_mode=0o711, folder_mode=0o750)
        self.ends = EndRecords(config.daemon.state_dir / "sessions")
        self.cgroup_root = cgroup_root
        self.images = UdockerImages(config)
        self._gpus = HostGpus()

    @property
    def host(self) -> HostConfig:
        return self.config.host()

    @functools.cached_property
    def cgroup_base(self) -> Path:
        """This installation's folder of session cgroups (`host_folder`)."""
        label = installation_label(self.config.daemon.state_dir)
        return host_folder(self.config.daemon.host, label)

    def cgroup(self, key: str) -> SessionCgroup:
        folder = self.records.folder(key)
        return cgroups.chosen(
            self.cgroup_base,
            self.config.daemon.host,
            safe_key(key),
            lambda cgroup: launch.init_pid(cgroup, folder),
            self.cgroup_root,
        )

    # --- what the host has -----------------------------------------------------------------

    def check(self) -> None:
        """Refuse a host where sessions could not be confined (`host.check_host`)."""
        check_host(self.config, self.root, self.cgroup_root)

    def host_gpus(self) -> tuple[int, ...]:
        return self._gpus.indices(self.host)

    def check_spec(self, spec: SessionSpec) -> None:
        check_spec(self.config, spec, self.host_gpus())
        self.account(spec)

    def limits(self, spec: SessionSpec) -> SessionLimits:
        """`spec`'s CPUs and memory: its GPUs' share of this host, as on the engines."""
        totals = local_totals(len(self.host_gpus()))
        return session_limits(self.config.limits, totals, spec.gpu_count)

    def account(self, spec: SessionSpec) -> Account:
        """The login's host account; `SessionError` when it has none (sessions run as it)."""
        return session_account(spec)

    # --- images ----------------------------------------------------------------------------

    def image_present(self, template: str, cuda: str | None) -> bool:
        """Whether sessions of the template's variant can start without a build or a save."""
        return self.images.present(template, cuda)

    def ensure_image(self, template: str, cuda: str | None) -> str:
        """Build the template's image with the image engine and save its archive (minutes)."""
        return self.images.ensure(template, cuda)

    def ensure_ftp_image(self) -> str:
        """udocker sessions have no FTP sidecar (their sshd serves SFTP): nothing to build."""
        return ""

    def provisioned(self, template: str | None, cuda: str | None) -> bool:
        """Whether the template's archive is here (None: nothing is shared); never waits.

        Loading it into a login's repository takes seconds and is done when a
        session of that login is prepared.
        """
        return template is None or self.image_present(template, cuda)

    def provision(self, template: str | None, cuda: str | None) -> None:
        """Build and save the template's image when missing (minutes)."""
        if template is not None:
            self.ensure_image(template, cuda)

    # --- what the daemon asks of a Docker runtime, for udocker ------------------------------

    def sessions_and_units(self) -> tuple[list[Session], dict[str, tuple[str, str]]]:
        """`list_sessions()`, and each session's cgroup path as its "container id" with (key,
        "main"): the GPU tracker finds a process's session by its cgroup."""
        sessions = self.list_sessions()
        roles = {
            str(self.cgroup(session.key).relative): (session.key, MAIN_ROLE) for session in sessions
        }
        return sessions, roles

    def collect_garbage(self, busy: set[str]) -> list[str]:
        return self.cleanup(busy)

    def reset(self, key: str) -> None:
        """End the session's processes at once; its record, end and output stay, so it is
        listed "stopped" and the daemon's next round makes it again."""
        self._end_processes(key)

    # --- reading sessions back -------------------------------------------------------------

    def _state(self, record: Record) -> str:
        cgroup = self.cgroup(record.spec.key)
        folder = self.records.folder(record.spec.key)
        if launch.init_pid(cgroup, folder) is None:
            return "stopped"
        if listening.recorded(cgroup, folder) is None:
            return "stopped"
        return "created" if self.files.gated(record.spec.key) else "running"

    def _session(self, record: Record, state: str | None = None) -> Session:
        key = record.spec.key
        state = state or self._state(record)
        fingerprint = self.records.fingerprint(key, record.uid)
        return record.session(state, self.ends.recorded(key), fingerprint)

    def list_sessions(self) -> list[Session]:
        host = self.config.daemon.host
        sessions = [
            self._session(record) for record in self.records.all() if record.spec.host == host
        ]
        return sorted(sessions, key=lambda session: (session.start, session.key))

    def session(self, key: str) -> Session | None:
        record = self.records.read(key)
        return None if record is None else self._session(record)

    # --- the life of a session -------------------------------------------------------------

    def prepare(self, spec: SessionSpec, ready_timeout: float = 30) -> Session:
        existing = self._listen_again(spec.key, ready_timeout)
        if existing is not None and existing.state in ("created", "running"):
            return existing
        return self._make(spec, ready_timeout)

    def start(self, spec: SessionSpec, ready_timeout: float = 30) -> Session:
        existing = self._listen_again(spec.key, ready_timeout)
        if existing is None or existing.state == "stopped":
            existing = self._make(spec, ready_timeout)
        if existing.state == "running":
            return existing
        record = self.records.read(spec.key)
        assert record is not None
        try:
            keys = authorized_keys(spec.user, self.config.users)
        except AccessError as error:
            raise SessionError(f"session {spec.key}: {error}") from None
        write_file(self.records.folder(spec.key) / "authorized_keys", keys)
        self.files.open_gate(spec.key)
        log.info("%s: let in (ssh port %d)", spec.key, spec.ssh_port)
        return self._session(record, "running")

    def _gate_text(self, spec: SessionSpec) -> str:
        timezone = self.config.reservations.timezone
        return f"gpuresa: this session opens at {end_text(spec.start, timezone)}; try again then."

    def _make(self, spec: SessionSpec, ready_timeout: float) -> Session:
        """Make the session from nothing (what is left of an earlier one is removed first)."""
        key = spec.key
        self.check_spec(spec)
        self.check()
        account = self.account(spec)
        name = self.images.load(key, account, spec.template, spec.cuda)
        refusal = start_refusal(self.config, key)
        if refusal is not None:
            raise SessionError(f"session {key}: {refusal}")
        try:
            keys = authorized_keys(spec.user, self.config.users)
        except AccessError as error:
            raise SessionError(f"session {key}: {error}") from None
        del keys  # checked now; written when the gate opens
        gpu = host_gpu_access(self.host, spec.gpu_indices)
        self._end(key, finish=False)
        # the port first: taken, the session fails at once, before a container is made for
        # nothing; held, nobody can take it while the container starts
        bound = listening.bind(self.host.bind_address or "0.0.0.0", spec.ssh_port)
        self.files.close_gate(key, self._gate_text(spec))
        output_dir = login_output(self.config, spec, account)
        # a name of its own each time: the removal of an earlier one may still run
        container = f"gpuresa-{safe_key(key)[:40]}-{secrets.token_hex(4)}"
        record = Record(spec, account.uid, account.gid, output_dir, container)
        try:
            folder = self.records.write(record)
        except BaseException:
            bound.close()
            raise
        self.ends.forget(key)
        try:
            files = self.files.show_facts(key, self.facts(spec), self.config.reservations.timezone)
            try:
                os.chown(files, 0, account.gid)
            except OSError as error:
                raise SessionError(f"cannot give {files} to the login's group: {error}") from None
            write_file(folder / "authorized_keys", "")
            # the browser tools: a folder of the login's for their sockets, their commands,
            # and the token and login lines for the login alone
            sockets = make_tool_folder(self.config, key, account.uid, account.gid)
            owner = (account.uid, account.gid)
            show_tools(self.config, self.files, spec, PurePosixPath(sockets), owner)
            host_key = self.records.host_key(key, account)
            config_file = folder / "sshd_config"
            write_file(config_file, launch.sshd_config(spec.user, folder, files, host_key))
            tools.ensure_repository(self.config, account)
            if not spares.take(self.config, account, name, container, key):
                make_container(self.config, account, name, container, key)
            self._show_home(spec, account)
            # the time to come up runs from here: loading and unpacking the image (a
            # template of several GB takes minutes) have their commands' own limits
            deadline = time.monotonic() + max(ready_timeout, 30)
            cgroup = self.cgroup(key)
            cgroup.create(self.limits(spec), self.config.limits.pids)
            cgroup.deny_devices(denied_devices(gpu.devices))
            start_container(
                self.config, account, record, files, gpu, self.root, cgroup,
                folder / "udocker.log",
            )  # fmt: skip
            launch.wait_for(
                "the session's container",
                lambda: launch.container_init(cgroup, account.uid),
                deadline,
            )
            init = launch.container_init(cgroup, account.uid)
            write_file(folder / "container.pid", f"{init}\n")
            self._listen(record, deadline, bound)
        except SessionError as error:
            logs = self.records.log_tail(key)
            self._end(key, finish=False)
            raise SessionError(f"session {key} could not be prepared: {error}{logs}") from None
        finally:
            bound.close()  # the listener has its own copy (or none was started)
        log.info(
            "%s: prepared for %s as uid %d (udocker, template %s, GPUs %s, ssh %d)",
            key, spec.user, account.uid, spec.template, list(spec.gpu_indices), spec.ssh_port,
        )  # fmt: skip
        archive = self.images.archive(spec.template, spec.cuda)
        spares.make_later(self.config, account, archive, cgroup, folder / "spare.log", key)
        return self._session(record, "created")

    def _show_home(self, spec: SessionSpec, account: Account) -> None:
        """The login's lasting home, in a view of their own that their container binds: the
        home's ids shown as their host account's (see `homes.store`)."""
        ids = (account.uid, account.gid)
        show_home(
            self.config,
            spec.user,
            spec.key,
            lambda inside: IdMaps.of_login(inside, *ids, DISK_ID_BASE),
            ids,
        )

    def _listen(self, record: Record, deadline: float, bound: socket.socket | None = None) -> None:
        folder, address = self.records.folder(record.spec.key), self.host.bind_address
        listening.start(self.cgroup(record.spec.key), record, folder, address, deadline, bound)

    def _listen_again(self, key: str, ready_timeout: float) -> Session | None:
        """The session; one whose container runs but whose listener is gone gets a new
        listener and keeps the user's processes (else it stays "stopped", to be made again)."""
        existing = self.session(key)
        record = self.records.read(key)
        if existing is None or existing.state != "stopped" or record is None:
            return existing
        cgroup, folder = self.cgroup(key), self.records.folder(key)
        if launch.init_pid(cgroup, folder) is None:
            return existing
        try:
            self._listen(record, time.monotonic() + max(ready_timeout, 10))
        except SessionError as error:
            log.warning("%s: no listener on port %d: %s", key, record.spec.ssh_port, error)
            return existing
        log.warning("%s: its port had no listener; one listens again", key)
        return self._session(record)

    # --- the end of a session --------------------------------------------------------------

    def stop(self, key: str, grace: timedelta) -> None:
        record = self.records.read(key)
        cgroup = self.cgroup(key)
        if record is not None and grace > timedelta(0) and cgroup.exists():
            stopping.give_grace(key, cgroup, self.records.folder(key), grace)
        self._end(key, finish=True)

    def kill(self, key: str) -> None:
        self._end(key, finish=True)

    def _end(self, key: str, finish: bool) -> None:
        """Kill everything in the session's cgroup, remove its container and files."""
        record = self._end_processes(key)
        if record is None:
            return
        session = self._session(record, "stopped")
        self.records.remove(key)
        self.files.remove(key)
        detach(self.config, key)
        remove_tool_folder(self.config, key)
        self.ends.forget(key)
        if finish:
            log.info("%s: stopped; its output goes to %s", key, record.output_dir)
            self.finish_stop(session)

    def _end_processes(self, key: str) -> Record | None:
        """Kill everything in the session's cgroup and remove its container; its record."""
        record = self.records.read(key)
        cgroup = self.cgroup(key)
        if cgroup.exists():
            cgroup.kill_all()
            cgroup.remove()
        if record is None:
            return None
        account = host_account(record.spec.user)
        if account is not None and container_exists(self.config, account, record.container):
            # its files go in the background, as the user: nothing of it runs any more
            tools.remove_detached(self.config, account, record.container, key)
        return record

    def finish_stop(self, session: Session) -> None:
        from gpuresa.outputs.handover import finish_output

        finish_output(self.config, session)

    # --- during a session ------------------------------------------------------------------

    def message(self, key: str, text: str) -> None:
        session = self.session(key)
        if session is None or session.state != "running":
            log.info("%s: not running; message not shown: %s", key, text)
            return
        try:
            self.files.show_message(key, text, datetime.now(UTC))
        except SessionError as error:
            log.warning("%s: %s", key, error)
        log.info("%s: message shown: %s", key, text)

    def used(self, key: str) -> bool | None:
        """The protocol's `used`: the login's sshd log (SSH and SFTP; no FTP here). The
        login could write there itself, which buys nothing a login would not."""
        record = self.records.read(key)
        text = None if record is None else read_log(self.records.folder(key) / "sshd.log")
        return None if record is None or text is None else ssh_login_seen(text, record.spec.user)

    def signal(self, key: str, number: Signals) -> int:
        """The protocol's `signal`: to the cgroup's members but the session's machinery."""
        if self.records.read(key) is None:
            return 0
        return stopping.signal_processes(key, self.cgroup(key), self.records.folder(key), number)

    def extend(self, key: str, end: datetime) -> None:
        session = self.session(key)
        if session is None:
            log.info("%s: no session to extend", key)
            return
        self.ends.record(key, end)
        self.files.show_facts(key, self.facts(session), self.config.reservations.timezone)
        log.info("%s: now ends at %s", key, utc_text(end))

    def facts(self, session: Session | SessionSpec) -> SessionFacts:
        return session_facts(
            self.config.storage, session, self.ends.recorded(session.key) or session.end
        )

    def cleanup(self, busy: Collection[str]) -> list[str]:
        """Remove cgroups of this host that no session record names (never a busy key's)."""
        kept = {safe_key(record.spec.key) for record in self.records.all()}
        kept |= {safe_key(key) for key in busy}
        removed = cgroups.remove_others(self.cgroup_base, kept, self.cgroup_root)
        released = release_unused(
            self.config, lambda: [record.spec.key for record in self.records.all()] + list(busy)
        )
        return [f"cgroup {name}" for name in removed] + released

    # --- for the admin commands ------------------------------------------------------------

    def new_spec(self, user: str, template: str, end: datetime, **options: object) -> SessionSpec:
        return new_spec(
            self.config,
            self.list_sessions(),
            self.host_gpus(),
            user,
            template,
            end,
            **options,  # type: ignore[arg-type]
        )
