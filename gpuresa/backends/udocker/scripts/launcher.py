"""udocker, as gpuresa runs it for a session: run by the user with the site's python3.

Standalone (no gpuresa import: the users' interpreter has only udocker on its
path). Before udocker hands its OCI spec to runc, the mounts named in
$GPURESA_READONLY (a JSON list of container paths) are made read-only (udocker
binds every volume read-write) and /dev/shm gets $GPURESA_SHM_SIZE; and a run
without a terminal exits with its command's status (see `_exit_status`).
"""

import json
import os
import sys

from udocker.engine.runc import RuncEngine
from udocker.maincmd import main

READONLY = set(json.loads(os.environ.pop("GPURESA_READONLY", "[]")))
SHM_SIZE = os.environ.pop("GPURESA_SHM_SIZE", "")
_save_spec = RuncEngine._save_spec


def _gpuresa_spec(self: RuncEngine) -> object:
    for mount in self._container_specjson.get("mounts", []):
        options = [option for option in mount.get("options", []) if option not in ("rw", "ro")]
        if mount.get("destination") in READONLY:
            mount["options"] = [*options, "ro"]
        elif mount.get("destination") == "/dev/shm" and SHM_SIZE:
            mount["options"] = [o for o in options if not o.startswith("size=")] + [
                f"size={SHM_SIZE}"
            ]
    return _save_spec(self)


RuncEngine._save_spec = _gpuresa_spec
_run_nopty = RuncEngine.run_nopty


def _exit_status(self: RuncEngine, command: list[str]) -> int:
    """udocker 1.3.17 returns the runc process itself without a terminal, so `udocker run`
    exits 1 whatever ran: return its exit status instead."""
    process = _run_nopty(self, command)
    if process.returncode is None:
        process.wait()
    return int(process.returncode)


RuncEngine.run_nopty = _exit_status
sys.argv[0] = "udocker"
sys.exit(main())
