"""What Podman adds: a user namespace of its own for every session, checked on the real engines.

Docker's `userns-remap` maps root of every session onto the same host uid, so
the roots of two sessions can change each other's files wherever they meet;
on Podman each session has its own range of host ids, and cannot. The same
hostile steps run on both engines: the Docker run shows the test can fail.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import DockerHarness
from test_runtime import (  # noqa: F401  (the fixtures `built` and `site`)
    Site,
    _toml,
    built_fixture,
    ftp_login,
    host_uid,
    leftovers,
    make_site,
    run,
    running_output,
    site_fixture,
    ssh_login,
)

from gpuresa.backends.engines import Runtime, engines
from gpuresa.backends.engines.engines import (
    PODMAN_AUTO_USER,
    SESSION_ID_COUNT,
    Docker,
    Podman,
    mapped_range,
    subordinate_count,
)
from gpuresa.cli import main
from gpuresa.journal.store import Journal
from gpuresa.model import IdRange
from gpuresa.outputs.running_area import running_path
from gpuresa.sessions.errors import SessionError


def test_two_sessions_of_one_login_get_host_ids_of_their_own_on_podman(site: Site) -> None:
    runtime = site.runtime()
    # the same login twice: on Docker both would be one host uid
    first = runtime.start(site.spec(runtime, "alice"))
    second = runtime.start(site.spec(runtime, "alice"))
    uid = int(site.client.containers.get(first.containers[0]).labels["gpuresa.uid"])
    with ssh_login(first, "alice", site.key("alice")) as client:
        assert run(client, "echo mine > /output/result.txt; chmod 644 /output/result.txt")[0] == 0
    with ftp_login(second, second.ftp_user, second.ftp_password) as ftp:
        ftp.upload("upload.txt", b"uploaded\n")
    first_output, second_output = running_output(site, first), running_output(site, second)
    owner_first = (first_output / "result.txt").stat().st_uid
    owner_second = (second_output / "upload.txt").stat().st_uid
    assert owner_first == host_uid(site, first, uid)
    assert owner_second == host_uid(site, second, uid)

    # a file of the first session's ids where the second sees it (a hard link made by the
    # host's root, standing for any folder two sessions share; where each output is a
    # filesystem of its own no link can join them, and a copy keeps the owner): the
    # second session's root tries to change the file
    shared = second_output / "shared.txt"
    original = (first_output / "result.txt").stat()
    try:
        os.link(first_output / "result.txt", shared)
    except OSError as error:
        assert error.errno == errno.EXDEV, error
        shutil.copyfile(first_output / "result.txt", shared)
        os.chown(shared, original.st_uid, original.st_gid)
        os.chmod(shared, 0o644)
    with ssh_login(second, "alice", site.key("alice")) as client:
        code, output = run(client, "sudo -n sh -c 'echo changed >> /output/shared.txt' 2>&1")
        chown_code, _ = run(client, "sudo -n chown root /output/shared.txt 2>&1")
    if site.engine == "podman":
        assert first.id_range is not None and second.id_range is not None
        assert first.id_range != second.id_range
        ranges = sorted([first.id_range.uid, second.id_range.uid])
        assert ranges[1] - ranges[0] >= SESSION_ID_COUNT, "the ranges overlap"
        assert owner_first != owner_second
        # the file's owner is not mapped in the second session: its root is nobody there
        assert code != 0 and "Permission denied" in output, output
        assert chown_code != 0
        assert shared.read_text() == (first_output / "result.txt").read_text() == "mine\n"
    else:
        # userns-remap: one range for all, so the other session's root writes the file
        assert first.id_range == second.id_range and owner_first == owner_second
        assert code == 0 and chown_code == 0
        assert shared.read_text() == "mine\nchanged\n"


def test_podman_ranges_survive_a_restart_and_show_in_status(
    tmp_path: Path, podman_harness: DockerHarness, capsys: pytest.CaptureFixture[str]
) -> None:
    site = make_site(tmp_path, podman_harness.client, engine="podman")
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime))
    assert session.id_range is not None
    # a restarted daemon (a new runtime) reads the same range back from Podman
    (adopted,) = Runtime(site.config, site.client).list_sessions()
    assert adopted.id_range == session.id_range
    config = site.root / "config.toml"
    config.write_text(
        _toml(site).replace('gpu_mode = "none"', 'gpu_mode = "none"\nengine = "podman"')
    )
    Journal(site.root / "state" / "journal.sqlite").close()
    assert main(["status", "--config", str(config), "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)["sessions"]
    assert listed["host_ids"] == str(session.id_range)
    assert main(["status", "--config", str(config)]) == 0
    text = capsys.readouterr().out
    assert "(podman: ok)" in text and f"host ids {session.id_range}" in text


def test_a_container_podman_made_without_its_own_namespace_is_never_started(
    tmp_path: Path, podman_harness: DockerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a Podman that ignored UsernsMode (as its Docker API once ignored other fields)
    site = make_site(tmp_path, podman_harness.client, engine="podman")
    runtime = site.runtime()
    settings = runtime.kind.main_settings(site.config.limits)
    del settings["UsernsMode"]
    monkeypatch.setattr(runtime.kind, "main_settings", lambda limits: settings)
    spec = site.spec(runtime)
    with pytest.raises(SessionError, match="without a user namespace of its own"):
        runtime.start(spec)
    assert leftovers(site, spec.key) == []
    # nothing of the session's was given to any id: the folder stays root's
    folder = running_path(site.config, spec.key)
    assert folder.stat().st_uid == 0 and list(folder.iterdir()) == []


def test_booked_gpus_that_podman_would_not_pass_are_refused(
    tmp_path: Path, podman_harness: DockerHarness
) -> None:
    # Podman 4's Docker API drops device requests: a session would start without its GPU
    site = make_site(tmp_path, podman_harness.client, engine="podman", gpu_mode="cdi", gpus=[0, 1])
    runtime = site.runtime()
    spec = site.spec(runtime, gpus=(1,))
    with pytest.raises(SessionError, match="without the booked GPUs"):
        runtime.start(spec)
    assert leftovers(site, spec.key) == []


def test_the_engines_are_told_apart_and_podman_needs_its_own_ranges(
    tmp_path: Path, podman_harness: DockerHarness, docker_harness: DockerHarness
) -> None:
    podman_site = make_site(tmp_path / "p", podman_harness.client, engine="podman")
    podman_engine = podman_site.runtime().engine
    docker_engine = make_site(tmp_path / "d", docker_harness.client).runtime().engine
    Podman().check(podman_engine)  # rootful, with the `containers` range setup wrote
    Docker().check(docker_engine)
    with pytest.raises(SessionError, match='is Podman, not Docker; set engine = "podman"'):
        Docker().check(podman_engine)
    with pytest.raises(SessionError, match="is not Podman"):
        Podman().check(docker_engine)
    # no `containers` range, or too small a one: userns=auto cannot give a session its own
    subuid, subgid = tmp_path / "subuid", tmp_path / "subgid"
    subuid.write_text("dockremap:100000:65536\n")
    subgid.write_text(f"{PODMAN_AUTO_USER}:2000000:4194304\n")
    with pytest.raises(SessionError, match="subuid gives 'containers' 0 ids"):
        Podman((subuid, subgid)).check(podman_engine)
    subuid.write_text(f"{PODMAN_AUTO_USER}:2000000:1000\n")
    with pytest.raises(SessionError, match="1000 ids"):
        Podman((subuid, subgid)).check(podman_engine)


def test_a_rootless_podman_is_refused(
    tmp_path: Path, podman_harness: DockerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = make_site(tmp_path, podman_harness.client, engine="podman")
    runtime = site.runtime()
    real = runtime.engine.libpod

    def rootless(path: str, key: str | None = None) -> Any:
        answer = real(path, key)
        if path == "info":
            answer["host"]["security"]["rootless"] = True
        return answer

    monkeypatch.setattr(runtime.engine, "libpod", rootless)
    spec = site.spec(runtime)
    with pytest.raises(SessionError, match="runs rootless"):
        runtime.prepare(spec)
    assert leftovers(site, spec.key) == []
    assert list((site.root / "output").iterdir()) == []


def test_a_rootful_podman_is_asked_again_once_its_minute_is_over(
    tmp_path: Path, podman_harness: DockerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = make_site(tmp_path / "p", podman_harness.client, engine="podman")
    podman_engine = site.runtime().engine
    subuid, subgid = tmp_path / "subuid", tmp_path / "subgid"
    for path in (subuid, subgid):
        path.write_text(f"{PODMAN_AUTO_USER}:2000000:4194304\n")
    kind = Podman((subuid, subgid))
    real, asked, rootless = podman_engine.libpod, [], [False]

    def info(path: str, key: str | None = None) -> Any:
        answer = real(path, key)
        if path == "info":
            asked.append(path)
            answer["host"]["security"]["rootless"] = rootless[0]
        return answer

    monkeypatch.setattr(podman_engine, "libpod", info)
    kind.check(podman_engine)
    kind.check(podman_engine)
    assert asked == ["info"]
    # restarted rootless: trusted until its minute is over, refused at the next check after
    rootless[0] = True
    kind.check(podman_engine)
    later = SimpleNamespace(monotonic=lambda: time.monotonic() + engines.ENGINE_CHECKED_FOR + 1)
    monkeypatch.setattr(engines, "time", later)
    with pytest.raises(SessionError, match="runs rootless"):
        kind.check(podman_engine)
    with pytest.raises(SessionError, match="runs rootless"):
        kind.check(podman_engine)
    assert asked == ["info"] * 3


@pytest.mark.parametrize(
    ("mappings", "expected"),
    [
        (
            {"UidMap": ["0:2000000:65536"], "GidMap": ["0:2100000:65536"]},
            IdRange(2000000, 2100000, 65536),
        ),
        (None, None),  # no user namespace at all
        ({"UidMap": [], "GidMap": []}, None),
        ({"UidMap": ["0:0:65536"], "GidMap": ["0:0:65536"]}, None),  # root is root
        ({"UidMap": ["0:2000000:1024"], "GidMap": ["0:2000000:1024"]}, None),  # too small
        ({"UidMap": ["1:2000000:65536"], "GidMap": ["0:2000000:65536"]}, None),
        (
            {"UidMap": ["0:2000000:1000", "1000:3000000:64536"], "GidMap": ["0:2000000:65536"]},
            None,
        ),
    ],
)
def test_only_a_whole_range_of_its_own_counts_as_a_session_range(
    mappings: dict[str, list[str]] | None, expected: IdRange | None
) -> None:
    assert mapped_range(mappings) == expected


def test_subordinate_ranges_are_summed_per_user() -> None:
    text = "containers:2000000:65536\n# note\nalice:100000:65536\ncontainers:3000000:1000\n"
    assert subordinate_count(text, "containers") == 66536
    assert subordinate_count(text, "bob") == 0
