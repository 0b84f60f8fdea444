"""The Slurm backend on this machine's real Slurm: reservations, jobs, logins, other users.

A booking's reservation is visible in Slurm ahead of its start; at the start
a job of the booking's user runs in it holding the booked GPUs and serves
SSH; the node's other GPUs stay the cluster's while a booked GPU is never
given to another user's job; a new backend object (a daemon killed with
`kill -9`) adopts the reservation and the job without making either twice;
what the cluster cannot serve is refused with its reason.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import logging
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from slurm_site import NODE, SlurmSite, slurm_site
from support.waiting import wait_for
from test_runtime import run, ssh_login

from gpuresa.backends.port_safety import port_warnings, unprivileged_port_start
from gpuresa.backends.slurm import slurm_name
from gpuresa.sessions.errors import SessionError

# real host accounts, real daemons and servers: not for the fast lane
pytestmark = pytest.mark.services


@pytest.fixture(name="cluster")
def cluster_fixture(tmp_path: Path) -> Iterator[SlurmSite]:
    with slurm_site(tmp_path) as site:
        yield site


def squeue(job: str, field: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", field], capture_output=True,
                          text=True, check=False).stdout.strip()  # fmt: skip


def reservation_text(name: str) -> str:
    return subprocess.run(["scontrol", "-o", "show", "reservation", name], capture_output=True,
                          text=True, check=False).stdout  # fmt: skip


def submit(user: str, gpus: int) -> str:
    done = subprocess.run(
        ["runuser", "-u", user, "--", "sbatch", "--parsable", f"--gres=gpu:{gpus}",
         f"--nodelist={NODE}", "--time=5", "--output=/dev/null", "--wrap", "sleep 120"],
        capture_output=True, text=True, check=True, cwd="/",
    )  # fmt: skip
    return done.stdout.strip()


def node_state() -> str:
    shown = subprocess.run(["scontrol", "-o", "show", "node", NODE], capture_output=True,
                           text=True, check=True).stdout  # fmt: skip
    return shown.split("State=", 1)[1].split()[0]


def wait_state(job: str, wanted: str, timeout: float = 30) -> str:
    """`wanted` once job `job` is in that state; fails the test after `timeout` seconds."""

    def reached() -> str | None:
        state = squeue(job, "%T")
        return state if state == wanted else None

    return wait_for(reached, timeout, f"job {job} {wanted}")


def verdict(job: str) -> str | None:
    """The job's state and reason once the scheduler has decided on it (not pending for no
    reason yet, as a job is before the scheduler first looks at it)."""
    shown = squeue(job, "%T %r")
    state, _, reason = shown.partition(" ")
    return None if state == "PENDING" and reason in ("", "None") else shown


def test_a_booking_is_a_reservation_then_a_job_holding_its_gpus(cluster: SlurmSite) -> None:
    backend = cluster.backend()
    now = datetime.now(UTC).replace(microsecond=0)
    spec = cluster.spec(gpus=2, start=now + timedelta(seconds=20), end=now + timedelta(minutes=30))
    name = slurm_name("cluster", spec.key)
    prepared = backend.prepare(spec)
    assert prepared.state == "created"
    shown = reservation_text(name)
    assert f"Users={spec.user}" in shown and f"Nodes={NODE}" in shown, shown
    started = backend.start(spec)
    assert started.state == "running"
    job = next(item.split()[1] for item in started.containers if item.startswith("job "))
    assert squeue(job, "%u %T %b") == f"{spec.user} RUNNING gres:gpu:2"
    with ssh_login(started, spec.user, cluster.key(spec.user)) as client:
        code, output = run(client, "id -un; echo $CUDA_VISIBLE_DEVICES $SLURM_JOB_ID")
        assert code == 0 and output.split() == [spec.user, "0,1", job], output
        code, output = run(client, f"srun --jobid={job} --overlap true && echo joined")
        assert "joined" in output, output
        run(client, "echo kept > $GPURESA_OUTPUT/result.txt")
        # the start notice names the key the job's sshd presents
        presented = client.get_transport().get_remote_server_key().asbytes()  # type: ignore[union-attr]
        digest = base64.b64encode(hashlib.sha256(presented).digest()).decode().rstrip("=")
        assert f" SHA256:{digest} " in started.host_key, started.host_key
        # kept in the record: a restarted daemon's notice names it too
        adopted = {item.key: item for item in cluster.backend().list_sessions()}
        assert adopted[spec.key].host_key == started.host_key
        with client.open_sftp() as sftp:
            assert "result.txt" in sftp.listdir(str(started.output_dir))
    # the node's two other GPUs are the cluster's; a third is not
    other = cluster.users[1]
    fits, waits = submit(other, 2), submit(other, 1)
    assert wait_state(fits, "RUNNING") == "RUNNING"
    # the scheduler looked at it and keeps it waiting
    shown = wait_for(lambda: verdict(waits), 60, "the scheduler's verdict on the third GPU")
    assert shown.startswith("PENDING "), shown
    subprocess.run(["scancel", fits], check=True)
    assert wait_state(waits, "RUNNING") == "RUNNING"
    # warnings reach the session; the end comes from Slurm's time limit of the job
    backend.message(spec.key, "five minutes left")
    with ssh_login(started, spec.user, cluster.key(spec.user)) as client:
        assert "five minutes left" in run(client, "cat $GPURESA_SESSION/message")[1]
    backend.stop(spec.key, timedelta(seconds=2))
    assert squeue(job, "%T") == ""
    assert (started.output_dir / "result.txt").read_text() == "kept\n"


def test_a_restarted_daemon_adopts_without_doubling(cluster: SlurmSite) -> None:
    spec = cluster.spec(gpus=1)
    cluster.backend().start(spec)
    # a new backend object is what a daemon killed with kill -9 starts with
    again = cluster.backend()
    adopted = {session.key: session for session in again.list_sessions()}
    assert adopted[spec.key].state == "running"
    again.start(spec)
    again.prepare(spec)
    name = slurm_name("cluster", spec.key)
    jobs = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True,
                          text=True, check=True).stdout.split()  # fmt: skip
    assert len(jobs) == 1, jobs
    assert reservation_text(name).count("ReservationName=") <= 1
    again.stop(spec.key, timedelta(seconds=1))


def test_the_jobs_limit_leaves_gpuresas_stop_its_grace(cluster: SlurmSite) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    # 50 s to the end, the stop's 30 s of grace (the default) and its 60 s margin: whole
    # minutes from the submission (seconds later on a loaded machine) give three
    assert cluster.config.daemon.stop_grace == timedelta(seconds=30)
    spec = cluster.spec(end=now + timedelta(seconds=50))
    started = cluster.backend().start(spec)
    job = next(item.split()[1] for item in started.containers if item.startswith("job "))
    assert squeue(job, "%l") == "3:00"
    ends = datetime.fromisoformat(squeue(job, "%e")).replace(tzinfo=UTC)
    assert ends >= spec.end + cluster.config.daemon.stop_grace + timedelta(seconds=59)
    cluster.backend().stop(spec.key, timedelta(seconds=1))


def test_session_stop_on_the_command_line_ends_the_job(cluster: SlurmSite) -> None:
    spec = cluster.spec()
    started = cluster.backend().start(spec)
    job = next(item.split()[1] for item in started.containers if item.startswith("job "))
    done = subprocess.run(
        [sys.executable, "-m", "gpuresa.cli", "--config", str(cluster.root / "config.toml"),
         "session", "stop", spec.key, "--grace", "1s"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"session {spec.key} stopped; output kept in {started.output_dir}" in done.stdout
    assert squeue(job, "%T") == ""
    assert spec.key not in {item.key for item in cluster.backend().list_sessions()}
    again = subprocess.run(
        [sys.executable, "-m", "gpuresa.cli", "--config", str(cluster.root / "config.toml"),
         "session", "stop", spec.key],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert again.returncode == 0 and "nothing to stop" in again.stdout, again


def test_a_reservation_refused_ahead_is_made_once_the_node_frees(
    cluster: SlurmSite, caplog: pytest.LogCaptureFixture
) -> None:
    backend = cluster.backend()
    backend.reserver.retry_every = 0
    other = cluster.users[1]
    # gpuresa's own session runs on the node: Slurm calls the node busy for any later
    # reservation, and gpuresa makes it beside its own jobs, never beside another's
    first = cluster.spec(gpus=1)
    backend.start(first)
    ended = submit(other, 1)
    assert wait_state(ended, "RUNNING") == "RUNNING"
    subprocess.run(["scancel", ended], check=True)
    running = submit(other, 1)
    assert wait_state(running, "RUNNING") == "RUNNING"
    now = datetime.now(UTC).replace(microsecond=0)
    spec = cluster.spec(gpus=1, start=now + timedelta(minutes=3), end=now + timedelta(minutes=20))
    name = slurm_name("cluster", spec.key)
    with caplog.at_level(logging.INFO, logger="gpuresa.backends.slurm.reserver"):
        backend.prepare(spec)
        backend.list_sessions()
    # the other user's job would run into the booking: no reservation yet, said once
    assert "ReservationName=" not in reservation_text(name)
    said = [item.getMessage() for item in caplog.records if f"other jobs ({running})" in
            item.getMessage()]  # fmt: skip
    assert len(said) == 1 and "tried again until the start" in said[0], said
    subprocess.run(["scancel", running], check=True)
    # both of the other's jobs are over, yet squeue still lists them for a while
    # (a cancelled job shows COMPLETING, now and then, while the node runs its epilog)
    mine = (int(ended), int(running))

    def over() -> dict[int, str]:
        return {job.id: job.state for job in backend.gateway.jobs() if job.id in mine}

    cancelled = {int(ended): "CANCELLED", int(running): "CANCELLED"}
    wait_for(lambda: over() == cancelled, 30, "both jobs over and still listed")
    wait_for(lambda: backend.list_sessions() and "ReservationName=" in reservation_text(name),
             30, "the reservation at a later try")  # fmt: skip
    shown = reservation_text(name)
    assert f"Users={spec.user}" in shown and f"Nodes={NODE}" in shown, shown
    backend.stop(spec.key, timedelta(0))
    backend.stop(first.key, timedelta(0))


def test_what_the_cluster_cannot_serve_is_refused_with_its_reason(cluster: SlurmSite) -> None:
    backend = cluster.backend()
    cases = {
        "no node 'nowhere'": cluster.spec(place="nowhere"),
        "no partition 'nopart'": cluster.spec(place="partition:nopart"),
        f"node {NODE} has 4": cluster.spec(gpus=5),
        "has no account": dataclasses.replace(cluster.spec(), user="nosuchgpuresauser"),
    }
    for reason, spec in cases.items():
        with pytest.raises(SessionError, match=reason):
            backend.check_spec(spec)
        with pytest.raises(SessionError):
            backend.prepare(spec)
        assert spec.key not in {session.key for session in backend.list_sessions()}


def test_a_partition_booking_gets_a_node_with_the_gpus(cluster: SlurmSite) -> None:
    backend = cluster.backend()
    first = cluster.spec(gpus=3, place="partition:gpu")
    backend.prepare(first)
    second = cluster.spec(gpus=2, place="partition:gpu")
    with pytest.raises(SessionError, match="no node of partition gpu has 2"):
        backend.check_spec(second)
    backend.stop(first.key, timedelta(0))


def test_a_booking_of_any_node_gets_one_that_runs_jobs(cluster: SlurmSite) -> None:
    # sim01..sim50 have the GPUs, but no slurmd ever answered for them (UNKNOWN, then
    # NOT_RESPONDING or DOWN): a job there would never run. Where they sort before this
    # node (hostname "vm") the first booking shows it; the drained node below shows it
    # whatever the hostname (a placement that did not look would take sim01)
    backend = cluster.backend()
    nodes = backend.gateway.nodes()
    assert not nodes["sim01"].runs_jobs and nodes["sim01"].gpus == 4, nodes["sim01"]
    first = cluster.spec(place="")
    backend.prepare(first)
    shown = reservation_text(slurm_name("cluster", first.key))
    assert f"Nodes={NODE} " in shown, shown
    # the one node that answers is drained by an admin: nothing is placed on it
    subprocess.run(["scontrol", "update", f"NodeName={NODE}", "State=DRAIN",
                    "Reason=gpuresa test"], check=True)  # fmt: skip
    try:
        with pytest.raises(
            SessionError, match=rf"not taking jobs: .*[A-Z+]*DRAIN[A-Z+]*: {NODE} \(1\)"
        ):
            backend.check_spec(cluster.spec(place=""))
    finally:
        subprocess.run(["scontrol", "update", f"NodeName={NODE}", "State=RESUME"], check=True)
        # resumed, the node is "not responding" until its slurmd registers again (seconds)
        wait_for(lambda: "RESPOND" not in node_state(), 60, f"{NODE} to answer again")
    backend.check_spec(cluster.spec(place=""))
    backend.stop(first.key, timedelta(0))


def test_a_node_is_not_booked_past_its_gpus(cluster: SlurmSite) -> None:
    backend = cluster.backend()
    first = cluster.spec(gpus=3)
    backend.prepare(first)
    second = cluster.spec(gpus=2)
    with pytest.raises(SessionError, match=f"3 of the 4 of node {NODE} are booked"):
        backend.prepare(second)
    later = cluster.spec(gpus=2, start=first.end, end=first.end + timedelta(hours=1))
    backend.check_spec(later)
    backend.stop(first.key, timedelta(0))


def test_the_time_limit_never_ends_before_the_booking(cluster: SlurmSite) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    # 90 s from now and the stop's 90 s (grace and margin): whole minutes from the
    # submission (seconds later on a loaded machine)
    spec = cluster.spec(end=now + timedelta(seconds=90))
    backend = cluster.backend()
    started = backend.start(spec)
    job = next(item.split()[1] for item in started.containers if item.startswith("job "))
    assert squeue(job, "%l") == "3:00"
    longer = spec.end + timedelta(seconds=95)
    backend.extend(spec.key, longer)
    ends = datetime.fromisoformat(squeue(job, "%e")).replace(tzinfo=UTC)
    assert ends >= longer, (ends, longer)
    backend.stop(spec.key, timedelta(seconds=1))
    # the stop hands the output over and dates it for its retention
    assert any((cluster.root / "state" / "outputs").rglob("*"))


def test_a_session_serves_on_the_clusters_default_ports(cluster: SlurmSite) -> None:
    # no ssh_ports in the site's config: the cluster's default, which a job's sshd (the
    # login's) can bind; nothing in it is advised against on this machine
    ports = cluster.config.host().ssh_ports
    assert ports.first >= unprivileged_port_start() and port_warnings(cluster.config) == []
    port = next(port for port in ports if port_is_free(port))
    spec = cluster.spec(ssh_port=port)
    started = cluster.backend().start(spec)
    with ssh_login(started, spec.user, cluster.key(spec.user)) as client:
        assert run(client, "id -un")[1].split() == [spec.user]
        presented = client.get_transport().get_remote_server_key().asbytes()  # type: ignore[union-attr]
        digest = base64.b64encode(hashlib.sha256(presented).digest()).decode().rstrip("=")
        assert f" SHA256:{digest} " in started.host_key, started.host_key
    cluster.backend().stop(spec.key, timedelta(seconds=1))


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
