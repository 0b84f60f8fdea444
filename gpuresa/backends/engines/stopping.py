"""Ending a session from the host: SIGTERM, a grace period, SIGKILL, removal.

Nothing is run in the container and nothing in it is waited on: its
processes are found in its cgroup and signalled from the host
(`processes`), the grace is spent polling the host's /proc, and the end is
a SIGKILL to the container's init, which makes the kernel kill every process
of its PID namespace (a process that ignores SIGTERM, a job started with
sudo, a fork bomb within the pids limit). Docker then only removes what has
already exited; each of its calls is bounded by the engine's timeout. The
processes the SIGTERM reaches get other signals the same way
(`signal_processes`: a warning a checkpointing script can catch).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

from gpuresa.backends.engines import processes
from gpuresa.backends.engines.engine import Engine
from gpuresa.backends.engines.lookup import Found, container_name, init_pid, status
from gpuresa.sessions.signals import catching

log = logging.getLogger(__name__)

# How long a removal waits for the engine to let go of the session's host ports.
PORTS_FREED_WITHIN = 30.0
# The programs of the engines that hold a container's published ports for it.
ENGINE_PROGRAMS = frozenset(
    {"podman", "conmon", "dockerd", "docker-proxy", "rootlessport", "rootlessport-ch", "pasta"}
)

# How often the grace period checks whether the session's processes are gone.
POLL_INTERVAL = 0.1
# How long a SIGKILLed container may take to be empty before Docker removes it anyway.
KILL_SETTLE = 5.0


def container_cgroup(container: dict[str, Any]) -> Path | None:
    """The cgroup folder of a running container, checked to be this container's.

    None when it does not run, or its init's pid now belongs to something
    else (a pid reused after the container exited: never signal that).
    """
    pid = init_pid(container)
    if status(container) != "running" or pid <= 0:
        return None
    folder = processes.cgroup_of(pid)
    if folder is None or str(container["Id"]) not in str(folder):
        return None
    return folder


def user_processes(main: dict[str, Any]) -> tuple[int, Path, set[int]] | None:
    """The main container's init pid, cgroup folder and the processes its user runs.

    Those are every member of its cgroup but its init and sshd (see
    `processes.processes_to_end`); None when the container does not run.
    """
    folder = container_cgroup(main)
    if folder is None:
        return None
    pid = init_pid(main)
    return pid, folder, processes.processes_to_end(pid, folder)


def signal_processes(key: str, main: dict[str, Any] | None, number: signal.Signals) -> int:
    """Send `number` to the processes the user runs in the main container `main` that catch
    it, from the host.

    Its init and sshd are spared, as by the stop's SIGTERM, and every process
    without a handler for it (`sessions.signals`); nothing is waited on.
    Returns how many got it: 0 when there is no main container or it does
    not run.
    """
    found = None if main is None else user_processes(main)
    if found is None:
        log.info("%s: the main container does not run; %s sent to nobody", key, number.name)
        return 0
    _, folder, targets = found
    # only to those with a handler: the warning must end nothing (see sessions.signals)
    targets = set(catching(targets, number))
    sent = processes.send(targets, number, folder) if targets else 0
    log.info("%s: %s sent to %d processes", key, number.name, sent)
    return sent


def give_grace(key: str, main: dict[str, Any] | None, grace: timedelta) -> None:
    """SIGTERM every process of the main container (but its init and sshd), wait up to `grace`.

    Returns as soon as they are all gone, or when `grace` is over; at once
    when there is no grace or no main container running.
    """
    found = None if main is None or grace <= timedelta(0) else user_processes(main)
    if found is None:
        log.debug("%s: no grace to give, or the main container does not run", key)
        return
    pid, folder, targets = found
    if not targets:
        return
    sent = processes.send(targets, signal.SIGTERM, folder)
    log.info("%s: SIGTERM sent to %d processes; waiting up to %s", key, sent, grace)
    deadline = time.monotonic() + grace.total_seconds()
    while time.monotonic() < deadline:
        if not processes.remaining(pid, folder):
            log.info("%s: every process ended within the grace period", key)
            return
        time.sleep(POLL_INTERVAL)
    left = len(processes.remaining(pid, folder))
    log.info("%s: %d processes outlived the grace period; killing them", key, left)


def kill_from_host(key: str, found: Found) -> None:
    """SIGKILL the init of each running container of a session, from the host.

    The kernel then kills every process in the container's PID namespace.
    Waits (host-side, briefly) until their cgroups are empty; a container
    that could not be signalled is left to Docker's forced removal.
    """
    folders = []
    for container in found.all:
        folder = container_cgroup(container)
        if folder is None:
            continue
        if processes.send({init_pid(container)}, signal.SIGKILL, folder):
            folders.append(folder)
        else:
            log.warning("%s: could not SIGKILL %s from the host", key, container_name(container))
    deadline = time.monotonic() + KILL_SETTLE
    while folders and time.monotonic() < deadline:
        folders = [folder for folder in folders if processes.members(folder)]
        if folders:
            time.sleep(POLL_INTERVAL)


def end_containers(engine: Engine, key: str, found: Found) -> None:
    """SIGKILL a session's containers from the host (`kill_from_host`), then remove them."""
    kill_from_host(key, found)
    remove_containers(engine, key, found)


def end_main(engine: Engine, key: str, found: Found) -> bool:
    """End and remove the main container alone of `found`; whether there was one."""
    if found.main is None:
        return False
    end_containers(engine, key, Found(found.main, None))
    return True


def remove_containers(engine: Engine, key: str, found: Found) -> None:
    """Remove a session's containers (forced: Docker kills what still runs); gone is done.

    Returns once their host ports are free: on Podman, once the containers'
    conmon processes, which hold them, have exited (at most `PORTS_FREED_WITHIN`),
    so a session started next on those ports does not find them taken.
    """
    keepers = processes.port_keepers({str(container["Id"]) for container in found.all})
    in_parallel(
        [
            functools.partial(engine.remove_container, container["Id"], key)
            for container in found.all
        ]
    )
    deadline = time.monotonic() + PORTS_FREED_WITHIN
    left = processes.wait_exited(keepers, PORTS_FREED_WITHIN)
    if left:
        log.warning("%s: the engine still holds the session's ports (conmon %s)", key,
                    sorted(left))  # fmt: skip
    # and, whoever holds them (Podman's service keeps a port it reserved for a container
    # that failed to start a moment longer than that container's conmon), until they are free
    held = engine_held([binding for binding in published(found) if not bindable(*binding)])
    while held and time.monotonic() < deadline:
        time.sleep(0.05)
        held = [binding for binding in held if not bindable(*binding)]
    if held:
        holders = processes.listening_programs({port for _, port in held})
        named = [
            f"{address}:{port} ({', '.join(sorted(holders.get(port, ()))) or 'no program seen'})"
            for address, port in held
        ]
        log.warning("%s: ports still held %.0f s after the removal: %s", key,
                    PORTS_FREED_WITHIN, ", ".join(named))  # fmt: skip


def engine_held(bindings: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The `bindings` held by the engine (or by no program seen here), not by another program:
    a port some other program holds (the reason a start failed, often) is not the engine's
    to let go of, and waiting for it would only delay the removal."""
    if not bindings:
        return []
    programs = processes.listening_programs({port for _, port in bindings})
    return [
        (address, port)
        for address, port in bindings
        if not programs.get(port) or programs[port] & ENGINE_PROGRAMS
    ]


def published(found: Found) -> list[tuple[str, int]]:
    """The (address, port) pairs a session's containers had published on the host."""
    pairs = []
    for container in found.all:
        bindings = (container.get("HostConfig") or {}).get("PortBindings") or {}
        for entries in bindings.values():
            for entry in entries or ():
                with contextlib.suppress(KeyError, TypeError, ValueError):
                    pairs.append((str(entry.get("HostIp") or "0.0.0.0"), int(entry["HostPort"])))
    return pairs


def bindable(address: str, port: int) -> bool:
    """Whether a listener could bind `address:port` now (TIME_WAIT connections do not count)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError:
            return False
    return True


def in_parallel(calls: Sequence[Callable[[], object]]) -> None:
    """Run `calls` at once and wait for all; the first failure is raised after."""
    if len(calls) <= 1:
        for call in calls:
            call()
        return
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
    for future in futures:
        error = future.exception()
        if error is not None:
            raise error
