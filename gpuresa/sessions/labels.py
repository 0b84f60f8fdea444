"""What names a session's engine objects, as plain data: names, labels and their texts.

Pure functions (no Docker, no files, no clock). A session is rebuilt from its
containers' labels alone (`session_from_labels`); the create payloads that
carry them are in `create_payloads`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath

from gpuresa.model import IdRange, Session, SessionSpec

# the labels every session container and network carries; a session is rebuilt from them
HOST_LABEL = "gpuresa.host"
KEY_LABEL = "gpuresa.reservation"
ROLE_LABEL = "gpuresa.role"
# the installation that made an object (see `identity`): never the host name alone
INSTALLATION_LABEL = "gpuresa.installation"
MAIN_ROLE = "main"
FTP_ROLE = "ftp"
NETWORK_ROLE = "network"

# where the session's host-written files (banner, motd, end, message) appear, read-only
SESSION_FILES_TARGET = PurePosixPath("/etc/gpuresa/session")


def safe_key(key: str) -> str:
    """A reservation key made fit for container names and paths, never colliding.

    Calendar UIDs hold '@', ':', '/' and more: keep up to 40 safe characters
    and add 20 hex digits (80 bits) of the key's SHA-256, so two keys never
    share a name: anyone can write a UID, and a shorter digest could be
    matched on purpose to take another booking's names and folders.
    """
    readable = re.sub(r"[^a-z0-9_.-]+", "-", key.lower()).strip("-.")[:40].strip("-.")
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:20]
    return f"{readable}-{digest}" if readable else digest


def session_name(host: str, key: str) -> str:
    """The name of a session's main container and of its network."""
    return f"gpuresa-{host}-{safe_key(key)}"


def ftp_name(host: str, key: str) -> str:
    """The name of a session's FTP sidecar."""
    return f"{session_name(host, key)}-ftp"


def format_gpus(gpus: Sequence[int]) -> str:
    return ",".join(str(index) for index in gpus)


def parse_gpus(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def utc_text(moment: datetime) -> str:
    """An instant as ISO 8601 in UTC with a Z, as labels and the container keep it."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_instant(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)


def session_labels(spec: SessionSpec, uid: int, output_dir: Path, ftp_user: str) -> dict[str, str]:
    """The labels of a session's containers and network: enough to rebuild its `Session`."""
    labels = {
        HOST_LABEL: spec.host,
        KEY_LABEL: spec.key,
        "gpuresa.user": spec.user,
        "gpuresa.uid": str(uid),
        "gpuresa.template": spec.template,
        "gpuresa.cuda": spec.cuda or "",
        "gpuresa.gpus": format_gpus(spec.gpu_indices),
        "gpuresa.ssh-port": str(spec.ssh_port),
        "gpuresa.ftp-port": str(spec.ftp_port),
        "gpuresa.ftp-passive": f"{spec.ftp_passive_first}-{spec.ftp_passive_last}",
        "gpuresa.ftp-user": ftp_user,
        "gpuresa.start": utc_text(spec.start),
        "gpuresa.end": utc_text(spec.end),
        "gpuresa.output": str(output_dir),
    }
    if spec.email:
        labels["gpuresa.email"] = spec.email
    if spec.preemptible:
        labels["gpuresa.preemptible"] = "yes"
    return labels


def session_from_labels(
    labels: Mapping[str, str],
    state: str,
    containers: tuple[str, ...],
    ftp_password: str = "",
    end: datetime | None = None,
    id_range: IdRange | None = None,
) -> Session:
    """The `Session` a container's labels describe; `end` overrides the label's.

    `id_range` is the session's host ids, which labels cannot hold (Podman
    chooses them after the labels are written).

    Raises `ValueError` (or `KeyError`) on labels that gpuresa did not write.
    """
    passive_first, passive_last = (int(part) for part in labels["gpuresa.ftp-passive"].split("-"))
    return Session(
        key=labels[KEY_LABEL],
        user=labels["gpuresa.user"],
        host=labels[HOST_LABEL],
        template=labels["gpuresa.template"],
        cuda=labels.get("gpuresa.cuda") or None,
        gpu_count=len(gpus := parse_gpus(labels.get("gpuresa.gpus", ""))),
        gpu_indices=gpus,
        start=parse_instant(labels["gpuresa.start"]),
        end=end or parse_instant(labels["gpuresa.end"]),
        ssh_port=int(labels["gpuresa.ssh-port"]),
        ftp_port=int(labels["gpuresa.ftp-port"]),
        ftp_passive_first=passive_first,
        ftp_passive_last=passive_last,
        state=state,
        output_dir=Path(labels["gpuresa.output"]),
        ftp_user=labels.get("gpuresa.ftp-user", ""),
        ftp_password=ftp_password,
        email=labels.get("gpuresa.email") or None,
        preemptible=labels.get("gpuresa.preemptible") == "yes",
        containers=containers,
        id_range=id_range,
    )
