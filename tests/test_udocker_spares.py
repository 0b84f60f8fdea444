"""On udocker, a login's next session is made from a spare container, without unpacking.

Real host accounts, real udocker sessions entered over SSH (see test_udocker). The
time this saves is measured by benchmarks/bench_sessions.py --engine udocker.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.waiting import wait_for
from test_udocker import (  # noqa: F401  (the fixtures this module's tests take)
    Site,
    login_fixture,
    make_fixture,
    spec_of,
)

from gpuresa.backends.udocker import UdockerBackend, tools
from gpuresa.backends.udocker import spares as spares_module
from gpuresa.backends.udocker.spares import MAKING, spare_prefix, spares
from gpuresa.backends.udocker.tools import repository

pytestmark = pytest.mark.services
GRACE = timedelta(seconds=1)
# unpacking the stand-in image takes 10-20 s at idle priority on a loaded 2-core machine
UNPACKING = 240


def image_of(backend: UdockerBackend) -> str:
    found = backend.images.archive("pytorch", None)
    assert found is not None
    return found[1]


def container_folder(site: Site, name: str) -> Path:
    return (repository(site.config, site.login) / "containers" / name).resolve()


def login_processes(login: str) -> list[tuple[int, int, str]]:
    """The login's live processes: (pid, nice value, command line)."""
    listed = subprocess.run(
        ["ps", "-ww", "-o", "pid=,stat=,ni=,args=", "-U", login], capture_output=True, text=True
    ).stdout.splitlines()
    return [
        (int(line.split()[0]), int(line.split()[2]), line.split(None, 3)[3])
        for line in listed
        if line.split()[1][0] != "Z"
    ]


def test_the_next_session_takes_the_spare_made_as_the_login_at_idle_priority(
    make: Callable[..., Site],
) -> None:
    site = make(spares=True)
    backend = site.backend()
    uid = int(subprocess.run(["id", "-u", site.login], capture_output=True,
                             text=True, check=True).stdout)  # fmt: skip
    first = backend.start(spec_of(site, backend))
    image = image_of(backend)
    # the spare is made once the session is up, by the login, at the lowest priorities, in
    # the session's cgroup (its limits; it ends with the session)
    maker = wait_for(
        lambda: [pid for pid, nice, args in login_processes(site.login)
                 if args.split()[1:3] == ["-s", str(tools.SCRIPTS / "spare.py")] and nice == 19],
        10,
        "the login's spare maker at nice 19",
    )  # fmt: skip
    assert set(maker) <= set(backend.cgroup(first.key).members())
    made = wait_for(lambda: spares(site.config, site.login, image), UNPACKING, "a spare")
    assert len(made) == 1 and made[0].startswith(spare_prefix(image))
    spare = container_folder(site, made[0])
    assert spare.stat().st_uid == uid and (spare / "ROOT" / "usr").is_dir()
    backend.stop(first.key, GRACE)

    second = backend.start(spec_of(site, backend))
    record = backend.records.read(second.key)
    assert record is not None
    # the second session's container is the spare itself, renamed: nothing was unpacked
    assert container_folder(site, record.container) == spare
    assert spares(site.config, site.login, image) == []
    code, text = site.run(second, "id -un; cat /data/dataset.csv")
    assert code == 0 and text.split()[0] == site.login and "x,y" in text, text
    # and a new one follows it, for the session after
    again = wait_for(lambda: spares(site.config, site.login, image), UNPACKING, "the next spare")
    assert container_folder(site, again[0]) != spare
    backend.stop(second.key, GRACE)
    # made whole, and nothing of the makers runs on
    wait_for(
        lambda: not any("spare.py" in args for _, _, args in login_processes(site.login)),
        30,
        "the makers' end",
    )
    names = os.listdir(repository(site.config, site.login) / "containers")
    assert not [name for name in names if name.startswith(MAKING)], names


def test_a_spare_the_login_broke_or_faked_is_passed_over(make: Callable[..., Site]) -> None:
    site = make(spares=True)
    backend = site.backend()
    spec = spec_of(site, backend)
    image = image_of(backend)
    backend.images.load(spec.key, backend.account(spec), "pytorch", None)
    containers = repository(site.config, site.login) / "containers"
    prefix = spare_prefix(image)
    # the login's own doing, in their repository: a name pointing nowhere, a folder that is
    # no container (one not even named as a spare), and a half-made container a killed
    # maker left
    subprocess.run(
        ["runuser", "-u", site.login, "--", "sh", "-c",
         f"mkdir -p {containers} && cd {containers} && ln -s no-such-container {prefix}00000000"
         f" && mkdir {prefix}11111111 {prefix}folder {MAKING}half"],
        check=True,
    )  # fmt: skip
    session = backend.start(spec)
    code, text = site.run(session, "test -d /usr/bin && echo whole")
    assert code == 0 and "whole" in text, text
    record = backend.records.read(spec.key)
    assert record is not None
    # made by unpacking, since neither fake could be taken
    assert container_folder(site, record.container).parent == containers.resolve()
    # the maker removes the half-made one and makes a real spare beside the fakes
    made = wait_for(
        lambda: [
            name
            for name in spares(site.config, site.login, image)
            if (containers / name / "ROOT" / "usr").is_dir()
        ],
        UNPACKING,
        "a real spare",
    )
    assert len(made) == 1
    assert not (containers / f"{MAKING}half").exists()
    backend.stop(spec.key, GRACE)


def test_the_maker_ends_with_its_session(make: Callable[..., Site]) -> None:
    site = make(spares=True)
    backend = site.backend()
    session = backend.start(spec_of(site, backend))
    wait_for(
        lambda: [args for _, _, args in login_processes(site.login) if "spare.py" in args],
        10,
        "the login's spare maker",
    )
    backend.stop(session.key, GRACE)
    # nothing of the login's runs after the end but the removal of the container's files:
    # the maker was in the session's cgroup
    wait_for(
        lambda: not [a for _, _, a in login_processes(site.login) if " rm -f gpuresa-" not in a],
        15,
        "no process of the login",
    )


@pytest.mark.parametrize(
    ("free", "needed", "room"),
    [(50, 39, True), (50, 41, False), (10, 0, True), (9, 0, False)],
)
def test_a_spare_leaves_a_tenth_of_its_disk_free(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, free: int, needed: int, room: bool
) -> None:
    disk = SimpleNamespace(f_bavail=free, f_frsize=1, f_blocks=100)
    monkeypatch.setattr(os, "statvfs", lambda _: disk)
    assert spares_module.room_for(tmp_path, needed) is room
