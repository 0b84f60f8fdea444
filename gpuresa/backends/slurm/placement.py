"""Which node of the cluster a session goes to.

A booking names a node, or `partition:<name>` (or nothing: the config's
partition, else any node), and gpuresa takes the first node by name with the
GPUs free of its other sessions at that time and that runs jobs. A named node
is taken whatever its state: the reservation holds it ahead, and an admin may
bring it back before the start (the job says so when it cannot run).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpuresa.backends.slurm.gateway import Node
from gpuresa.backends.slurm.records import Record
from gpuresa.model import SessionSpec
from gpuresa.sessions.errors import SessionError

PARTITION = "partition:"


def gpus_booked(spec: SessionSpec, records: Iterable[Record]) -> dict[str, int]:
    """GPUs that gpuresa's other sessions hold on each node during `spec`'s time."""
    booked: dict[str, int] = {}
    for record in records:
        if record.key != spec.key and record.start < spec.end and spec.start < record.end:
            booked[record.node] = booked.get(record.node, 0) + record.gpus
    return booked


def node_for(
    spec: SessionSpec, nodes: Mapping[str, Node], records: Iterable[Record], partition: str
) -> Node:
    """The node of `spec`'s place (`partition`: the config's, for a booking naming none);
    raises `SessionError` naming what is wrong."""
    place = spec.place or (PARTITION + partition if partition else "")
    count = spec.gpu_count
    booked = gpus_booked(spec, records)
    if place and not place.startswith(PARTITION):
        node = nodes.get(place)
        if node is None:
            raise SessionError(f"the cluster has no node {place!r}")
        if count > node.gpus:
            raise SessionError(f"{count} GPU(s) asked, but node {place} has {node.gpus}")
        held = booked.get(node.name, 0)
        if held + count > node.gpus:
            raise SessionError(
                f"{count} GPU(s) asked, but {held} of the {node.gpus} of node {place} "
                "are booked through gpuresa at that time"
            )
        return node
    wanted = place.removeprefix(PARTITION)
    # awake nodes first: a sleeping one starts the job only once it is up (minutes)
    members = sorted(
        (node for node in nodes.values() if not wanted or wanted in node.partitions),
        key=lambda node: (node.asleep, node.name),
    )
    if not members:
        raise SessionError(f"the cluster has no partition {wanted!r}")
    for node in members:
        if booked.get(node.name, 0) + count <= node.gpus and node.runs_jobs:
            return node
    idle = not_running_jobs(members)
    raise SessionError(
        f"no node of partition {wanted or '(any)'} has {count} GPU(s) free"
        + (f"; not taking jobs: {idle}" if idle else "")
    )


def not_running_jobs(nodes: Iterable[Node]) -> str:
    """The nodes that take no job, by state, a few names each (for an admin to read)."""
    by_state: dict[str, list[str]] = {}
    for node in nodes:
        if not node.runs_jobs:
            by_state.setdefault(node.state, []).append(node.name)
    return "; ".join(
        f"{state}: {', '.join(names[:3])}{', …' if len(names) > 3 else ''} ({len(names)})"
        for state, names in sorted(by_state.items())
    )
