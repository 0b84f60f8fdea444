"""Host users against the Slurm backend: jobs named like a session's, squatted ports.

A session's reservation name is shown to every host user, and a job may be
given any name: another user's job of that name, running or held, is
reported and left alone, never adopted nor cancelled, and the session
still runs its own job, whose sshd the user reaches. A daemon killed right
after a submission adopts its own held job, found by a token nobody else
knew, and no one's copy of it. A host user holding the session's port with
an SSH server of their own is never taken for the session.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import subprocess
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import wait_for_port
from slurm_site import NODE, SlurmSite, slurm_site
from support.waiting import wait_for
from test_runtime import run, ssh_login

from gpuresa.backends.slurm import slurm_name
from gpuresa.backends.slurm.jobs import submission_comment
from gpuresa.backends.slurm.records import Record, Records
from gpuresa.sessions.errors import SessionError

# real host accounts, real Slurm jobs: not for the fast lane
pytestmark = pytest.mark.services


@pytest.fixture(name="cluster")
def cluster_fixture(tmp_path: Path) -> Iterator[SlurmSite]:
    with slurm_site(tmp_path) as site:
        yield site


def impostor(user: str, name: str, *options: str) -> str:
    """A job of `user` named `name` on the node (what `sbatch -J` lets anyone do)."""
    done = subprocess.run(
        ["runuser", "-u", user, "--", "sbatch", "--parsable", f"--job-name={name}",
         f"--nodelist={NODE}", "--time=30", "--output=/dev/null", *options,
         "--wrap", "sleep 600"],
        capture_output=True, text=True, check=True, cwd="/",
    )  # fmt: skip
    return done.stdout.strip().split(";")[0]


def job_line(job: str) -> str:
    """`squeue`'s user, state and name of job `job` ("" once it is gone)."""
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%u %T %j"], capture_output=True,
                          text=True, check=False).stdout.strip()  # fmt: skip


def jobs_named(name: str) -> list[str]:
    return subprocess.run(["squeue", "-h", "-n", name, "-o", "%i %u %T"], capture_output=True,
                          text=True, check=True).stdout.splitlines()  # fmt: skip


def presented_digest(client: object) -> str:
    key = client.get_transport().get_remote_server_key().asbytes()  # type: ignore[attr-defined]
    return base64.b64encode(hashlib.sha256(key).digest()).decode().rstrip("=")


@pytest.mark.parametrize("hold", [False, True], ids=["plain", "held"])
def test_a_strangers_job_named_like_the_session_is_never_taken_for_it(
    cluster: SlurmSite, hold: bool, caplog: pytest.LogCaptureFixture
) -> None:
    victim, attacker = cluster.users
    backend = cluster.backend()
    spec = cluster.spec(victim)
    name = slurm_name("cluster", spec.key)
    backend.prepare(spec)
    # the name is in `scontrol show res` for everyone: the attacker submits a job of it
    strange = impostor(attacker, name, *(["--hold"] if hold else []))
    with caplog.at_level(logging.WARNING, logger="gpuresa.backends.slurm.jobs"):
        listed = {item.key: item for item in cluster.backend().list_sessions()}
        again = {item.key: item for item in backend.list_sessions()}
        backend.list_sessions()
    assert listed[spec.key].state == again[spec.key].state == "created"
    assert not any(item.startswith("job ") for item in listed[spec.key].containers)
    reports = [record.getMessage() for record in caplog.records if strange in record.getMessage()]
    # reported once per backend object (the second listing of `backend` says nothing new)
    assert len(reports) == 2 and f"of {attacker} is named like" in reports[0], reports
    started = backend.start(spec)
    assert started.state == "running"
    own = next(item.split()[1] for item in started.containers if item.startswith("job "))
    assert own != strange and job_line(own).split()[:2] == [victim, "RUNNING"]
    # the victim reaches the sshd of gpuresa's job, with the key the notice names
    with ssh_login(started, victim, cluster.key(victim)) as client:
        code, output = run(client, "id -un; echo $SLURM_JOB_ID")
        assert code == 0 and output.split() == [victim, own], output
        assert f" SHA256:{presented_digest(client)} " in started.host_key
    backend.stop(spec.key, timedelta(0))
    # the stranger's job is left as it was: never cancelled (the site's cleanup ends it)
    assert job_line(strange).split()[:1] == [attacker], job_line(strange)
    assert job_line(own) == ""


@pytest.mark.parametrize("then", ["start", "stop"])
def test_a_submission_cut_off_before_its_record_is_adopted_once(
    cluster: SlurmSite, then: str
) -> None:
    victim, attacker = cluster.users
    spec = cluster.spec(victim)
    name = slurm_name("cluster", spec.key)
    records = Records(cluster.config.daemon.state_dir / "slurm")
    kept: list[Record] = []

    class CutOff(Exception):
        """The daemon dies here."""

    class DyingRecords(Records):
        # writes nothing once the job's id is known: a daemon killed right after sbatch
        def put(self, record: Record) -> None:
            if record.job is not None:
                raise CutOff
            kept.append(record)
            super().put(record)

    dying = cluster.backend()
    dying.records = dying.jobs.records = DyingRecords(records.root)
    with pytest.raises(CutOff):
        dying.start(spec)
    record = records.get(spec.key)
    assert record is not None and record.job is None and record.submission
    [held] = jobs_named(name)
    first = held.split()[0]
    assert held.split()[1:] == [victim, "PENDING"], held
    # an attacker who read the job's comment makes a held copy with it: not the session's
    copy = impostor(attacker, name, "--hold", f"--comment={submission_comment(record.submission)}")
    if then == "stop":
        # the booking cancelled before a new start: the held job goes with the session
        cluster.backend().stop(spec.key, timedelta(0))
        wait_for(lambda: job_line(first) == "", 30, "the held job's end")
        assert job_line(copy).split()[:2] == [attacker, "PENDING"]
        return
    started = cluster.backend().start(spec)
    assert any(item == f"job {first}" for item in started.containers), started.containers
    assert job_line(first).split()[:2] == [victim, "RUNNING"]
    assert job_line(copy).split()[:2] == [attacker, "PENDING"]
    assert sorted(line.split()[0] for line in jobs_named(name)) == sorted([first, copy])
    cluster.backend().stop(spec.key, timedelta(0))


def test_a_port_held_by_another_ssh_server_is_not_taken_for_the_session(
    cluster: SlurmSite,
) -> None:
    victim, attacker = cluster.users
    spec = cluster.spec(victim)
    folder = Path(f"/home/{attacker}")
    # the attacker's own sshd, with a key of theirs, on the session's port (an
    # unprivileged port: a job's sshd runs as its login, so the port is too)
    subprocess.run(["runuser", "-u", attacker, "--", "ssh-keygen", "-q", "-t", "ed25519", "-N",
                    "", "-f", str(folder / "squat_key")], check=True)  # fmt: skip
    (folder / "squat_config").write_text(
        f"Port {spec.ssh_port}\nListenAddress 127.0.0.1\nHostKey {folder / 'squat_key'}\n"
        "UsePAM no\nPidFile none\nStrictModes no\n"
    )
    squatter = subprocess.Popen(
        ["runuser", "-u", attacker, "--", "/usr/sbin/sshd", "-D", "-e", "-f",
         str(folder / "squat_config")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_port(spec.ssh_port, 15, "the squatter's sshd", squatter)
        backend = cluster.backend()
        with pytest.raises(SessionError, match=f"port {spec.ssh_port} .* held by another SSH"):
            backend.start(spec)
        # the job that could not serve is gone; the session is not running
        name = slurm_name("cluster", spec.key)
        wait_for(lambda: jobs_named(name) == [], 30, "the cancelled job to go")
        listed = {item.key: item.state for item in backend.list_sessions()}
        assert listed.get(spec.key) != "running"
        backend.stop(spec.key, timedelta(0))
    finally:
        squatter.kill()
        squatter.wait(10)
