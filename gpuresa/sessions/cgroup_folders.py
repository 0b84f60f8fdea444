"""The cgroup folders gpuresa makes for a host's udocker sessions, as a whole.

Each session's processes live in
`/sys/fs/cgroup/<controller>/gpuresa/<host>@<installation>/<key>` (`backends.udocker.cgroups`):
the host name alone is not this installation's (two daemons on one machine may both
keep the example's `gpu1`), so the folder also carries the digest of its installation id
(`backends.engines.identity`); `@` is in no host name. What a session leaves when it never
ended cleanly (a daemon killed during its stop) is listed and removed from here by
`backends.engines.host_holds`, which must not depend on the udocker backend. Only empty
folders are ever removed: the kernel refuses to remove a cgroup a process is in, and
nothing here kills.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# the controllers a session is placed in; "devices" also where the host has it
CONTROLLERS = ("pids", "memory", "cpu", "freezer")
OPTIONAL = ("devices",)


def host_folder(host: str, installation: str) -> Path:
    """The folder of one installation's sessions on `host`, relative to each controller."""
    return Path("gpuresa") / f"{host}@{installation}"


def leftovers(base: Path, root: Path = CGROUP_ROOT) -> dict[str, bool]:
    """The cgroup folders under `base` (a `host_folder`), relative to each controller
    ("<base>/<name>", then "<base>"), each with whether a process is in it."""
    found: dict[str, bool] = {}
    for controller in (*CONTROLLERS, *OPTIONAL):
        folder = root / controller / base
        with contextlib.suppress(OSError):
            for entry in folder.iterdir():
                if entry.is_dir():
                    relative = str(base / entry.name)
                    found[relative] = found.get(relative, False) or _populated(entry)
            found.setdefault(str(base), False)
    # the sessions' folders first: their host's folder can go only after them
    return dict(sorted(found.items(), key=lambda item: -len(Path(item[0]).parts)))


def remove_folder(relative: str, root: Path = CGROUP_ROOT) -> None:
    """Remove `relative` ("<host folder>[/<name>]") from every controller; raises `OSError`
    when a folder stays (a process or a session's folder is in it). Gone counts as removed."""
    for controller in (*CONTROLLERS, *OPTIONAL):
        with contextlib.suppress(FileNotFoundError):
            (root / controller / relative).rmdir()


def _populated(folder: Path) -> bool:
    try:
        return bool((folder / "cgroup.procs").read_text().split())
    except OSError:
        return False
