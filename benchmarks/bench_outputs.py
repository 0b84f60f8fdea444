"""Outputs after the session: how soon, and how fast, users get them over SFTP.

Two measures on the real Docker engine, printed as a table:

1. the gap between `Runtime.stop` returning (the session is gone) and the
   user's first successful SFTP read of a file written in the session, from
   the output service already running (target: no gap: the first try works);
   also how long the stop's hand-over of the output took;
2. download throughput of a 1 GiB file from the output service (paramiko's
   SFTP client and OpenSSH's `sftp`), next to `scp` from this host to itself
   (localhost, OpenSSH) as the floor of what SSH transport costs here.

Run as root next to a Docker engine with userns-remap: `make bench`, or
`.venv/bin/python benchmarks/bench_outputs.py [--size-mib 1024]`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import docker
import paramiko

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest import BASE_IMAGE, RUN_ID, RUN_LABEL, DockerHarness
from test_runtime import free_block, make_site, run, ssh_login

from gpuresa.backends.engines.host_holds import release
from gpuresa.backends.engines.output_service import OutputService


def sftp_client(port: int, key: paramiko.PKey) -> tuple[paramiko.SSHClient, paramiko.SFTPClient]:
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    client.connect(
        "127.0.0.1", port, username="alice", pkey=key, look_for_keys=False,
        allow_agent=False, timeout=10,
    )  # fmt: skip
    return client, client.open_sftp()


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, timeout=900)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="size of the big file")
    arguments = parser.parse_args()
    size = arguments.size_mib * 1024 * 1024
    client = docker.from_env(timeout=120)
    harness = DockerHarness(client)
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="bench-outputs-") as folder:
        root = Path(folder)
        site = make_site(root, client)
        site.config = dataclasses.replace(
            site.config,
            storage=dataclasses.replace(site.config.storage, sftp_port=free_block(1)),
        )
        try:
            runtime = site.runtime()
            service = OutputService(site.config, runtime)
            service.ensure_image()
            runtime.ensure_image("pytorch", None)
            runtime.ensure_ftp_image()
            session = runtime.start(site.spec(runtime, "alice"))
            with ssh_login(session, "alice", site.key("alice")) as ssh:
                run(ssh, "echo done > /output/result.txt")
                code, output = run(ssh, f"head -c {size} /dev/urandom > /output/big.bin")
                assert code == 0, output
            service.ensure_running()
            port = site.config.storage.sftp_port
            key = site.key("alice")

            started = time.perf_counter()
            runtime.stop(session.key, timedelta(seconds=1))
            stopped = time.perf_counter()
            tries = 0
            while True:
                tries += 1
                try:
                    ssh_client, sftp = sftp_client(port, key)
                    with sftp.open(f"{session.output_dir.name}/result.txt") as stream:
                        assert stream.read() == b"done\n"
                    break
                except (OSError, paramiko.SSHException):
                    time.sleep(0.01)
            readable = time.perf_counter()
            rows.append(("stop() incl. hand-over of the output", f"{stopped - started:.3f} s"))
            rows.append(("gap: stop() returned -> first SFTP read", f"{readable - stopped:.3f} s"))
            rows.append(("SFTP tries until the first read", str(tries)))

            target = root / "download.bin"
            with contextlib.closing(ssh_client), contextlib.closing(sftp):
                begun = time.perf_counter()
                sftp.get(f"{session.output_dir.name}/big.bin", str(target))
                seconds = time.perf_counter() - begun
            rows.append(
                ("paramiko SFTP from the output service", f"{size / seconds / 1e6:.0f} MB/s")
            )
            target.unlink()

            identity = root / "private" / "alice"
            options = [
                "-i", str(identity), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
                "-o", "StrictHostKeyChecking=no", "-o", f"UserKnownHostsFile={root / 'kh'}",
            ]  # fmt: skip
            seconds = timed(
                ["sftp", "-q", "-P", str(port), *options,
                 f"alice@127.0.0.1:{session.output_dir.name}/big.bin", str(target)]
            )  # fmt: skip
            rows.append(
                ("OpenSSH sftp from the output service", f"{size / seconds / 1e6:.0f} MB/s")
            )
            target.unlink()

            # the floor: scp from this host to itself
            seconds = scp_localhost(root, client, session.output_dir / "big.bin", target)
            rows.append(("scp host -> host (localhost floor)", f"{size / seconds / 1e6:.0f} MB/s"))
        finally:
            harness.remove_all()
            # the output root's running area and any image: its folder is removed next
            release(site.config, (), everything=True)
    width = max(len(name) for name, _ in rows)
    print(f"{'measure':<{width}}  value   ({arguments.size_mib} MiB file)")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def scp_localhost(root: Path, client: docker.DockerClient, source: Path, target: Path) -> float:
    """Seconds `scp` takes to copy `source` to `target` over SSH to 127.0.0.1.

    The sshd is the host's own OpenSSH (the base image's binary, in the host's
    network and user namespaces, reading the file straight from the host), so
    the floor is what OpenSSH costs on this machine's loopback.
    """
    port = free_block(1)
    for name in ("bench_host_key", "bench_client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / name)])
    (root / "bench_authorized_keys").write_text((root / "bench_client_key.pub").read_text())
    command = (
        f"mkdir -p /run/sshd && exec /usr/sbin/sshd -D -e -p {port} -h /bench/bench_host_key"
        " -o AuthorizedKeysFile=/bench/bench_authorized_keys -o StrictModes=no"
        " -o PermitRootLogin=prohibit-password -o ListenAddress=127.0.0.1 -o PidFile=none"
    )
    server = client.containers.run(
        BASE_IMAGE, ["sh", "-c", command], detach=True, userns_mode="host", network_mode="host",
        volumes={str(root): {"bind": "/bench", "mode": "ro"},
                 str(source.parent): {"bind": "/source", "mode": "ro"}},
        labels={RUN_LABEL: RUN_ID},
    )  # fmt: skip
    try:
        time.sleep(2)
        return timed(
            ["scp", "-q", "-P", str(port), "-i", str(root / "bench_client_key"),
             "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
             "-o", f"UserKnownHostsFile={root / 'kh2'}",
             f"root@127.0.0.1:/source/{source.name}", str(target)]
        )  # fmt: skip
    finally:
        server.remove(force=True)


if __name__ == "__main__":
    sys.exit(main())
