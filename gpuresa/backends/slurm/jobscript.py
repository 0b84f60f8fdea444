"""The batch script of a session's job: what runs, as the booking's user, on the node.

The script is Python (any `#!` script is a batch script to sbatch). It makes
itself the *subreaper* of everything below it, so a process a login leaves in
the background stays a descendant of the job: Slurm's process tracking (even
`proctrack/linuxproc`, which follows parent links) then signals it at a stop
and at the end. It runs the session's container when it has one (see `container`: udocker
started on the node, its first process found among the script's descendants
and written to the run folder), then the user's own sshd on the session's
port (no privilege separation: a single-user server needs none), which enters
that container for every login; it passes SIGTERM on to every descendant
and exits only when none is left, so a stop's grace is the session's, not
the script's. The warnings of `PASSED_ON` (gpuresa's `signal`, which Slurm
gives the script alone) go on to every descendant but sshd and the
container's first process and what runs it: the session goes on.

The login sees the job's GPUs: sshd hands `CUDA_VISIBLE_DEVICES`, the job's
id and the session's folders to every login (`SetEnv`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from signal import Signals
from typing import Any

# the signals the job script passes on to the session's processes (gpuresa's `signal`); any
# other sent to it would end it, and the session with it
PASSED_ON = frozenset({Signals.SIGHUP, Signals.SIGINT, Signals.SIGUSR1, Signals.SIGUSR2})

_SCRIPT = r"""#!/usr/bin/python3
# gpuresa session job (made by gpuresa; see gpuresa/backends/slurm/jobscript.py)
import ctypes, glob, json, os, signal, subprocess, sys, time

SETTINGS = json.loads(%(settings)r)
PR_SET_CHILD_SUBREAPER = 36
ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
run = SETTINGS["run_dir"]
key = os.path.join(run, "host_key")
if not os.path.exists(key):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
passed = {
    "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
    "SLURM_JOB_ID": os.environ.get("SLURM_JOB_ID", ""),
    "GPURESA_RESERVATION": os.environ.get("SLURM_JOB_RESERVATION", ""),
    "GPURESA_SESSION": SETTINGS["session_dir"],
    "GPURESA_OUTPUT": SETTINGS["output_dir"],
}
config = os.path.join(run, "sshd_config")
with open(config, "w") as out:
    out.write("\n".join([
        "Port %%d" %% SETTINGS["port"],
        "ListenAddress %%s" %% SETTINGS["bind_address"],
        "HostKey %%s" %% key,
        "AuthorizedKeysFile %%s/authorized_keys" %% SETTINGS["session_dir"],
        "AllowUsers %%s" %% SETTINGS["user"],
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        # the keys file is root's in root's folders, but the shared folder may sit in a
        # world-writable one (/var/tmp) that StrictModes would refuse
        "StrictModes no",
        "PidFile none",
        "PrintMotd no",
        "Banner %%s/banner" %% SETTINGS["session_dir"],
        "X11Forwarding no",
        # `sftp`/`scp` of the output, whatever the node's distribution puts its server: in
        # the container the enter script runs the container's
        "Subsystem sftp internal-sftp",
        "SetEnv " + " ".join("%%s=%%s" %% item for item in passed.items()),
        "",
    ]))
def parents():
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/%%s/stat" %% entry) as stat:
                    table[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return table

def descendants():
    found, parents_seen = [], {os.getpid()}
    table = parents()
    changed = True
    while changed:
        changed = False
        for pid, parent in table.items():
            if parent in parents_seen and pid not in parents_seen:
                parents_seen.add(pid)
                found.append(pid)
                changed = True
    return found

init = None
box = SETTINGS["container"]
if box:
    # the template's container (see gpuresa/backends/slurm/container.py): the node's GPUs
    # that the job may use (Slurm's device cgroup keeps it from the others) and the job's
    # own values are known here alone
    nodes = sorted(path for path in glob.glob("/dev/nvidia*") if not os.path.isdir(path))
    options = ["--device=%%s" %% path for path in nodes]
    options += ["--env=%%s=%%s" %% item for item in passed.items() if item[1]
                and not item[0].startswith("GPURESA_")]
    log = open(os.path.join(run, "container.log"), "ab")
    if "/dev/nvidiactl" in nodes:
        subprocess.run(box["nvidia"], env=box["env"], stdout=log, stderr=log, cwd="/")
    subprocess.Popen(box["head"] + options + box["tail"], env=box["env"], stdout=log,
                     stderr=log, cwd="/", start_new_session=True)
    deadline = time.monotonic() + 120
    init = None
    while init is None and time.monotonic() < deadline:
        time.sleep(0.2)
        for pid in descendants():
            try:
                with open("/proc/%%d/status" %% pid) as status:
                    fields = dict(line.split(":", 1) for line in status if ":" in line)
            except OSError:
                continue
            if (fields.get("NSpid", "").split()[-1:] == ["1"]
                    and fields.get("Uid", "").split()[:1] == [str(os.getuid())]):
                init = pid
                break
    if init is None:
        sys.exit("gpuresa: the session's container did not start (see container.log)")
    with open(os.path.join(run, "container.pid"), "w") as out:
        out.write("%%d\n" %% init)
    with open(config, "a") as out:
        out.write("ForceCommand %%s %%s %%s\n" %% (" ".join(box["enter"]), run,
                                                   SETTINGS["session_dir"]))
command = SETTINGS["command"] or ["/usr/sbin/sshd", "-D", "-e", "-f", config]
child = subprocess.Popen(command)

def on_term(number, frame):
    for pid in descendants():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

def on_warning(number, frame):
    # gpuresa's warning (`scancel --batch`: this script alone gets it) goes on to the session's
    # processes, never to sshd on its port nor to its container's first process and what runs
    # it: the session goes on
    table = parents()
    kept, pid = {child.pid}, init
    while pid in table and pid != os.getpid():
        kept.add(pid)
        pid = table[pid]
    for pid in descendants():
        if pid not in kept and catches(pid, number):
            try:
                os.kill(pid, number)
            except ProcessLookupError:
                pass

def catches(pid, number):
    # only a process with a handler gets the warning: to the others it would be the end
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (number - 1) & 1)
    except (OSError, ValueError):
        pass
    return False

signal.signal(signal.SIGTERM, on_term)
for number in SETTINGS["passed_on"]:
    signal.signal(number, on_warning)
# reap every child (orphans of logins included) until none is left
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
    except InterruptedError:
        continue
sys.exit(0)
"""


@dataclass(frozen=True)
class JobSettings:
    """What the job needs: who, where it listens, its folders, the session command."""

    user: str
    port: int
    bind_address: str
    session_dir: Path
    run_dir: Path
    output_dir: Path
    # empty: the user's own sshd (see the module)
    command: tuple[str, ...] = ()
    # the template's container to run and enter (`container.JobContainers.job_settings`)
    container: Mapping[str, Any] | None = None


def job_script(settings: JobSettings) -> str:
    """The batch script's text for `settings`."""
    data = {
        "user": settings.user,
        "port": settings.port,
        "bind_address": settings.bind_address,
        "session_dir": str(settings.session_dir),
        "run_dir": str(settings.run_dir),
        "output_dir": str(settings.output_dir),
        "command": list(settings.command),
        "container": dict(settings.container) if settings.container else None,
        "passed_on": sorted(int(number) for number in PASSED_ON),
    }
    return _SCRIPT % {"settings": json.dumps(data)}
