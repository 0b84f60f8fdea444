"""Make a login's spare container of an image: run by gpuresa as the login, in a session's
cgroup.

Standalone, like launcher.py (the users' interpreter has only udocker on its
path). Arguments: the image (repository:tag) and the spare's name prefix. One
maker at a time per repository (a lock in it); a container half made by a
maker that was killed is removed by the next. The spare gets its name only once
it is whole, so a session never takes one half made.
"""

import fcntl
import os
import secrets
import subprocess
import sys

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher.py")
MAKING = "gpuresa-making-"


def udocker(*arguments: str) -> bool:
    """Run `udocker ARGUMENTS`; whether it succeeded."""
    result = subprocess.run(
        [sys.executable, "-s", LAUNCHER, *arguments],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=1800,
        check=False,
    )
    return result.returncode == 0


def main() -> int:
    image, prefix = sys.argv[1], sys.argv[2]
    repository = os.environ["UDOCKER_DIR"]
    containers = os.path.join(repository, "containers")
    with open(os.path.join(repository, ".gpuresa-spare.lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return 0  # another maker is at work
        names = os.listdir(containers) if os.path.isdir(containers) else []
        for name in names:
            if name.startswith(MAKING):
                udocker("rm", "-f", name)
        # a whole one (a name the login made by hand may point at nothing)
        if any(
            name.startswith(prefix) and os.path.isdir(os.path.join(containers, name, "ROOT"))
            for name in names
        ):
            return 0
        making = MAKING + secrets.token_hex(4)
        if (
            udocker("create", f"--name={making}", image)
            and udocker("setup", "--execmode=R1", making)
            and udocker("rename", making, prefix + secrets.token_hex(4))
        ):
            return 0
        udocker("rm", "-f", making)
        return 1


if __name__ == "__main__":
    sys.exit(main())
