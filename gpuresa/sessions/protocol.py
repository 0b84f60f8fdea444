"""The session protocol: how the daemon, the planner's inputs, the output service and
the CLI reach sessions, whatever runs them.

A *session backend* serves the sessions of one host (a Docker or Podman engine
through `gpuresa.backends.engines`; later a rootless runtime or a cluster scheduler). It
is given `SessionSpec`s whose GPUs and ports the pure planner already chose,
and shows what runs as `Session` values. What only one backend has (images,
networks and FTP sidecars for engines; cgroups for a rootless runtime;
reservations and jobs for a scheduler) stays behind it.

The contract, which `tests/test_backend_contract.py` checks on every backend:

- **Everything is idempotent and keyed.** A session is named by its
  reservation key alone. `prepare` and `start` of a session that is already
  there return it; `stop` and `kill` of one that is gone do nothing. The
  backend writes enough next to each session (labels, files on the host) that
  `list_sessions` of a *new* backend object, after a daemon restart or a
  `kill -9`, returns every session of the host: that is adoption.
- **Nothing in a session is run or waited on.** The user is root there:
  messages and new end times are written from the host, a stop signals from
  the host. Every call is bounded in time; a backend that cannot be reached
  raises `RuntimeUnavailable`, one that does not answer in time
  `EngineTimeout`, and a request it cannot serve `SessionError` with the
  reason (`ImageMissing` when `provision` must run first).
- **prepare(spec)** makes everything short of letting the user in and returns
  the session in state "created"; **start(spec)** lets the user in (preparing
  first when needed, never provisioning) and returns it "running" once its
  SSH server answers. A start that fails leaves nothing but the output folder.
- **stop(key, grace)** gives every process of the session SIGTERM and up to
  `grace` to exit, then kills what is left and removes the session; the
  output is kept and handed to its owner. **kill(key)** is the same without
  the grace, for a stop that overran its deadline.
- **message(key, text)** shows a text to the session's user; **extend(key,
  end)** records a new end, which `list_sessions` returns from then on and the
  session shows. Neither waits on the session.
- **signal(key, number)** sends `number` to every process the session's
  user runs that catches it (has a handler: `sessions.signals`), from the
  host, sparing what the stop's SIGTERM spares (the container's init, the
  session's SSH listener, the launch machinery): a warning that ends
  nothing, which a checkpointing script asks for by handling it. Returns
  how many got it (a backend that cannot count, such as Slurm, says 1 for a
  signal it handed on). A session that is not running, or is gone, gets
  nothing: 0, never an error. Nothing in the session is run or waited on.
- **capabilities** says what the backend can do (`backends.capabilities`):
  whoever behaves differently by backend asks it, never the backend's name;
  it is the value `host_capabilities` gives for the backend's host.
- **check_spec(spec)** refuses, before anything is made, what the host cannot
  serve; **host_gpus()** are the GPU indices the planner may hand out.
- **provisioned(template, cuda)** says, at once, whether sessions of that
  template can start without the slow **provision(template, cuda)** (an image
  build, a load; template None: only what every session shares, such as a
  sidecar's image): the daemon runs the latter on a worker of its own, never
  under a start (a start that would need it raises `ImageMissing`).
- **reset(key)** ends what runs the user's work (after the GPUs were lost
  inside it) and keeps the rest: the session then lists as "stopped" and the
  daemon's next start makes it again with its devices granted anew.
- **finish_stop(session)** does what follows a session's removal (its output
  handed to its owner, its retention recorded), for a stop that a restart cut
  short after the removal; logs, never raises.
- **sessions_and_units()** is `list_sessions()` with, for the GPU tracker, the
  name each session's processes carry in their cgroup path (a container id,
  a cgroup folder) mapped to (key, role), from one look.
- **facts(session)** is what the session shows its user (banner, motd).
- **cleanup(busy)** removes what no session uses any more (never anything of
  the sessions whose keys are in `busy`) and returns what it removed.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime, timedelta
from signal import Signals
from typing import Protocol, runtime_checkable

from gpuresa.config.capabilities import Capabilities
from gpuresa.model import Session, SessionSpec
from gpuresa.sessions.files import SessionFacts


@runtime_checkable
class SessionBackend(Protocol):
    """The sessions of one host, whatever runs them (see the module's contract)."""

    @property
    def capabilities(self) -> Capabilities:
        """What this backend's sessions are like (see `Capabilities`)."""
        ...

    def check(self) -> None:
        """Refuse, with a `SessionError`, a backend whose sessions would not be confined."""
        ...

    def host_gpus(self) -> tuple[int, ...]:
        """The GPU indices this host hands out."""
        ...

    def check_spec(self, spec: SessionSpec) -> None:
        """Refuse, with a `SessionError`, a spec this host cannot serve."""
        ...

    def provisioned(self, template: str | None, cuda: str | None) -> bool:
        """Whether sessions of `template`'s variant `cuda` need no `provision`; never waits."""
        ...

    def provision(self, template: str | None, cuda: str | None) -> None:
        """Make what sessions of `template` need (None: what all share); may take minutes."""
        ...

    def prepare(self, spec: SessionSpec, ready_timeout: float = 30) -> Session:
        """Everything short of letting the user in; the session, "created"."""
        ...

    def start(self, spec: SessionSpec, ready_timeout: float = 30) -> Session:
        """Let the user in (preparing first when needed); the session, "running"."""
        ...

    def stop(self, key: str, grace: timedelta) -> None:
        """SIGTERM, up to `grace`, then kill and remove; the output kept."""
        ...

    def kill(self, key: str) -> None:
        """Kill and remove at once; the output kept."""
        ...

    def list_sessions(self) -> list[Session]:
        """Every session of this host, rebuilt from what the backend left (adoption)."""
        ...

    def sessions_and_units(self) -> tuple[list[Session], dict[str, tuple[str, str]]]:
        """`list_sessions()` and each session's cgroup unit name -> (key, role)."""
        ...

    def reset(self, key: str) -> None:
        """End what runs the user's work and keep the rest, to be made again."""
        ...

    def finish_stop(self, session: Session) -> None:
        """Hand a removed session's output over and date it; never raises."""
        ...

    def message(self, key: str, text: str) -> None:
        """Show `text` to the session's user; never waits on the session."""
        ...

    def extend(self, key: str, end: datetime) -> None:
        """Record and show the session's new end."""
        ...

    def used(self, key: str) -> bool | None:
        """Whether the session's user has logged in (SSH, SFTP or FTP) since it started;
        None when the backend cannot tell or the session does not run."""
        ...

    def signal(self, key: str, number: Signals) -> int:
        """Send `number` to the user's processes of the session; how many got it (0: none)."""
        ...

    def facts(self, session: Session | SessionSpec) -> SessionFacts:
        """What the session shows its user."""
        ...

    def cleanup(self, busy: Collection[str]) -> list[str]:
        """Remove what no session uses any more; what was removed."""
        ...
