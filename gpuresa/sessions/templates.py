"""Session templates on disk: their metadata, the allowlist, and what their images hash to.

A template is `<templates directory>/<name>/` with a `Dockerfile` and a
`template.toml`:

    description = "PyTorch with CUDA"
    command = ["..."]                 # optional: run in the background as the user
    [variants."12.4"]                 # one table per CUDA variant, preferred first
    base_image = "pytorch/pytorch:2.4.1-cuda12.4-cudnn9-runtime"

Two folders there are not templates: `access/` (the SSH/sudo layer built on top
of every template's image) and `ftp/` (the FTP sidecar's image). Nothing here
talks to Docker: the runtime builds what these functions describe. The
metadata is read by `gpuresa.reservations.catalog` (also the bookings' validation view);
this module adds the allowlist check, the image hash and the build context.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tarfile
from collections.abc import Iterable
from pathlib import Path

from gpuresa.config.sections import TemplatesConfig
from gpuresa.reservations import catalog
from gpuresa.reservations.catalog import Template, Variant
from gpuresa.sessions.errors import SessionError

METADATA_FILE = catalog.TEMPLATE_FILE
ACCESS_LAYER = "access"
FTP_SIDECAR = "ftp"
# the FTP sidecar's base when templates.base_image is not set
FTP_DEFAULT_BASE_IMAGE = "debian:bookworm-slim"
# bump when the way images are built changes, so every image is rebuilt
BUILD_RECIPE = "gpuresa-image-v1"


def templates_directory(config: TemplatesConfig) -> Path:
    """`templates.directory`, else the templates shipped next to the gpuresa package."""
    if config.directory is not None:
        return config.directory
    return catalog.SHIPPED_TEMPLATES


def read_template(directory: Path) -> Template:
    """`gpuresa.reservations.catalog.read_template`, its `TemplateError` as a `SessionError`."""
    try:
        return catalog.read_template(directory)
    except catalog.TemplateError as error:
        raise SessionError(f"template {directory.name!r}: {error}") from None


def available_templates(config: TemplatesConfig) -> list[Template]:
    """Every template in the templates directory (allowed or not), sorted by name."""
    root = templates_directory(config)
    if not root.is_dir():
        raise SessionError(f"the templates directory {root} does not exist (templates.directory)")
    return [
        read_template(entry)
        for entry in sorted(root.iterdir())
        if entry.is_dir() and (entry / METADATA_FILE).is_file()
    ]


def resolve_template(
    config: TemplatesConfig, name: str, cuda: str | None
) -> tuple[Template, Variant]:
    """The template and variant a booking asked for, if the config allows them.

    Fails closed: a name that is not in `templates.allowed`, is not a plain
    template name, or has no folder raises `SessionError`; so does an unknown
    variant (None picks the preferred one). An image is never chosen any
    other way.
    """
    allowed = ", ".join(config.allowed) or "none"
    if not isinstance(name, str) or not re.fullmatch(catalog.TEMPLATE_NAME, name):
        raise SessionError(f"{name!r} is not a template name (allowed: {allowed})")
    if name not in config.allowed:
        raise SessionError(f"template {name!r} is not allowed here (allowed: {allowed})")
    directory = templates_directory(config) / name
    if not (directory / METADATA_FILE).is_file():
        raise SessionError(
            f"template {name!r} is allowed but {directory / METADATA_FILE} does not exist"
        )
    template = read_template(directory)
    try:
        return template, template.variant(cuda)
    except catalog.TemplateError as error:
        raise SessionError(str(error)) from None


def _files(directory: Path) -> Iterable[Path]:
    """Regular files below `directory`, sorted, caches left out."""
    for root, folders, files in os.walk(directory):
        folders[:] = sorted(folder for folder in folders if folder != "__pycache__")
        for file in sorted(files):
            path = Path(root) / file
            if path.is_file() and not path.is_symlink():
                yield path


def files_digest(*directories: Path) -> str:
    """A SHA-256 of the names, modes and contents of every file in `directories`."""
    digest = hashlib.sha256()
    for directory in directories:
        digest.update(f"dir {directory.name}\0".encode())
        for path in _files(directory):
            relative = path.relative_to(directory).as_posix()
            executable = os.access(path, os.X_OK)
            content = path.read_bytes()
            digest.update(f"file {relative} {int(executable)} {len(content)}\0".encode())
            digest.update(content)
    return digest.hexdigest()


def image_digest(parts: Iterable[str], *directories: Path) -> str:
    """The hash in an image's tag: the build recipe, `parts` (base image, variant…) and files."""
    digest = hashlib.sha256(BUILD_RECIPE.encode())
    for part in parts:
        digest.update(b"\0" + part.encode())
    digest.update(b"\0" + files_digest(*directories).encode())
    return digest.hexdigest()


def image_tag(prefix: str, name: str, version: str) -> str:
    """`<prefix>/<name>:<version>`, lower-cased where Docker requires it."""
    repository = f"{prefix}/{name}".lower()
    version = re.sub(r"[^A-Za-z0-9_.-]", "-", version)[:128]
    return f"{repository}:{version}"


def context_archive(directory: Path) -> bytes:
    """The build context of `directory`: a tar of its files (executable bits kept)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for path in _files(directory):
            info = tarfile.TarInfo(path.relative_to(directory).as_posix())
            content = path.read_bytes()
            info.size = len(content)
            info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
            info.mtime = 0
            archive.addfile(info, io.BytesIO(content))
    return buffer.getvalue()
