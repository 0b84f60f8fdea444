"""A session's user is root in it and may be hostile; the engine may hang. Neither stops gpuresa.

The user replaces the tools gpuresa could run in the session with scripts
that never return, leaves processes that ignore SIGTERM (one started with
sudo), or fork-bombs within the pids limit: messages, new end times and stops
still finish at once or within their grace. Real Docker, real sshd (paramiko).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import socket
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest
from conftest import BASE_IMAGE, RUN_ID, TEST_HOST, DockerHarness
from test_runtime import (  # the module's image fixture and site helpers
    Site,
    download,
    ftp_login,
    images,  # noqa: F401
    leftovers,
    make_site,
    port_free,
    run,
    ssh_login,
    without_user_namespaces,
)

from gpuresa.backends.engines.engine import Engine
from gpuresa.backends.engines.images import BUILT_FOR_LABEL, HASH_LABEL
from gpuresa.mail.notices import FTP_PASSWORD_PATH
from gpuresa.sessions.errors import (
    EngineTimeout,
    ImageMissing,
    PortRefused,
    RuntimeUnavailable,
    SessionError,
)
from gpuresa.sessions.labels import session_name

# tools gpuresa once ran in sessions (wall, pkill, pgrep, set-end.sh's tr) and tools
# a stop might be tempted to use; each becomes a script that never returns
REPLACED = ("wall", "pkill", "pgrep", "kill", "timeout", "sleep", "tr")
NEVER_RETURNS = "#!/bin/sh\nexec tail -f /dev/null\n"


@pytest.fixture
def site(tmp_path: Path, docker_harness: DockerHarness, images: None) -> Site:  # noqa: F811
    return make_site(tmp_path, docker_harness.client)


def as_root(site: Site, container: str, command: str) -> str:
    """Run `command` as root in the container, as the session's sudoer could."""
    result = site.client.containers.get(container).exec_run(["sh", "-c", command], user="root")
    output: str = result.output.decode(errors="replace")
    assert result.exit_code == 0, output
    return output


def replace_tools(site: Site, container: str) -> None:
    script = NEVER_RETURNS.replace("\n", "\\n")
    for tool in REPLACED:
        as_root(site, container, f"printf '{script}' > /usr/bin/{tool}; chmod 755 /usr/bin/{tool}")
    listing = as_root(site, container, "cat " + " ".join(f"/usr/bin/{tool}" for tool in REPLACED))
    assert listing.count("tail -f /dev/null") == len(REPLACED)


def within(seconds: float, call: Callable[[], object]) -> float:
    """Run `call` in a thread; fail when it has not returned within `seconds`. Returns the time."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            call()
        except BaseException as error:  # re-raised in the test's thread
            errors.append(error)

    started = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    elapsed = time.monotonic() - started
    if thread.is_alive():
        pytest.fail(f"{call} did not return within {seconds} s")
    if errors:
        raise errors[0]
    return elapsed


def host_pids(site: Site, container: str) -> set[int]:
    """The host pids of a container's processes (from its cgroup, as the host sees it)."""
    attributes = site.client.api.inspect_container(container)
    identifier = attributes["Id"]
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if identifier in (entry / "cgroup").read_text():
                    found.add(int(entry.name))
    return found


def still_running(pids: set[int], identifier: str) -> set[int]:
    alive = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            if identifier in Path(f"/proc/{pid}/cgroup").read_text():
                alive.add(pid)
    return alive


# --- messages, new end times and stops never wait on the session ----------------------------


def test_a_hostile_user_holds_up_neither_messages_nor_extends_nor_stops(site: Site) -> None:
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime))
    main = session.containers[0]
    with ssh_login(session, "alice", site.key("alice")) as client:
        run(client, "echo kept > /output/result.txt")
        # a job that saves its work when asked to stop
        run(
            client,
            'nohup sh -c \'trap "echo saved > /output/term.txt; exit 0" TERM; '
            "tail -f /dev/null & wait' >/dev/null 2>&1 &",
        )
        # a job that ignores SIGTERM, and one started as root through sudo
        run(client, "nohup sh -c 'trap \"\" TERM; exec tail -f /dev/null' >/dev/null 2>&1 &")
        run(
            client,
            "sudo -n nohup sh -c 'trap \"\" TERM; exec tail -f /dev/null' >/dev/null 2>&1 &",
        )
    replace_tools(site, main)
    identifier = site.client.containers.get(main).id
    before = host_pids(site, main)
    assert len(before) >= 5

    assert within(5, lambda: runtime.message(session.key, "ends in 5 minutes")) < 3
    later = (session.end + timedelta(hours=1)).replace(microsecond=0)
    assert within(5, lambda: runtime.extend(session.key, later)) < 3
    with ssh_login(session, "alice", site.key("alice")) as client:
        banner = client.get_transport().get_banner()  # type: ignore[union-attr]
        assert banner is not None and f"{later:%Y-%m-%d %H:%M}".encode() in banner
        assert "ends in 5 minutes" in run(client, "cat /etc/gpuresa/session/message")[1]
        # the session's files are read-only, even for root
        code, output = run(client, "sudo -n sh -c 'echo x > /etc/gpuresa/session/banner' 2>&1")
        assert code != 0 and "Read-only file system" in output

    elapsed = within(30, lambda: runtime.stop(session.key, timedelta(seconds=2)))
    assert elapsed < 2 + 8, f"stop took {elapsed:.1f} s"
    assert leftovers(site, session.key) == []
    assert still_running(before, identifier) == set()
    assert (session.output_dir / "result.txt").read_text() == "kept\n"
    # the job that handles SIGTERM got it, and had its time to save
    assert (session.output_dir / "term.txt").read_text() == "saved\n"
    assert not (site.root / "state" / "sessions").exists() or not list(
        (site.root / "state" / "sessions").iterdir()
    )


def test_a_fork_bomb_within_the_pids_limit_does_not_hold_up_a_stop(site: Site) -> None:
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime))
    main = session.containers[0]
    identifier = site.client.containers.get(main).id
    with ssh_login(session, "alice", site.key("alice")) as client:
        # children that ignore SIGTERM, forked until the pids limit refuses more
        run(
            client,
            "nohup sh -c 'trap \"\" TERM; while :; do (exec tail -f /dev/null) & done' "
            ">/dev/null 2>&1 &",
        )
    deadline = time.monotonic() + 20
    while len(host_pids(site, main)) < 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    before = host_pids(site, main)
    assert len(before) >= 200
    elapsed = within(40, lambda: runtime.stop(session.key, timedelta(seconds=2)))
    assert elapsed < 2 + 15, f"stop took {elapsed:.1f} s"
    assert leftovers(site, session.key) == []
    assert still_running(before, identifier) == set()


def test_kill_ends_a_session_at_once(site: Site) -> None:
    runtime = site.runtime()
    session = runtime.start(site.spec(runtime))
    with ssh_login(session, "alice", site.key("alice")) as client:
        run(client, "echo kept > /output/result.txt")
        run(client, "nohup sh -c 'trap \"\" TERM; exec tail -f /dev/null' >/dev/null 2>&1 &")
    assert within(20, lambda: runtime.kill(session.key)) < 10
    assert leftovers(site, session.key) == []
    assert (session.output_dir / "result.txt").read_text() == "kept\n"
    runtime.kill(session.key)  # idempotent


# --- the FTP sidecar is brought back alone ----------------------------------------------------


def test_a_removed_sidecar_is_made_again_and_the_users_container_keeps_running(
    site: Site,
) -> None:
    runtime = site.runtime()
    spec = site.spec(runtime)
    session = runtime.start(spec)
    main = site.client.containers.get(session.containers[0])
    with ssh_login(session, "alice", site.key("alice")) as client:
        run(client, "echo work > /output/work.txt")
        run(client, "nohup tail -f /dev/null >/dev/null 2>&1 & echo $! > /tmp/job.pid")
        job = run(client, "cat /tmp/job.pid")[1].strip()
    site.client.containers.get(session.containers[1]).remove(force=True)
    assert runtime.session(session.key).state == "stopped"  # type: ignore[union-attr]

    again = runtime.start(spec)
    assert again.state == "running"
    assert site.client.containers.get(again.containers[0]).id == main.id
    assert (again.ftp_port, again.ftp_passive_first) == (
        session.ftp_port,
        session.ftp_passive_first,
    )
    assert again.ftp_password and again.ftp_password != session.ftp_password
    with ssh_login(again, "alice", site.key("alice")) as client:
        assert run(client, f"kill -0 {job} && echo alive")[1].strip() == "alive"
        # the session shows the new password
        assert run(client, f"cat {FTP_PASSWORD_PATH}") == (0, again.ftp_password + "\n")
    with ftp_login(again, again.ftp_user, again.ftp_password) as ftp:
        assert download(ftp, "work.txt") == b"work\n"


# --- ports Docker refuses -------------------------------------------------------------------


@pytest.mark.parametrize("which", ["ssh", "ftp passive"])
def test_a_port_held_by_another_program_is_named(site: Site, which: str) -> None:
    runtime = site.runtime()
    spec = site.spec(runtime)
    port = spec.ssh_port if which == "ssh" else spec.ftp_passive_last
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        with pytest.raises(PortRefused, match="did not start") as caught:
            runtime.start(spec)
    assert caught.value.ports == (port,)
    assert leftovers(site, spec.key) == []
    for other in (spec.ssh_port, spec.ftp_port):
        assert port_free(other)


# --- user namespaces, every time --------------------------------------------------------------


def test_an_engine_restarted_without_user_namespaces_gets_no_new_session(
    site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = site.runtime()
    first = runtime.start(site.spec(runtime, "alice"))
    stripped = without_user_namespaces(runtime.engine.info())
    monkeypatch.setattr(runtime.engine, "info", lambda: stripped)
    second = site.spec(runtime, "bob")
    for make in (runtime.prepare, runtime.start):
        with pytest.raises(SessionError, match="without user namespaces"):
            make(second)
    assert leftovers(site, second.key) == []
    assert [session.key for session in runtime.list_sessions()] == [first.key]


# --- garbage ----------------------------------------------------------------------------------


@pytest.fixture
def own_prefix(site: Site, docker_harness: DockerHarness) -> Iterator[tuple[Site, str]]:
    """The site with an image prefix of this run's own; its images are removed afterwards."""
    prefix = f"gpuresa-test-{RUN_ID}"
    templates = dataclasses.replace(site.config.templates, image_prefix=prefix)
    config = dataclasses.replace(site.config, templates=templates)
    yield Site(site.root, config, site.client), prefix
    for image in docker_harness.client.images.list(filters={"label": f"{HASH_LABEL}"}):
        for tag in image.tags:
            if tag.startswith(f"{prefix}/"):
                with contextlib.suppress(docker.errors.APIError):
                    docker_harness.client.images.remove(tag, force=True)


def tiny_image(client: Any, tag: str, labels: dict[str, str]) -> str:
    """An image labelled like one gpuresa built, made in a second from the base image."""
    dockerfile = f"FROM {BASE_IMAGE}\n" + "".join(
        f'LABEL "{name}"="{value}"\n' for name, value in labels.items()
    )
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        data = dockerfile.encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    buffer.seek(0)
    image, _ = client.images.build(fileobj=buffer, custom_context=True, tag=tag, rm=True)
    return str(image.id)


def test_a_missing_image_is_named_and_never_built_under_a_start(
    site: Site, own_prefix: tuple[Site, str]
) -> None:
    prefixed, prefix = own_prefix
    runtime = prefixed.runtime()
    spec = site.spec(runtime)
    for make in (runtime.prepare, runtime.start):
        with pytest.raises(ImageMissing) as caught:
            make(spec)
        assert (caught.value.template, caught.value.cuda) == ("pytorch", "12.4")
        assert not caught.value.ftp_sidecar
    # the template's image arrives (here: the one the module built, under the new name)
    built = site.runtime().ensure_image("pytorch", None)
    current, _ = runtime.images.current_tags()
    (wanted,) = [tag for tag in current if tag.startswith(f"{prefix}/pytorch:12.4-")]
    repository, tag = wanted.rsplit(":", 1)
    site.client.images.get(built).tag(repository, tag)
    assert runtime.image_present("pytorch", None) and not runtime.ftp_image_present()
    with pytest.raises(ImageMissing) as caught:
        runtime.start(spec)
    assert caught.value.ftp_sidecar
    assert leftovers(site, spec.key) == []
    assert list((site.root / "output").iterdir()) == []


def test_leaked_networks_and_old_images_are_collected(
    site: Site, own_prefix: tuple[Site, str], docker_harness: DockerHarness
) -> None:
    client = site.client
    running = site.runtime().start(site.spec(site.runtime()))
    # garbage is collected by a runtime whose images have a prefix of this test's own
    prefixed, prefix = own_prefix
    runtime = prefixed.runtime()
    # networks made just before a crash: one whose session is still being made elsewhere
    labels = {"gpuresa.host": TEST_HOST, "gpuresa.role": "network"}
    for key in ("leaked", "busy"):
        client.networks.create(
            session_name(TEST_HOST, key), labels={**labels, "gpuresa.reservation": key}
        )
    # images: an old version, an old one a container uses, another host's, the current one
    current, _ = runtime.images.current_tags()
    (current_pytorch,) = [tag for tag in current if tag.startswith(f"{prefix}/pytorch:12.4-")]
    ours = {
        HASH_LABEL: "old",
        BUILT_FOR_LABEL: TEST_HOST,
        "gpuresa.template": "pytorch",
        "gpuresa.cuda": "12.4",
    }
    tiny_image(client, f"{prefix}/pytorch:old-1", ours)
    used = tiny_image(client, f"{prefix}/pytorch:old-2", {**ours, HASH_LABEL: "old2"})
    tiny_image(client, f"{prefix}/pytorch:old-3", {**ours, BUILT_FOR_LABEL: "elsewhere"})
    tiny_image(client, current_pytorch, {**ours, HASH_LABEL: "current"})
    docker_harness.run(used, ["true"])

    removed = runtime.collect_garbage({"busy"}, network_min_age=timedelta(0))
    assert sorted(removed) == sorted([session_name(TEST_HOST, "leaked"), f"{prefix}/pytorch:old-1"])
    names = {network.name for network in client.networks.list(filters={"label": "gpuresa.host"})}
    assert session_name(TEST_HOST, "busy") in names
    assert session_name(TEST_HOST, running.key) in names
    tags = {tag for image in client.images.list() for tag in image.tags}
    assert {f"{prefix}/pytorch:old-2", f"{prefix}/pytorch:old-3", current_pytorch} <= tags
    assert f"{prefix}/pytorch:old-1" not in tags
    # a young network is kept by default: its session may be being made right now
    client.networks.create(
        session_name(TEST_HOST, "young"), labels={**labels, "gpuresa.reservation": "young"}
    )
    assert runtime.collect_garbage(set()) == []
    assert site.runtime().session(running.key) is not None


# --- an engine that hangs, or is not there ----------------------------------------------------


@pytest.fixture
def silent_engine(tmp_path: Path) -> Iterator[str]:
    """A Unix socket that accepts connections and never answers; yields its path."""
    path = str(tmp_path / "silent.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(64)
    accepted: list[socket.socket] = []
    stopping = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                accepted.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield path
    stopping.set()
    thread.join()
    for connection in accepted:
        connection.close()
    server.close()


def test_an_engine_that_hangs_times_out_and_one_that_is_not_there_is_unavailable(
    silent_engine: str, tmp_path: Path
) -> None:
    # connecting (the SDK asks the engine's version first) times out
    engine = Engine(base_url=f"unix://{silent_engine}", timeout=2)
    started = time.monotonic()
    with pytest.raises(EngineTimeout):
        engine.info()
    assert 1.5 < time.monotonic() - started < 10
    # and so does any call on a client that is already made
    client = docker.DockerClient(base_url=f"unix://{silent_engine}", version="1.41", timeout=2)
    started = time.monotonic()
    with pytest.raises(EngineTimeout):
        Engine(client).containers({})
    assert time.monotonic() - started < 10
    assert isinstance(EngineTimeout("x"), SessionError)
    assert not isinstance(EngineTimeout("x"), RuntimeUnavailable)
    # no socket at all: unavailable, at once
    missing = Engine(base_url=f"unix://{tmp_path / 'none.sock'}", timeout=2)
    started = time.monotonic()
    with pytest.raises(RuntimeUnavailable):
        missing.info()
    assert time.monotonic() - started < 2
    assert os.path.exists(silent_engine)
