"""A gpuresa site on this machine's real Slurm (started by `make setup`), with real users.

Users are host accounts made for the test (useradd, names unique to the run)
and removed after it, with their jobs; the site's shared folder and output root
are under /var/tmp (the users' sshd must read them; pytest's tmp_path is root's).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import paramiko
import pytest
from conftest import run_login
from support.accounts import remove_account
from test_runtime import free_block

from gpuresa.backends.slurm import SlurmBackend
from gpuresa.config.reading import parse_config
from gpuresa.config.sections import Config
from gpuresa.model import SessionSpec

NODE = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()


def toml_text(data: dict[str, Any]) -> str:
    """`data` (tables of strings, booleans and numbers; lists of tables) as TOML."""

    def value(item: object) -> str:
        if isinstance(item, bool):
            return "true" if item else "false"
        return str(item) if isinstance(item, int) else json.dumps(item)

    lines = []
    for table, content in data.items():
        for entry in content if isinstance(content, list) else [content]:
            lines.append(f"[[{table}]]" if isinstance(content, list) else f"[{table}]")
            lines.extend(f"{key} = {value(item)}" for key, item in entry.items())
    return "\n".join(lines) + "\n"


def slurm_answers() -> None:
    """Fail the test loudly when Slurm does not answer (never skip)."""
    try:
        done = subprocess.run(["sinfo", "-h", "-n", NODE, "-o", "%t %G"], capture_output=True,
                              text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as error:
        pytest.fail(f"Slurm does not answer ({error}); run `make setup`")
    if done.returncode != 0 or "gpu:4" not in done.stdout:
        pytest.fail(f"Slurm node {NODE} is not ready: {done.stdout}{done.stderr} (`make setup`)")


@dataclass
class SlurmSite:
    """One test's cluster site: config (also written to `root`/config.toml), users and their
    keys."""

    root: Path
    shared: Path
    config: Config
    users: list[str]

    def key(self, login: str) -> paramiko.PKey:
        return paramiko.Ed25519Key.from_private_key_file(str(self.root / "private" / login))

    def backend(self) -> SlurmBackend:
        return SlurmBackend(self.config)

    def spec(self, user: str | None = None, **options: Any) -> SessionSpec:
        now = datetime.now(UTC).replace(microsecond=0)
        gpus = options.pop("gpus", 1)
        return SessionSpec(
            key=options.pop("key", f"test-{secrets.token_hex(4)}"),
            user=user or self.users[0],
            host=self.config.daemon.host,
            template="pytorch",
            cuda=None,
            gpu_count=gpus,
            gpu_indices=(),
            start=options.pop("start", now),
            end=options.pop("end", now + timedelta(hours=1)),
            ssh_port=options.pop("ssh_port", self._port()),
            ftp_port=0,
            ftp_passive_first=0,
            ftp_passive_last=0,
            place=options.pop("place", NODE),
            **options,
        )

    def _port(self) -> int:
        return free_block(1)


@contextlib.contextmanager
def slurm_site(root: Path, users: int = 2, container: str = "none") -> Iterator[SlurmSite]:
    """A site on the real cluster with `users` host accounts of its own; `container`: what
    the jobs run (the node's sshd by default: the end-to-end test runs the template's)."""
    slurm_answers()
    shared = Path("/var/tmp") / f"gpuresa-slurm-{secrets.token_hex(4)}"
    shared.mkdir(mode=0o755)
    (root / "private").mkdir(parents=True, exist_ok=True)
    (root / "keys").mkdir(exist_ok=True)
    logins = [f"{run_login('gs')}{index}" for index in range(users)]
    for login in logins:
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", login], check=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                        str(root / "private" / login)], check=True)  # fmt: skip
        (root / "private" / f"{login}.pub").rename(root / "keys" / f"{login}.pub")
    data = {
        "daemon": {"host": "cluster", "state_dir": str(root / "state")},
        "hosts": [{"name": "cluster", "engine": "slurm", "bind_address": "127.0.0.1"}],
        "users": {"keys_dir": str(root / "keys"), "host_authorized_keys": False},
        "storage": {"output_root": str(shared / "output")},
        "slurm": {"shared_dir": str(shared), "start_timeout": "60s", "container": container},
    }
    (root / "config.toml").write_text(toml_text(data))
    try:
        yield SlurmSite(root, shared, parse_config(data, str(root / "config.toml")), logins)
    finally:
        for login in logins:
            subprocess.run(["scancel", "--full", "-s", "KILL", "-u", login], check=False)
        for line in subprocess.run(["scontrol", "-o", "show", "reservation"],
                                   capture_output=True, text=True).stdout.splitlines():  # fmt: skip
            if any(f"Users={login}" in line for login in logins):
                name = line.split()[0].split("=", 1)[1]
                subprocess.run(["scontrol", "delete", f"ReservationName={name}"], check=False)
        for login in logins:
            for _ in range(40):
                if subprocess.run(["squeue", "-h", "-u", login], capture_output=True,
                                  text=True).stdout.strip() == "":  # fmt: skip
                    break
                subprocess.run(["sleep", "0.5"], check=False)
            remove_account(login)
        shutil.rmtree(shared, ignore_errors=True)
