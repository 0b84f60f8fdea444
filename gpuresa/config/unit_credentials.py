"""Which credentials systemd would give the service: the `LoadCredential=` lines of its unit.

`password_credential = "x"` is read from `$CREDENTIALS_DIRECTORY/x`, a folder
that systemd fills for the service alone from the unit's
`LoadCredential=x:/etc/gpuresa/x`. `gpuresa config validate` runs in an admin's
shell, where that variable is not set: it reads the installed unit (and its
drop-ins, as `systemctl edit` writes them) to learn where each credential
would come from, so it can say whether the file is there. systemd refuses to
start a service whose credential file is missing, so a line for a secret the
config does not use is worth reporting as well.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

UNIT_NAME = "gpuresa.service"
# systemd's unit search path for system units, highest precedence first
UNIT_DIRECTORIES = (
    Path("/etc/systemd/system"),
    Path("/run/systemd/system"),
    Path("/usr/local/lib/systemd/system"),
    Path("/usr/lib/systemd/system"),
    Path("/lib/systemd/system"),
)
# where `LoadCredential=ID` (no path, or a relative one) looks (systemd.exec(5))
CREDENTIAL_STORES = (
    Path("/etc/credstore"),
    Path("/run/credstore"),
    Path("/usr/local/lib/credstore"),
    Path("/usr/lib/credstore"),
)
_LOADING = ("LoadCredential", "LoadCredentialEncrypted")


@dataclass(frozen=True)
class CredentialSource:
    """One credential the unit loads: from a file (None: given inline by SetCredential=)."""

    file: Path | None
    line: str  # "unit-file:line-number", for messages


@dataclass(frozen=True)
class UnitCredentials:
    """The installed unit (None: not installed) and the credentials it gives, by name."""

    unit: Path | None
    sources: Mapping[str, CredentialSource] = field(default_factory=dict)


def file_problem(path: Path) -> str | None:
    """Why `path` cannot be read as a file by this process, or None.

    Opened without blocking (a FIFO must not hang the check) and closed at once.
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        return f"cannot read {path}: {error.strerror}"
    except ValueError:
        return f"{str(path)!r} is no path (it holds a NUL)"
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            return f"{path} is not a file"
    finally:
        os.close(descriptor)
    return None


def kind_problem(path: Path, is_kind: Callable[[int], bool], noun: str) -> str | None:
    """Why `path` is no `noun` (`is_kind` tests its mode), or None; never raises.

    `Path.exists()` and `is_dir()` raise when a folder above is not
    traversable: the check must say so, as the daemon's user would meet it.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return f"{path} does not exist"
    except OSError as error:
        return f"cannot reach {path}: {error.strerror}"
    except ValueError:
        return f"{str(path)!r} is no path (it holds a NUL)"
    return None if is_kind(mode) else f"{path} is not a {noun}"


def read_unit_credentials(
    directories: Sequence[Path] = UNIT_DIRECTORIES,
    stores: Sequence[Path] = CREDENTIAL_STORES,
) -> UnitCredentials:
    """The credentials of the installed `gpuresa.service`, its drop-ins applied.

    Never raises: an unreadable file counts as absent.
    """
    unit = next(
        (folder / UNIT_NAME for folder in directories if _readable(folder / UNIT_NAME)), None
    )
    if unit is None:
        return UnitCredentials(None)
    # drop-ins of every directory, by file name; a name in a higher directory hides the others
    drop_ins: dict[str, Path] = {}
    for folder in reversed(directories):
        try:
            found = sorted((folder / f"{UNIT_NAME}.d").glob("*.conf"))
        except OSError:
            continue  # a folder this user cannot read: as if absent
        for conf in found:
            drop_ins[conf.name] = conf
    sources: dict[str, CredentialSource] = {}
    for file in [unit, *(drop_ins[name] for name in sorted(drop_ins))]:
        _read_lines(file, sources, stores)
    return UnitCredentials(unit, sources)


def _readable(path: Path) -> bool:
    return file_problem(path) is None


def _read_lines(file: Path, sources: dict[str, CredentialSource], stores: Sequence[Path]) -> None:
    try:
        text = file.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return
    section = ""
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, separator, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if section != "Service" or not separator:
            continue
        where = f"{file}:{number}"
        if key in _LOADING:
            if not value:
                # an empty assignment drops what the lines before it loaded
                sources.clear()
                continue
            name, _, source = value.partition(":")
            sources[name] = CredentialSource(_source_file(name, source, stores), where)
        elif key in ("SetCredential", "SetCredentialEncrypted") and value:
            name = value.partition(":")[0]
            sources.setdefault(name, CredentialSource(None, where))


def _source_file(name: str, source: str, stores: Sequence[Path]) -> Path:
    """The file a `LoadCredential=name[:source]` line copies: an absolute path, else found in
    the credential stores (the first store when none has it, for the message)."""
    if source.startswith("/"):
        return Path(source)
    relative = source or name
    for store in stores:
        if kind_problem(store / relative, lambda mode: True, "file") is None:
            return store / relative
    return stores[0] / relative
