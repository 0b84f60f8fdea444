"""Calendars name a Slurm node or partition; the planner leaves a cluster's GPUs to its nodes.

Pure: the calendar reader and the planner, with no Slurm. What a node can
hold is the backend's to refuse (tests/test_slurm.py, tests/test_slurm_e2e.py).
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from test_reservations import VARIANTS, WINDOW, event, make_config

from gpuresa.backends.port_safety import port_warnings
from gpuresa.backends.slurm.gateway import Node
from gpuresa.backends.slurm.jobs import STOP_MARGIN, limit_minutes
from gpuresa.backends.slurm.placement import node_for
from gpuresa.backends.slurm.records import Record
from gpuresa.config.reading import parse_config
from gpuresa.config.schema import PortRange
from gpuresa.config.sections import Config
from gpuresa.model import ReservationSet, Session, SessionSpec
from gpuresa.planning.actions import Fail, Prepare, Start
from gpuresa.planning.facts import Inventory
from gpuresa.planning.planner import plan
from gpuresa.reservations.conflicts import host_gpu_count, resolve_conflicts
from gpuresa.reservations.rules import read_calendar
from gpuresa.sessions.errors import SessionError

CLUSTER = [{"name": "cluster", "engine": "slurm", "ssh_ports": "20000-20009"}]


def cluster_config() -> Config:
    config = make_config({"host": "cluster"}, hosts=[*CLUSTER, {"name": "gpu1", "gpus": [0]}])
    return dataclasses.replace(config, daemon=dataclasses.replace(config.daemon, host="cluster"))


def read(text: str, config: Config | None = None) -> ReservationSet:
    config = config or cluster_config()
    return read_calendar(
        config.calendars[0], config, [("one.ics", text)], *WINDOW, variants=VARIANTS
    )


@pytest.mark.parametrize(
    ("description", "extra", "place"),
    [
        ("template: pytorch\\nnode: n1", "", "n1"),
        ("template: pytorch\\nPartition = gpu", "", "partition:gpu"),
        ("template: pytorch", "X-GPURESA-NODE:n7", "n7"),
        ("template: pytorch", "X-GPURESA-PARTITION:big-gpu", "partition:big-gpu"),
        ("template: pytorch", "", ""),
    ],
)
def test_a_booking_names_its_node_or_partition(description: str, extra: str, place: str) -> None:
    found = read(event(description=description, extra=extra))
    assert found.rejected == ()
    [reservation] = found.reservations
    assert reservation.place == place


@pytest.mark.parametrize(
    ("description", "reason"),
    [
        ("template: pytorch\\nnode: n1\\npartition: gpu", "a node or a partition, not both"),
        ("template: pytorch\\nnode: n1;rm -rf", "is not a node name"),
        ("template: pytorch\\npartition: ../etc", "is not a partition name"),
        ("template: pytorch\\nnode: -n1", "is not a node name"),
    ],
)
def test_a_place_that_is_no_slurm_name_is_rejected(description: str, reason: str) -> None:
    found = read(event(description=description))
    assert found.reservations == ()
    [rejection] = found.rejected
    assert reason in rejection.reason


def test_a_clusters_gpus_are_counted_per_node_not_per_host() -> None:
    config = cluster_config()
    assert host_gpu_count(config.host("cluster")) is None
    # eight GPUs twice at once: the calendar keeps both, the nodes decide
    first = read(event(description="template: pytorch\\ngpus: 8", uid="a"), config)
    second = read(event(description="template: pytorch\\ngpus: 8", uid="b"), config)
    both = resolve_conflicts([*first.reservations, *second.reservations], config)
    assert len(both.reservations) == 2 and both.rejected == ()


def test_the_planner_carries_the_place_and_leaves_gpus_to_the_nodes() -> None:
    config = cluster_config()
    inventory = Inventory(config.host(), (0, 1, 2, 3))
    [one] = read(event(description="template: pytorch\\ngpus: 4\\nnode: n1", uid="a")).reservations
    [two] = read(event(description="template: pytorch\\ngpus: 4\\nnode: n2", uid="b")).reservations
    now = one.start - timedelta(seconds=30)
    actions = plan([one, two], [], inventory, now, config)
    assert [type(action) for action in actions] == [Prepare, Prepare], actions
    specs = {action.key: action.spec for action in actions if isinstance(action, Prepare)}
    assert {spec.place for spec in specs.values() if spec} == {"n1", "n2"}
    # a count, and no device: the node's scheduler chooses them
    assert all(spec and (spec.gpu_count, spec.gpu_indices) == (4, ()) for spec in specs.values())
    ports = {spec.ssh_port for spec in specs.values() if spec}
    assert len(ports) == 2
    # prepared on its node, the session starts there; another session's GPU indices do not
    # make it "differ" (indices are per node)
    sessions = [
        session_of(spec, "created", node)
        for spec, node in zip(specs.values(), ("n1", "n2"), strict=True)
        if spec
    ]
    started = plan([one, two], sessions, inventory, one.start, config)
    assert sorted(type(action).__name__ for action in started) == ["Start", "Start"]
    assert all(isinstance(action, Start) and action.spec for action in started)
    assert {action.spec.place for action in started if isinstance(action, Start) and action.spec}
    assert not any(isinstance(action, Fail) for action in started)
    # the booking moved to another node: prepared again there
    moved = dataclasses.replace(one, place="n3")
    again = plan([moved, two], sessions, inventory, now, config)
    assert any(action.key == one.key and type(action).__name__ == "Stop" for action in again)


def session_of(spec: SessionSpec, state: str, node: str) -> Session:
    return Session.of(
        dataclasses.replace(spec, place=node), state=state, output_dir=Path("/out") / spec.key
    )


def node(name: str, state: str, gpus: int = 4, partitions: tuple[str, ...] = ("gpu",)) -> Node:
    return Node(name, gpus, state, partitions)


def placed(place: str, gpus: int) -> SessionSpec:
    start = datetime(2026, 11, 24, 9, tzinfo=UTC)
    return SessionSpec(
        key="b", user="alice", host="cluster", template="pytorch", cuda=None,
        gpu_count=gpus, gpu_indices=(), start=start, end=start + timedelta(hours=1), ssh_port=20000,
        ftp_port=0, ftp_passive_first=0, ftp_passive_last=0, place=place,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("state", "takes"),
    [
        ("IDLE", True),
        ("MIXED", True),
        ("ALLOCATED", True),
        ("IDLE+RESERVED", True),
        ("IDLE+DRAIN", False),
        ("MIXED+DRAIN", False),
        ("DOWN", False),
        ("DOWN+NOT_RESPONDING", False),
        ("IDLE+NOT_RESPONDING", False),
        ("UNKNOWN", False),
        ("FUTURE", False),
        ("IDLE+POWERED_DOWN", True),
        ("IDLE+POWERING_DOWN", True),
        ("IDLE+REBOOT_ISSUED", True),
        ("IDLE+INVALID_REG", False),
        ("IDLE+FAIL", False),
    ],
)
def test_a_node_runs_jobs_only_when_it_answers_and_takes_work(state: str, takes: bool) -> None:
    assert node("n1", state).runs_jobs is takes


def test_any_node_means_the_first_that_runs_jobs_and_has_the_gpus() -> None:
    nodes = {
        item.name: item
        for item in (
            node("a1", "UNKNOWN+NOT_RESPONDING"),
            node("a2", "IDLE+DRAIN"),
            node("b1", "IDLE", gpus=1),
            node("c1", "MIXED"),
            node("d1", "IDLE", partitions=("big",)),
        )
    }
    spec = placed("", 2)
    assert node_for(spec, nodes, [], "").name == "c1"
    assert node_for(spec, nodes, [], "big").name == "d1"
    # another session of gpuresa holds c1's GPUs at that time: none is left
    other = Record("o", "gpuresa-o", "bob", "cluster", "c1", "pytorch", None, 3,
                   spec.start, spec.end, 20001)  # fmt: skip
    with pytest.raises(SessionError) as refused:
        node_for(spec, nodes, [other], "gpu")
    assert str(refused.value) == (
        "no node of partition gpu has 2 GPU(s) free; not taking jobs: "
        "IDLE+DRAIN: a2 (1); UNKNOWN+NOT_RESPONDING: a1 (1)"
    )
    # an awake node before a sleeping one (power saving), whatever their names
    sleepy = {**nodes, "b0": node("b0", "IDLE+POWERED_DOWN"), "c1": node("c1", "MIXED+DRAIN")}
    assert node_for(spec, sleepy, [], "").name == "d1"
    assert node_for(spec, {"b0": sleepy["b0"]}, [], "").name == "b0"
    # a node named by the booking is taken whatever its state (an admin may resume it)
    assert node_for(placed("a2", 2), nodes, [], "").name == "a2"


@pytest.mark.parametrize(
    ("seconds", "grace", "minutes"),
    [
        # the end, the grace and the stop's 60 s margin, rounded up to whole minutes
        (50, 30, 3),
        (60, 0, 2),
        (30, 0, 2),
        (3600, 30, 62),
        (0, 90, 3),
        (-600, 0, 1),
    ],
)
def test_a_jobs_limit_lies_past_the_end_and_the_stops_grace(
    seconds: int, grace: int, minutes: int
) -> None:
    start = datetime(2025, 3, 10, 14, 0, tzinfo=UTC)
    end = start + timedelta(seconds=seconds)
    limit = limit_minutes(start, end, timedelta(seconds=grace))
    assert limit == minutes
    assert start + timedelta(minutes=limit) >= end + timedelta(seconds=grace) + STOP_MARGIN


def test_a_clusters_ssh_ports_are_unprivileged_by_default_and_advised_so() -> None:
    def host(**options: object) -> Config:
        return parse_config(
            {"daemon": {"host": "cluster"}, "hosts": [{"name": "cluster", **options}]}
        )

    # a job's sshd runs as the booking's login: its default ports are ones it can bind
    cluster = host(engine="slurm")
    assert cluster.hosts[0].ssh_ports == PortRange(22223, 22254)
    assert port_warnings(cluster, 1024) == []
    # privileged ports there are what the advice warns about, with the key
    [warning] = port_warnings(host(engine="slurm", ssh_ports="223-254"), 1024)
    assert warning.startswith("hosts[0].ssh_ports: 223-254 starts below 1024")
    assert "use ports from 1024 up" in warning
    # an engine's sessions keep their privileged default, and its advice
    engine = host(engine="docker")
    assert engine.hosts[0].ssh_ports == PortRange(223, 254)
    assert "use ports below 1024" in port_warnings(host(ssh_ports="22223-22254"), 1024)[0]
