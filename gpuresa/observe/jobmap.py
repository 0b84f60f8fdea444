"""Job-mapping files for NVIDIA dcgm-exporter (`--hpc-job-mapping-dir`).

dcgm-exporter labels each GPU's metrics with the job ids it reads from a file
named after the GPU's index in that folder, one id per line. gpuresa writes
the reservation key of the session holding each GPU there, so Grafana
dashboards built on dcgm-exporter show whose booking a GPU serves. Each file
is replaced atomically (written aside, then renamed), so the exporter never
reads half a file; files of GPUs no session holds are emptied.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from gpuresa.model import Session


def _write_atomically(path: Path, text: str) -> None:
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_job_mapping(
    directory: Path, sessions: Iterable[Session], gpus: Iterable[int]
) -> dict[int, str]:
    """Write one file per GPU index of `gpus` holding the key of the running session on it.

    Returns what each file now holds ("" for a free GPU); a file is rewritten
    only when its content changes. Raises `OSError` when the folder cannot be
    written.
    """
    directory.mkdir(parents=True, exist_ok=True)
    holders: dict[int, list[str]] = {}
    for session in sessions:
        if session.state == "running":
            for index in session.gpu_indices:
                holders.setdefault(index, []).append(session.key)
    written = {}
    for index in sorted(set(gpus) | set(holders)):
        # a key is one line: calendar UIDs are untrusted and could hold a newline
        keys = [" ".join(key.split()) for key in sorted(holders.get(index, []))]
        text = "".join(f"{key}\n" for key in keys)
        path = directory / str(index)
        try:
            current = path.read_text()
        except OSError:
            current = None
        if current != text:
            _write_atomically(path, text)
        written[index] = text
    return written
