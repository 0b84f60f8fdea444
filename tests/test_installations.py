"""Two installations on one engine under one host name: each acts only on what it made.

A test instance beside the real daemon, or two admins who both kept the
example's host name, share the engine and the `gpuresa.host` label. Each
installation labels its objects with a digest of an id made once in its
state_dir (`runtime.identity`); what another installation made is listed as
its, never stopped, collected or adopted. Run on Docker and on Podman.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import docker.types
import pytest
from conftest import BASE_IMAGE, TEST_HOST
from test_runtime import (  # noqa: F401  (the fixtures `built` and `site`)
    Site,
    built_fixture,
    leftovers,
    make_site,
    run,
    site_fixture,
    ssh_login,
)

from gpuresa.backends.engines import Runtime
from gpuresa.backends.engines.identity import ID_FILE, installation_label
from gpuresa.model import SessionSpec
from gpuresa.planning.facts import Inventory, Memory
from gpuresa.planning.planner import plan
from gpuresa.sessions.errors import SessionError
from gpuresa.sessions.labels import MAIN_ROLE, ROLE_LABEL, safe_key, session_labels


def neighbour(site: Site) -> Site:
    """A second installation beside `site`: same engine, same host name, its own state_dir."""
    return make_site(site.root / "neighbour", site.client, engine=site.engine)


def test_neither_installation_stops_the_others_session(
    site: Site, caplog: pytest.LogCaptureFixture
) -> None:
    mine, theirs = site.runtime(), neighbour(site).runtime()
    session = mine.start(site.spec(mine))
    assert theirs.list_sessions() == []
    caplog.set_level(logging.WARNING, logger="gpuresa.backends.engines.host_sessions")
    (shown,) = theirs.foreign_sessions()
    assert (shown.key, shown.state) == (session.key, "running")
    # its planner sees no session of its own: no orphan to stop, with every grace long over
    later = datetime.now(UTC) + timedelta(days=1)
    inventory = Inventory(theirs.host, theirs.host_gpus())
    assert plan([], theirs.list_sessions(), inventory, later, theirs.config, Memory()) == []
    # told once, however often it looks
    theirs.list_sessions()
    told = [record for record in caplog.records if "another installation's" in record.message]
    assert len(told) == 1 and session.key in told[0].message

    # the neighbour's stop, kill, reset and clean-up, even by key, touch nothing of it
    theirs.stop(session.key, timedelta(0))
    theirs.kill(session.key)
    theirs.reset(session.key)
    assert theirs.collect_garbage(set(), network_min_age=timedelta(0)) == []
    assert mine.session(session.key) == session
    with ssh_login(session, "alice", site.key("alice")) as client:
        assert run(client, "true")[0] == 0

    # the same booking asked of the neighbour: refused, and the session stays whole
    spec = neighbour_spec(theirs, session.key)
    with pytest.raises(SessionError):
        theirs.start(spec, ready_timeout=10)
    assert mine.session(session.key) == session
    assert sorted(leftovers(site, session.key)) == sorted([*session.containers, network(site)])

    # and its owner still ends it
    mine.stop(session.key, timedelta(0))
    assert leftovers(site, session.key) == []


def network(site: Site) -> str:
    (only,) = [
        item.name
        for item in site.client.networks.list(filters={"label": f"gpuresa.host={TEST_HOST}"})
    ]
    return str(only)


def neighbour_spec(runtime: Runtime, key: str) -> SessionSpec:
    return runtime.new_spec("alice", "pytorch", datetime.now(UTC) + timedelta(hours=1), key=key)


def legacy_container(site: Site, key: str, *, mount: Path | None) -> Any:
    """A main container as gpuresa made them before the installation label: not started."""
    spec = SessionSpec(
        key=key,
        user="alice",
        host=TEST_HOST,
        template="pytorch",
        cuda=None,
        gpu_count=0,
        gpu_indices=(),
        start=datetime.now(UTC),
        end=datetime.now(UTC) + timedelta(hours=1),
        ssh_port=1,
        ftp_port=2,
        ftp_passive_first=3,
        ftp_passive_last=4,
    )
    labels = {**session_labels(spec, 2000, site.root / "output", "ftp"), ROLE_LABEL: MAIN_ROLE}
    mounts = [docker.types.Mount("/etc/gpuresa/session", str(mount), type="bind")] if mount else []
    return site.client.containers.create(BASE_IMAGE, ["sleep", "300"], labels=labels, mounts=mounts)


def test_unlabelled_sessions_are_adopted_only_by_the_installation_that_made_them(
    site: Site,
) -> None:
    mine, theirs = site.runtime(), neighbour(site).runtime()
    # made before the label existed: its session folder is here, and its container mounts it
    folder = site.config.daemon.state_dir / "sessions" / safe_key("old-booking")
    folder.mkdir(parents=True)
    legacy_container(site, "old-booking", mount=folder)
    # unlabelled too, but it mounts no folder of this installation: not adopted
    foreign_folder = site.root / "elsewhere" / safe_key("their-booking")
    foreign_folder.mkdir(parents=True)
    (site.config.daemon.state_dir / "sessions" / safe_key("their-booking")).mkdir()
    legacy_container(site, "their-booking", mount=foreign_folder)

    assert [session.key for session in mine.list_sessions()] == ["old-booking"]
    assert sorted(session.key for session in mine.foreign_sessions()) == ["their-booking"]
    assert theirs.list_sessions() == []
    # the neighbour leaves it, its maker stops it
    theirs.kill("old-booking")
    mine.kill("their-booking")
    assert len(leftovers(site, "old-booking")) == 1
    assert len(leftovers(site, "their-booking")) == 1
    mine.kill("old-booking")
    assert leftovers(site, "old-booking") == []


def test_the_installation_id_is_made_once_and_kept(tmp_path: Path) -> None:
    state = tmp_path / "state"
    labels: list[str] = []
    # several processes' first starts at once agree on one id
    threads = [
        threading.Thread(target=lambda: labels.append(installation_label(state))) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(labels)) == 1 and len(labels[0]) == 24
    assert installation_label(state) == labels[0]
    assert stat.S_IMODE((state / ID_FILE).stat().st_mode) == 0o600
    assert [path.name for path in state.iterdir()] == [ID_FILE]
    # another state_dir is another installation
    assert installation_label(tmp_path / "other") != labels[0]


def test_an_id_that_others_could_write_or_that_is_damaged_is_refused(tmp_path: Path) -> None:
    installation_label(tmp_path)
    path = tmp_path / ID_FILE
    path.chmod(0o622)
    with pytest.raises(SessionError, match="writable by it alone"):
        installation_label(tmp_path)
    path.chmod(0o600)
    path.write_text("gpu1\n")
    with pytest.raises(SessionError, match="does not hold an installation id"):
        installation_label(tmp_path)
    path.unlink()
    # a link planted in its place is not followed
    target = tmp_path / "planted"
    target.write_text("0" * 64 + "\n")
    os.symlink(target, path)
    with pytest.raises(SessionError, match="cannot read"):
        installation_label(tmp_path)
