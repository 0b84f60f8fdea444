"""Choosing GPUs and ports for a session: pure functions over what is already taken, and
the spec of a new session that they make."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from gpuresa.config.capabilities import host_capabilities
from gpuresa.config.sections import HostConfig
from gpuresa.errors import UserError
from gpuresa.model import Reservation, SessionSpec
from gpuresa.planning.facts import Inventory


class AllocationError(UserError):
    """No GPUs or ports are left for a session."""


@dataclass(frozen=True)
class Ports:
    """The ports of one session: SSH, FTP control, and a passive FTP range."""

    ssh: int
    ftp: int
    passive_first: int
    passive_last: int

    def all(self) -> set[int]:
        return {self.ssh, self.ftp, *range(self.passive_first, self.passive_last + 1)}


@dataclass(frozen=True)
class Holding:
    """What one session or planned session holds, and for how long."""

    key: str
    gpus: tuple[int, ...]
    ports: Ports
    start: datetime
    end: datetime


def allocate_ports(host: HostConfig, taken: Iterable[Ports]) -> Ports:
    """The lowest free SSH port, FTP port and passive block of the host's ranges.

    Ports are never shared, whatever the times: a stopped session's ports are
    freed when its containers are removed. Raises `AllocationError` when a
    range is exhausted.
    """
    used: set[int] = set()
    for ports in taken:
        used |= ports.all()
    ssh = next((port for port in host.ssh_ports if port not in used), None)
    if ssh is None:
        raise AllocationError(f"host {host.name}: every SSH port of {host.ssh_ports} is in use")
    ftp = next((port for port in host.ftp_ports if port not in used), None)
    if ftp is None:
        raise AllocationError(f"host {host.name}: every FTP port of {host.ftp_ports} is in use")
    size = host.ftp_passive_per_session
    passive = host.ftp_passive_ports
    for first in range(passive.first, passive.last - size + 2, size):
        block = range(first, first + size)
        if not used.intersection(block):
            return Ports(ssh, ftp, first, first + size - 1)
    raise AllocationError(
        f"host {host.name}: no free block of {size} passive FTP ports in {passive}"
    )


def allocate_gpus(
    available: tuple[int, ...],
    count: int,
    start: datetime,
    end: datetime,
    holdings: Iterable[Holding],
) -> tuple[int, ...] | None:
    """The `count` lowest GPU indices that no holding overlapping [start, end) uses.

    Returns None when too few are free. Explicit indices, never "any N GPUs":
    asking Docker for a count gives every session the same GPUs.
    """
    busy: set[int] = set()
    for holding in holdings:
        if holding.start < end and start < holding.end:
            busy.update(holding.gpus)
    free = [index for index in sorted(available) if index not in busy]
    if len(free) < count:
        return None
    return tuple(free[:count])


def new_spec(
    reservation: Reservation,
    inventory: Inventory,
    holdings: list[Holding],
    taken_ports: list[Ports],
    placed: tuple[int, ...] | None = None,
) -> SessionSpec | str:
    """A spec with GPUs and ports for a new session, or the reason there is none.

    On a cluster (`scheduled`) the GPUs are a count on the node the backend
    chooses, which refuses a booking its node cannot hold: the planner counts
    none of them (one host-wide list would over-book some nodes and refuse
    bookings that other nodes can serve).
    """
    # a scheduler's session: a count, whose devices its node chooses
    count = reservation.gpus if scheduled(inventory) else 0
    gpus: tuple[int, ...] = ()
    if not scheduled(inventory) and reservation.gpus > 0 and inventory.host.gpu_mode != "none":
        chosen = placed or allocate_gpus(
            inventory.gpus, reservation.gpus, reservation.start, reservation.end, holdings
        )
        if chosen is None:
            return (
                f"{reservation.gpus} GPU(s) are not free on {inventory.host.name} "
                f"from {reservation.start.isoformat()} to {reservation.end.isoformat()}"
            )
        gpus = chosen
        count = len(chosen)
    try:
        ports = allocate_ports(inventory.host, taken_ports)
    except AllocationError as error:
        return str(error)
    return SessionSpec(
        key=reservation.key,
        user=reservation.user,
        host=reservation.host,
        template=reservation.template,
        cuda=reservation.cuda,
        gpu_count=count,
        gpu_indices=gpus,
        start=reservation.start,
        end=reservation.end,
        ssh_port=ports.ssh,
        ftp_port=ports.ftp,
        ftp_passive_first=ports.passive_first,
        ftp_passive_last=ports.passive_last,
        email=reservation.email,
        place=reservation.place if scheduled(inventory) else "",
        preemptible=reservation.preemptible and preempts(inventory),
    )


def preempts(inventory: Inventory) -> bool:
    """Whether gpuresa places this host's GPUs, so that preemptible sessions can give way."""
    return not scheduled(inventory) and inventory.host.gpu_mode != "none"


def scheduled(inventory: Inventory) -> bool:
    """Whether a scheduler places sessions and counts their GPUs on its nodes."""
    return host_capabilities(inventory.host).places_gpus
