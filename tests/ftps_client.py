"""An FTPS client for the tests: Debian's lftp, which resumes the control connection's
TLS session on each data connection, as the sidecars require (Python's ftplib cannot).

Each call runs one lftp process with its commands on standard input (the password
never appears in a command line); a failure raises `FtpsError` with lftp's words.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


class FtpsError(Exception):
    """lftp failed (login refused, transfer refused, no connection); says lftp's message."""


def _quoted(text: str) -> str:
    """`text` as one lftp word (double quotes; lftp reads backslash escapes in them)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass(frozen=True)
class Ftps:
    """Explicit-TLS FTP to 127.0.0.1:`port` as `user`, with passive data connections.

    `cafile`: check the server's certificate against it (its name is not checked:
    it names the host's public name); None: accept any certificate.
    """

    port: int
    user: str
    password: str
    cafile: Path | None = None
    plain: bool = False

    def run(self, *commands: str, timeout: float = 60) -> str:
        """Run lftp `commands` after logging in; their standard output. Raises `FtpsError`."""
        lftp = shutil.which("lftp")
        if lftp is None:
            raise FtpsError("lftp is missing; run `make setup`")
        if self.plain:
            tls = ["set ftp:ssl-allow false"]
        else:
            tls = [
                "set ftp:ssl-force true",
                "set ftp:ssl-protect-data true",
                "set ftp:ssl-protect-list true",
                "set ssl:check-hostname false",
            ]
            if self.cafile is None:
                tls.append("set ssl:verify-certificate false")
            else:
                tls.append(f"set ssl:ca-file {_quoted(str(self.cafile))}")
        script = [
            *tls,
            "set ftp:passive-mode true",
            # the address the server announces in PASV, as most clients use
            "set ftp:fix-pasv-address false",
            "set net:max-retries 1",
            "set net:timeout 10",
            "set net:reconnect-interval-base 1",
            "set cmd:fail-exit true",
            f"open -u {_quoted(self.user)},{_quoted(self.password)} -p {self.port} 127.0.0.1",
            *commands,
            "exit",
        ]
        result = subprocess.run(
            [lftp, "--norc"],
            input="\n".join(script) + "\n",
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise FtpsError(result.stderr.strip() or f"lftp exited with {result.returncode}")
        return result.stdout

    def login(self) -> None:
        """Log in (lftp connects lazily: `pwd` alone would not). Raises `FtpsError`."""
        self.run("cls -1")

    def download(self, name: str) -> bytes:
        with tempfile.TemporaryDirectory() as folder:
            target = Path(folder) / "download"
            self.run(f"get {_quoted(name)} -o {_quoted(str(target))}")
            return target.read_bytes()

    def upload(self, name: str, data: bytes) -> None:
        with tempfile.TemporaryDirectory() as folder:
            source = Path(folder) / "upload"
            source.write_bytes(data)
            self.run(f"put {_quoted(str(source))} -o {_quoted(name)}")

    def names(self, folder: str = ".") -> list[str]:
        """The names in `folder` (NLST)."""
        return sorted(self.run(f"cd {_quoted(folder)}", "cls -1").split())
