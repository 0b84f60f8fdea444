"""What a backend can do (`gpuresa.config.capabilities`), and the one session record.

Pure: configs parsed in memory, specs and sessions built as values, the source
of gpuresa read as text. The backends' own declarations are checked against
their hosts' entries on real backends in `test_backend_contract.py`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import get_args, get_type_hints

import pytest
from support.configs import config_of

import gpuresa
from gpuresa.config.capabilities import Capabilities, host_capabilities
from gpuresa.config.sections import HostConfig
from gpuresa.daemon import session_record
from gpuresa.daemon.records import session_from_record
from gpuresa.mail.notices import start_message
from gpuresa.model import Session, SessionSpec
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.files import SessionFacts, motd_text
from gpuresa.sessions.specs import check_spec

T0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)


def spec(gpu_count: int = 2, gpu_indices: tuple[int, ...] = (0, 1)) -> SessionSpec:
    return SessionSpec(
        key="booking-1", user="alice", host="gpu1", template="pytorch", cuda=None,
        gpu_count=gpu_count, gpu_indices=gpu_indices, start=T0, end=T0 + timedelta(hours=2),
        ssh_port=20001, ftp_port=21001, ftp_passive_first=30000, ftp_passive_last=30009,
        email="alice@lab.example",
    )  # fmt: skip


def host_of(engine: str) -> HostConfig:
    host = {"name": "gpu1", "gpus": [0, 1], "engine": engine, "gpu_mode": "devices"}
    return config_of({"hosts": [host]}).host()


def test_every_engine_a_host_may_name_has_its_capabilities() -> None:
    engines = get_args(get_type_hints(HostConfig)["engine"])
    assert set(engines) == {"docker", "podman", "udocker", "slurm"}
    for engine in engines:
        assert isinstance(host_capabilities(host_of(engine)), Capabilities)
    # a daemon whose host is not configured opens a Docker engine's backend: the same here
    assert host_capabilities(None) == host_capabilities(host_of("docker"))


@pytest.mark.parametrize(
    ("engine", "places", "serves", "sidecar", "own_key", "as_login", "remote"),
    [
        ("docker", False, False, True, False, False, False),
        ("podman", False, False, True, False, False, False),
        # root binds a udocker session's port: its sshd runs as the login, not its port
        ("udocker", False, True, False, True, False, False),
        ("slurm", True, True, False, True, True, True),
    ],
)
def test_each_backend_can_do_what_its_sessions_need(
    engine: str,
    places: bool,
    serves: bool,
    sidecar: bool,
    own_key: bool,
    as_login: bool,
    remote: bool,
) -> None:
    capabilities = host_capabilities(host_of(engine))
    assert capabilities.places_gpus is places
    assert capabilities.serves_outputs is serves
    assert capabilities.ftp_sidecar is sidecar
    assert capabilities.own_host_key is own_key
    assert capabilities.ssh_as_login is as_login
    assert capabilities.remote_nodes is remote
    assert capabilities.isolation.startswith(engine)
    # a frozen value: nobody changes what a backend can do on the way
    with pytest.raises(dataclasses.FrozenInstanceError):
        capabilities.places_gpus = not places  # type: ignore[misc]


# a comparison of an engine's name: `engine == "slurm"`, `.engine in (...)`, `"udocker" != ...`
ENGINE_TEST = re.compile(
    r"\bengine\s*(==|!=|\bin\b|\bnot in\b)"
    r"|(==|!=)\s*\"(docker|podman|udocker|slurm)\""
    r"|\"(docker|podman|udocker|slurm)\"\s*(==|!=|\bin\b)"
)
# where an engine's name may be asked: the backends
# and the config's checks of which options an engine accepts
NAMES_ALLOWED = ("backends", "config")


def test_no_code_outside_the_backends_asks_which_engine_it_talks_to() -> None:
    package = Path(gpuresa.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] in NAMES_ALLOWED:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if ENGINE_TEST.search(code):
                found.append(f"{path.relative_to(package)}:{number}: {line.strip()}")
    assert not found, "ask a capability (backends.capabilities) instead:\n" + "\n".join(found)


def test_the_name_test_would_see_the_comparisons_it_forbids() -> None:
    for line in (
        'if config.host().engine == "slurm":',
        'return host.engine in ("udocker", "slurm")',
        'if "udocker" == engine:',
        'if report["engine"] == "slurm"',
    ):
        assert ENGINE_TEST.search(line), line
    assert not ENGINE_TEST.search('"engine": host.engine if host else "docker",')


def test_an_engine_host_refuses_a_spec_whose_count_is_not_its_devices() -> None:
    config = config_of(
        {"hosts": [{"name": "gpu1", "gpus": [0, 1, 2, 3], "ssh_ports": "20000-20009",
                    "ftp_ports": "21000-21009", "ftp_passive_ports": "30000-30099"}]}
    )  # fmt: skip
    check_spec(config, spec(), (0, 1, 2, 3))
    # a count with no device (a cluster's kind of spec): the engine would grant none
    with pytest.raises(SessionError, match="2 GPU"):
        check_spec(config, spec(2, ()), (0, 1, 2, 3))
    # more devices than the count that was booked and counted against the host
    with pytest.raises(SessionError, match="1 GPU"):
        check_spec(config, spec(1, (0, 1)), (0, 1, 2, 3))


def test_a_session_is_its_spec_and_its_state() -> None:
    made = spec()
    session = Session.of(
        made, state="running", output_dir=Path("/out/booking-1"), ftp_password="secret"
    )
    assert session.spec == made and type(session.spec) is SessionSpec
    assert (session.key, session.gpu_count, session.gpu_indices) == ("booking-1", 2, (0, 1))
    # a session goes where a spec does, and is never mistaken for the spec itself
    assert isinstance(session, SessionSpec) and session != made
    # what the backend shows is the session's alone: made again, it is not carried over
    again = Session.of(session, state="stopped", output_dir=session.output_dir)
    assert again.ftp_password == "" and again.spec == made
    assert "secret" not in repr(session)


def test_a_stop_record_keeps_the_count_and_the_devices_apart() -> None:
    scheduled = Session.of(
        dataclasses.replace(spec(3, ()), place="node07"),
        state="running",
        output_dir=Path("/out/booking-1"),
    )
    read, reason = session_from_record(session_record(scheduled, "ended"))
    assert (read.gpu_count, read.gpu_indices, read.place, reason) == (3, (), "node07", "ended")


def test_a_stop_record_of_the_earlier_format_reads_back() -> None:
    record = json.loads(
        session_record(Session.of(spec(), state="running", output_dir=Path("/o")), "x")
    )
    # a record a daemon of the earlier format wrote: "gpus" were the indices
    record["gpus"] = record.pop("gpu_indices")
    del record["gpu_count"]
    read, _ = session_from_record(json.dumps(record))
    assert (read.gpu_count, read.gpu_indices) == (2, (0, 1))


def test_a_scheduled_sessions_user_is_told_a_count_and_no_made_up_device() -> None:
    scheduled = Session.of(spec(2, ()), state="running", output_dir=Path("/out/booking-1"))
    _, body = start_message(scheduled, "node07", "UTC", ftps=False)
    assert "GPUs:      2 GPUs on its node" in body and "0, 1" not in body
    _, body = start_message(
        Session.of(spec(), state="running", output_dir=Path("/o")), "gpu1", "UTC"
    )
    assert "GPUs:      0, 1 (2 GPUs)" in body
    facts = SessionFacts("alice", "pytorch", None, 2, (), T0, Path("/output"))
    assert "GPUs: 2 on this node" in motd_text(facts, "UTC")
    assert "GPUs: none" in motd_text(dataclasses.replace(facts, gpu_count=0), "UTC")
