"""The systemd unit's [Service] restrictions, read from the file and applied with the kernel's own
mechanisms, for a machine without systemd as PID 1.

`restrictions()` reads the unit (and drop-ins, merged as systemd merges them)
and refuses any directive it does not know: a new hardening line must be
emulated here, or named as one that restricts nothing, before the tests pass.
`sandboxed()` turns a command line into one that runs under them:

- a mount namespace like systemd's (`unshare --mount --propagation slave`)
  when an option that makes one is set;
- the capability bounding set, no ambient or inheritable capabilities, and
  `no_new_privs`, with util-linux's `setpriv`;
- the system call filters (RestrictAddressFamilies=, RestrictNamespaces=,
  RestrictRealtime=, LockPersonality=, SystemCallFilter=, native system
  calls only) as a seccomp filter built with libseccomp, the library systemd
  uses, loaded by this file run as a script just before it executes the command.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

UNIT = Path(__file__).parents[1] / "systemd" / "gpuresa.service"
DROP_INS = UNIT.parent / "gpuresa.service.d"

# Options that make systemd give the service a mount namespace of its own.
MOUNT_NAMESPACE_OPTIONS = frozenset(
    {
        "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateMounts",
        "ReadWritePaths", "ReadOnlyPaths", "InaccessiblePaths", "ExecPaths", "NoExecPaths",
        "TemporaryFileSystem", "BindPaths", "BindReadOnlyPaths", "ProtectKernelTunables",
        "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups", "ProtectProc",
        "ProcSubset", "ProtectHostname", "RootDirectory", "RootImage", "MountFlags",
        "PrivateIPC", "PrivateNetwork",
    }
)  # fmt: skip
# What a [Service] line may say that restricts nothing the daemon does at run time.
NOT_RESTRICTIONS = frozenset(
    {
        "Type", "NotifyAccess", "WatchdogSec", "ExecStart", "ExecReload", "Restart",
        "RestartSec", "KillMode", "TimeoutStopSec", "SyslogIdentifier", "StateDirectory",
        "ConfigurationDirectory", "Environment", "LoadCredential", "User",
    }
)  # fmt: skip
EMULATED = frozenset(
    {
        "CapabilityBoundingSet", "AmbientCapabilities", "NoNewPrivileges",
        "RestrictAddressFamilies", "RestrictNamespaces", "RestrictRealtime", "LockPersonality",
        "SystemCallArchitectures", "SystemCallFilter", "SystemCallErrorNumber",
    }
)  # fmt: skip
# directives whose lines add up (an empty line resets); the others: the last line wins
LISTS = frozenset(
    {"CapabilityBoundingSet", "AmbientCapabilities", "RestrictAddressFamilies",
     "SystemCallFilter", "LoadCredential", "Environment"}
)  # fmt: skip

# systemd's groups (src/shared/seccomp-util.c) that the unit names
SYSCALL_GROUPS = {
    "@clock": ["adjtimex", "clock_adjtime", "clock_adjtime64", "clock_settime",
               "clock_settime64", "settimeofday"],
    "@cpu-emulation": ["modify_ldt", "subpage_prot", "switch_endian", "vm86", "vm86old"],
    "@module": ["delete_module", "finit_module", "init_module"],
    "@raw-io": ["ioperm", "iopl", "pciconfig_iobase", "pciconfig_read", "pciconfig_write",
                "s390_pci_mmio_read", "s390_pci_mmio_write"],
    "@reboot": ["kexec_file_load", "kexec_load", "reboot"],
    "@swap": ["swapoff", "swapon"],
}  # fmt: skip
FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16, "AF_PACKET": 17}
CLONE_NEW = {
    "mnt": 0x00020000, "cgroup": 0x02000000, "uts": 0x04000000, "ipc": 0x08000000,
    "user": 0x10000000, "pid": 0x20000000, "net": 0x40000000,
}  # fmt: skip
REALTIME_POLICIES = (1, 2, 6)  # SCHED_FIFO, SCHED_RR, SCHED_DEADLINE


def unit_directives(text: str) -> dict[str, dict[str, list[str]]]:
    """The unit's sections → directive → values, as systemd reads them (repeats kept).

    configparser cannot read units: a directive may repeat (LoadCredential=).
    """
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"line {number}: a directive outside any section"
        assert "=" in line, f"line {number}: not a NAME=value line: {raw!r}"
        assert not line.endswith("\\"), f"line {number}: continued lines are hard to read"
        name, _, value = line.partition("=")
        current.setdefault(name.strip(), []).append(value.strip())
    return sections


def service_lines(*drop_ins: str) -> dict[str, list[str]]:
    """The unit's [Service] with drop-ins `drop_ins` (names in gpuresa.service.d) merged.

    A list directive's lines add up and an empty one resets it; any other
    directive takes its last value, as systemd merges drop-ins.
    """
    merged: dict[str, list[str]] = {}
    for text in [UNIT.read_text(), *((DROP_INS / name).read_text() for name in drop_ins)]:
        for name, values in unit_directives(text).get("Service", {}).items():
            for value in values:
                if name in LISTS:
                    merged[name] = [] if value == "" else [*merged.get(name, []), value]
                else:
                    merged[name] = [value]
    return merged


def _yes(values: list[str] | None) -> bool:
    return bool(values) and values[-1].lower() in ("yes", "true", "1", "on")  # type: ignore[index]


@dataclass(frozen=True)
class Restrictions:
    """What the unit takes away from the daemon, in the terms of the kernel."""

    capabilities: frozenset[str]
    no_new_privileges: bool
    mount_namespace: tuple[str, ...]
    address_families: frozenset[str] | None = None
    namespaces: frozenset[str] = frozenset()
    realtime: bool = True
    personality: bool = True
    native_only: bool = False
    denied_calls: tuple[str, ...] = ()
    error_number: int = errno.EPERM

    def without(self, capability: str) -> Restrictions:
        """The same, less one capability (what the unit would be without it)."""
        return replace(self, capabilities=self.capabilities - {capability})

    def with_mount_namespace(self, option: str) -> Restrictions:
        """The same, as if the unit also set `option` (one that makes a mount namespace)."""
        return replace(self, mount_namespace=(*self.mount_namespace, option))


def restrictions(*drop_ins: str) -> Restrictions:
    """The unit's restrictions, `drop_ins` merged; `ValueError` for a directive unknown here."""
    service = service_lines(*drop_ins)
    unknown = set(service) - MOUNT_NAMESPACE_OPTIONS - NOT_RESTRICTIONS - EMULATED
    if unknown:
        raise ValueError(f"no emulation of the unit's {sorted(unknown)}: add it to unit_sandbox")
    words = [word for line in service.get("CapabilityBoundingSet", []) for word in line.split()]
    if any(word.startswith("~") for word in words):
        raise ValueError("a ~ (deny) capability list is not emulated")
    ambient = [word for line in service.get("AmbientCapabilities", []) for word in line.split()]
    if ambient:
        raise ValueError("ambient capabilities are not emulated (the daemon runs as root)")
    families = [
        word for line in service.get("RestrictAddressFamilies", []) for word in line.split()
    ]
    if any(word.startswith("~") or word not in FAMILIES for word in families):
        raise ValueError(f"RestrictAddressFamilies={families} is not emulated")
    namespaces_value = (service.get("RestrictNamespaces") or ["no"])[-1]
    if namespaces_value in ("yes", "true"):
        denied_namespaces = frozenset(CLONE_NEW)
    elif namespaces_value in ("no", "false"):
        denied_namespaces = frozenset()
    elif set(namespaces_value.removeprefix("~").split()) <= set(CLONE_NEW):
        # a list of the kinds allowed, or with "~" of those denied (systemd's names)
        listed = frozenset(namespaces_value.removeprefix("~").split())
        denied_namespaces = (
            listed if namespaces_value.startswith("~") else frozenset(CLONE_NEW) - listed
        )
    else:
        raise ValueError(f"RestrictNamespaces={namespaces_value} is not emulated")
    calls: list[str] = []
    for line in service.get("SystemCallFilter", []):
        if not line.startswith("~"):
            raise ValueError("an allow-list SystemCallFilter= is not emulated")
        for word in line[1:].split():
            calls.extend(SYSCALL_GROUPS[word] if word.startswith("@") else [word])
    error_name = (service.get("SystemCallErrorNumber") or ["EPERM"])[-1]
    return Restrictions(
        capabilities=frozenset(words) if "CapabilityBoundingSet" in service else frozenset(),
        no_new_privileges=_yes(service.get("NoNewPrivileges")),
        mount_namespace=tuple(sorted(set(service) & MOUNT_NAMESPACE_OPTIONS)),
        address_families=frozenset(families) if families else None,
        namespaces=denied_namespaces,
        realtime=not _yes(service.get("RestrictRealtime")),
        personality=not _yes(service.get("LockPersonality")),
        native_only=(service.get("SystemCallArchitectures") or [""])[-1] == "native",
        denied_calls=tuple(calls),
        error_number=int(getattr(errno, error_name)),
    )


def sandboxed(limits: Restrictions, argv: list[str]) -> list[str]:
    """`argv` as it would run under `limits` (a command line for subprocess)."""
    if not limits.capabilities:
        raise ValueError("a unit without CapabilityBoundingSet= is not emulated")
    kept = ",".join("+" + name.removeprefix("CAP_").lower() for name in sorted(limits.capabilities))
    command = ["setpriv", f"--bounding-set=-all,{kept}", "--inh-caps=-all", "--ambient-caps=-all"]
    if limits.no_new_privileges:
        command.append("--no-new-privs")
    filters = {
        "families": sorted(FAMILIES[name] for name in limits.address_families)
        if limits.address_families is not None
        else None,
        "namespaces": sorted(CLONE_NEW[name] for name in limits.namespaces),
        "realtime": limits.realtime,
        "personality": limits.personality,
        "calls": list(limits.denied_calls),
        "error": limits.error_number,
    }
    command += [sys.executable, __file__, json.dumps(filters), "--", *argv]
    if limits.mount_namespace:
        # systemd makes the namespace a slave of the host's: the host's mounts come in,
        # none made inside goes out
        command = ["unshare", "--mount", "--propagation", "slave", *command]
    return command


# --- run as a script: load the seccomp filter, then execute the command ----------------------


class _ArgumentComparison(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_NE, SCMP_CMP_EQ, SCMP_CMP_GE, SCMP_CMP_MASKED_EQ = 1, 4, 5, 7


def _errno_action(number: int) -> int:
    return 0x00050000 | (number & 0xFFFF)


def load_filter(filters: dict[str, object]) -> None:
    """Load the seccomp filter `filters` (from `sandboxed`) into this process; raises OSError."""
    library = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    library.seccomp_init.restype = ctypes.c_void_p
    library.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    library.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
        ctypes.POINTER(_ArgumentComparison),
    ]  # fmt: skip
    library.seccomp_load.argtypes = [ctypes.c_void_p]
    # a filter for the native architecture only: other entry points are killed, as
    # SystemCallArchitectures=native has them
    context = library.seccomp_init(SCMP_ACT_ALLOW)

    def deny(call: str, number: int, *comparisons: tuple[int, int, int, int]) -> None:
        syscall = library.seccomp_syscall_resolve_name(call.encode())
        if syscall < 0:
            return  # not a call of this architecture
        array = (_ArgumentComparison * max(1, len(comparisons)))(
            *(_ArgumentComparison(*comparison) for comparison in comparisons)
        )
        result = library.seccomp_rule_add_array(
            context, _errno_action(number), syscall, len(comparisons), array
        )
        if result < 0:
            raise OSError(-result, f"seccomp rule for {call}: {os.strerror(-result)}")

    error = int(filters["error"])  # type: ignore[call-overload]
    for call in filters["calls"]:  # type: ignore[attr-defined]
        deny(call, error)
    families = filters["families"]
    if families is not None:
        # RestrictAddressFamilies=: socket() of any other family fails as unsupported
        for family in range(64):
            if family not in families:  # type: ignore[operator]
                deny("socket", errno.EAFNOSUPPORT, (0, SCMP_CMP_EQ, family, 0))
        deny("socket", errno.EAFNOSUPPORT, (0, SCMP_CMP_GE, 64, 0))
    namespaces = list(filters["namespaces"])  # type: ignore[call-overload]
    if namespaces:
        # RestrictNamespaces=yes: no unshare/clone with a CLONE_NEW* flag, no setns; clone3
        # (whose flags seccomp cannot read) says ENOSYS so that libc falls back to clone
        for flag in namespaces:
            deny("unshare", errno.EPERM, (0, SCMP_CMP_MASKED_EQ, flag, flag))
            deny("clone", errno.EPERM, (0, SCMP_CMP_MASKED_EQ, flag, flag))
        deny("setns", errno.EPERM)
        deny("clone3", errno.ENOSYS)
    if not filters["realtime"]:
        for policy in REALTIME_POLICIES:
            deny("sched_setscheduler", errno.EPERM, (1, SCMP_CMP_EQ, policy, 0))
    if not filters["personality"]:
        # LockPersonality=yes: systemd's rule, anything but the current one (PER_LINUX)
        deny("personality", errno.EPERM, (0, SCMP_CMP_NE, 0, 0))
    result = library.seccomp_load(context)
    if result < 0:
        raise OSError(-result, f"seccomp_load: {os.strerror(-result)}")


if __name__ == "__main__":
    spec, separator, *command = sys.argv[1:]
    assert separator == "--", sys.argv
    load_filter(json.loads(spec))
    os.execvp(command[0], command)
