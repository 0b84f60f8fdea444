"""End to end on the real Slurm: an ICS booking served by `gpuresa run` as its own process.

The booking becomes a reservation visible in Slurm before its start, then at
the start a job of the booking's user holding the booked GPUs, reached over
SSH as that user, who sees the warning; the job ends at the booking's end and
the output stays, dated for its retention. The daemon is killed with SIGKILL
mid-booking and started again: it adopts the reservation and the job and
makes neither twice. A booking naming a node the cluster does not have fails
with that reason, and the other goes on.
"""

from __future__ import annotations

import base64
import hashlib
import json
import pwd
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paramiko
import pytest
from slurm_site import SlurmSite, slurm_site
from support.configs import BASE_IMAGE, free_ports
from support.gpu_nodes import gpu_nodes_left_as_they_are
from support.logins import connect
from support.waiting import polls_later, wait_for
from test_daemon_cli import ics_event
from test_runtime import run

from gpuresa.backends.factory import open_backend
from gpuresa.backends.slurm import slurm_name
from gpuresa.config.reading import load_config
from gpuresa.journal.store import Journal
from gpuresa.sessions.host_keys import fingerprint_in

# real host accounts, real daemons and servers: not for the fast lane
pytestmark = pytest.mark.services


@pytest.fixture(name="cluster")
def cluster_fixture(tmp_path: Path) -> Iterator[SlurmSite]:
    # the job's container is given every /dev/nvidia* node it finds: none may come or go
    with gpu_nodes_left_as_they_are(), slurm_site(tmp_path, users=1) as site:
        yield site


def write_config(site: SlurmSite) -> Path:
    first = free_ports(4)
    config = site.root / "config.toml"
    config.write_text(
        f"""
[daemon]
host = "cluster"
state_dir = "{site.root / "state"}"
poll_interval = "1s"
prepare_ahead = "40s"
stop_grace = "1s"
warnings = ["30s"]
[[calendars]]
name = "folder"
kind = "ics"
url = "{site.root / "calendar"}"
host = "cluster"
default_template = "pytorch"
[[hosts]]
name = "cluster"
engine = "slurm"
bind_address = "127.0.0.1"
ssh_ports = "{first}-{first + 3}"
[users]
keys_dir = "{site.root / "keys"}"
host_authorized_keys = false
[templates]
base_image = "{BASE_IMAGE}"
[storage]
output_root = "{site.shared / "output"}"
[slurm]
shared_dir = "{site.shared}"
start_timeout = "60s"
"""
    )
    (site.root / "calendar").mkdir()
    return config


def daemon(config: Path, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "gpuresa.cli", "--config", str(config), "-v", "run"],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )


def slurm(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=False).stdout


def reservation_line(name: str) -> str | None:
    shown = slurm("scontrol", "-o", "show", "reservation").splitlines()
    return next((line for line in shown if line.startswith(f"ReservationName={name} ")), None)


def jobs_named(name: str) -> list[str]:
    return slurm("squeue", "-h", "-n", name, "-o", "%i %T %u %b").splitlines()


def login(site: SlurmSite, port: int) -> paramiko.SSHClient:
    return connect(port, site.users[0], site.key(site.users[0]))


def journal_state(path: Path, key: str) -> str | None:
    journal = Journal(path, read_only=True)
    try:
        return journal.states.get(key)
    finally:
        journal.close()


def test_a_booking_runs_as_a_slurm_job_and_survives_a_daemon_kill(cluster: SlurmSite) -> None:
    config = write_config(cluster)
    user = cluster.users[0]
    now = datetime.now(UTC).replace(microsecond=0)
    # the reservation is made at once (prepare_ahead 40 s) and seen well before the start,
    # even on a loaded machine
    start, end = now + timedelta(seconds=45), now + timedelta(seconds=105)
    folder = cluster.root / "calendar"
    (folder / "b.ics").write_text(ics_event("slurm-b", start, end, user, "gpus: 2"))
    (folder / "bad.ics").write_text(ics_event("slurm-bad", start, end, user, "node: nowhere"))
    name = slurm_name("cluster", "slurm-b")

    def state(key: str) -> str | None:
        return journal_state(cluster.root / "state" / "journal.sqlite", key)

    # the template's image built and saved ahead, as a site provisions (a build takes minutes)
    open_backend(load_config(config)).provision("pytorch", None)
    log = cluster.root / "daemon.log"
    process = daemon(config, log)
    try:
        # before the start: the reservation, for the user, on the node; no job yet
        shown = wait_for(lambda: reservation_line(name), 30, "the reservation")
        assert f"Users={user}" in shown, shown
        assert datetime.now(UTC) < start and jobs_named(name) == []
        # at the start: the user's job, holding the two booked GPUs
        job = wait_for(lambda: [j for j in jobs_named(name) if "RUNNING" in j], 60, "the job")
        assert len(job) == 1 and job[0].split()[2:] == [user, "gres:gpu:2"], job
        job_id = job[0].split()[0]
        # the job runs before its container and sshd are up: the session is "running" (and
        # its user told so) once its sshd answers
        wait_for(lambda: state("slurm-b") == "running", 60, "the session's sshd")
        status = subprocess.run(
            [sys.executable, "-m", "gpuresa.cli", "--config", str(config), "status"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert f"job {job_id}" in status, status
        port = int(status.split("ssh ")[1].split()[0])
        with login(cluster, port) as client:
            # in the template's container (its first process, PID 1 of a namespace of its
            # own, runs the template's command after gpuresa's session script), named after the
            # user there, with the job's GPUs and id
            code, output = run(
                client,
                "id -un; echo $CUDA_VISIBLE_DEVICES $SLURM_JOB_ID; "
                "test -f /opt/gpuresa-udocker/session.sh && echo in-container",
            )
            assert code == 0 and output.split() == [user, "0,1", job_id, "in-container"], output
            code, output = run(client, "echo kept > /output/result.txt && ls /etc/gpuresa/session")
            assert code == 0 and "end" in output.split(), output
            # the login's lasting home is theirs, on the shared folder the nodes see
            code, output = run(client, "echo $HOME && pwd && echo mine > ~/kept")
            assert code == 0 and output.split() == [f"/home/{user}"] * 2, output
            home = cluster.shared / "homes" / user
            assert (home / "kept").read_text() == "mine\n"
            assert home.stat().st_uid == (home / "kept").stat().st_uid == pwd.getpwnam(user).pw_uid
            assert home.stat().st_mode & 0o777 == 0o700
            # SFTP too, in the container, as the start notice says
            with client.open_sftp() as sftp, sftp.open("/output/result.txt") as handle:
                assert handle.read() == b"kept\n"
            # the key its sshd presents is the one whose fingerprint the start notice names
            presented = client.get_transport().get_remote_server_key().asbytes()  # type: ignore[union-attr]
            digest = base64.b64encode(hashlib.sha256(presented).digest()).decode().rstrip("=")
            public = cluster.shared / "runs" / name / "host_key.pub"
            fingerprint = fingerprint_in(public, pwd.getpwnam(user).pw_uid)
            assert fingerprint is not None and f" SHA256:{digest} " in fingerprint, fingerprint
        # the container has a name of its own, recorded, in the user's repository
        made = [json.loads(path.read_text()) for path in cluster.root.glob("state/slurm/*.json")]
        record = next(item for item in made if item["name"] == name)
        container = record["container"]
        assert container.startswith(f"{name}-") and record["container_made"], record
        repository = Path(cluster.shared, "udocker", "users", user, "containers")
        assert (repository / container).is_dir()
        # on the node, outside: the container's first process is the user's own
        box = (cluster.shared / "runs" / name / "container.pid").read_text().split()[0]
        assert Path(f"/proc/{box}").stat().st_uid == pwd.getpwnam(user).pw_uid
        # the daemon killed mid-booking, started again: it adopts, doubles nothing
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        process = daemon(config, log)
        polls_later(load_config(config), 2)
        assert [line.split()[0] for line in jobs_named(name)] == [job_id]
        assert name not in slurm("scontrol", "-o", "show", "reservation")
        # the warning reaches the session 30 s before the end
        with login(cluster, port) as client:
            message = wait_for(
                lambda: run(client, "cat /etc/gpuresa/session/message 2>/dev/null")[1],
                50,
                "warning",
            )
            assert "end" in message.lower(), message
        # at the end: the job ends, the output stays and is dated
        wait_for(lambda: jobs_named(name) == [], (end - datetime.now(UTC)).seconds + 20, "end")
        assert datetime.now(UTC) >= end - timedelta(seconds=1)
        wait_for(lambda: not (repository / container).exists(), 30, "the container's removal")
        outputs = list((cluster.shared / "output" / user).glob("*/result.txt"))
        assert [item.read_text() for item in outputs] == ["kept\n"]
        wait_for(lambda: state("slurm-b") == "ended", 20, "the journal's end")
        assert state("slurm-bad") == "failed"
        records = cluster.root / "state" / "outputs"
        assert records.is_dir() and any(records.rglob("*")), "no retention record"
        assert "the cluster has no node 'nowhere'" in log.read_text()
    finally:
        process.kill()
        process.wait(10)
