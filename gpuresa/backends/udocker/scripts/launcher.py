"""udocker, as gpuresa runs it for a session: run by the user with the site's python3.

Standalone (no gpuresa import: the users' interpreter has only udocker on its
path). Before udocker hands its OCI spec to runc, the mounts named in
$GPURESA_READONLY (a JSON list of container paths) are made read-only (udocker
binds every volume read-write) and /dev/shm gets $GPURESA_SHM_SIZE; a run
without a terminal gives runc this process's own stdout and stderr and exits
with its command's status (see `_run_without_terminal`); and the image's
EXPOSE'd ports raise no complaint (see `_exposed_ports_unused`).
"""

import json
import os
import subprocess
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


def _run_without_terminal(self: RuncEngine, command: list[str]) -> int:
    """runc's exit status, its output written whole to this process's stdout and stderr.

    udocker 1.3.17 gives runc a pty, copies it out a byte at a time and stops copying as
    soon as runc has exited: whatever was still unread is lost (most of any output longer
    than a line; all but a byte or two of a short one when udocker is slow to be
    scheduled), stderr is mixed into stdout, and it returns the runc process, so that
    `udocker run` exits 1 whatever ran. Its spec says `terminal: false` here (stdout is no
    tty), so runc hands its own stdio to the container's process: run runc on ours, which
    the container writes to directly, with nothing left to copy or to lose."""
    # what udocker itself printed comes before the container's output
    sys.stdout.flush()
    sys.stderr.flush()
    status = subprocess.call(command, shell=False, close_fds=True)
    self._filebind.finish()
    return status


def _exposed_ports_unused(self: RuncEngine) -> bool:
    """No complaint about the image's EXPOSE'd ports (udocker's "this container exposes
    privileged TCP/IP ports" on every run of an image that exposes 22): in runc mode the
    container shares the host's network, and gpuresa's sessions listen on the ports gpuresa
    gives them, never on the EXPOSE'd ones, which stay in the image's metadata."""
    return True


RuncEngine._save_spec = _gpuresa_spec
RuncEngine.run_nopty = _run_without_terminal
RuncEngine._check_exposed_ports = _exposed_ports_unused
sys.argv[0] = "udocker"
sys.exit(main())
