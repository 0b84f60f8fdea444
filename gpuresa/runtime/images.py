"""Session images: each template variant and the FTP sidecar, built from `templates/` when missing.

The tag of an image carries a hash of its files and of its base image (name
and id), so an edited template is rebuilt and an unchanged one reused.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gpuresa.runtime.engine import Engine, EngineRefused
from gpuresa.runtime.errors import SessionError
from gpuresa.runtime.templates import (
    ACCESS_LAYER,
    FTP_DEFAULT_BASE_IMAGE,
    FTP_SIDECAR,
    context_archive,
    image_digest,
    image_tag,
    resolve_template,
    templates_directory,
)

if TYPE_CHECKING:
    from gpuresa.catalog import Template, Variant
    from gpuresa.config import TemplatesConfig

log = logging.getLogger(__name__)


class Images:
    """The images of a host's templates, on one engine."""

    def __init__(self, templates: TemplatesConfig, engine: Engine) -> None:
        self.templates = templates
        self.engine = engine
        self._lock = threading.Lock()

    def ensure_image(self, template: str, cuda: str | None) -> str:
        """The image tag of `template`'s variant `cuda` (None: its preferred one), built if missing.

        The tag carries a hash of the template's files, the access layer's
        files and the base image (name and id), so an edited template is
        rebuilt and an unchanged one reused. Raises `SessionError` for a template
        or variant the config does not allow, or a build that fails.
        """
        chosen, variant = resolve_template(self.templates, template, cuda)
        templates = self.templates
        base = templates.base_image or variant.base_image
        access = self._support_directory(ACCESS_LAYER)
        with self._lock:
            base_id = self._base_image_id(base)
            tag, digest = self._image_tag(chosen, variant, base, base_id)
            if self.engine.image_id(tag) is not None:
                return tag
            log.info("building image %s (template %s on %s)", tag, chosen.name, base)
            started = time.monotonic()
            labels = {
                "gpuresa.template": chosen.name,
                "gpuresa.cuda": variant.name,
                "gpuresa.base-image": base,
                "gpuresa.image-hash": digest,
            }
            stage = self.engine.build(
                context_archive(chosen.directory), None, {"BASE_IMAGE": base}, labels
            )
            self.engine.build(context_archive(access), tag, {"TEMPLATE_IMAGE": stage}, labels)
            log.info("built image %s in %.1f s", tag, time.monotonic() - started)
            return tag

    def image_present(self, template: str, cuda: str | None) -> bool:
        """Whether `ensure_image` would return at once: no pull, no build.

        Raises `SessionError` for a template or variant the config does not allow.
        """
        chosen, variant = resolve_template(self.templates, template, cuda)
        base = self.templates.base_image or variant.base_image
        base_id = self.engine.image_id(base)
        if base_id is None:
            return False
        tag, _ = self._image_tag(chosen, variant, base, base_id)
        return self.engine.image_id(tag) is not None

    def _image_tag(
        self, chosen: Template, variant: Variant, base: str, base_id: str
    ) -> tuple[str, str]:
        """The image tag of a template variant on `base`, and the hash it carries."""
        access = self._support_directory(ACCESS_LAYER)
        digest = image_digest([chosen.name, variant.name, base, base_id], chosen.directory, access)
        prefix = self.templates.image_prefix
        return image_tag(prefix, chosen.name, f"{variant.name}-{digest[:12]}"), digest

    def ensure_ftp_image(self) -> str:
        """The FTP sidecar's image tag, built if missing (hash of its files and base)."""
        base = self.templates.base_image or FTP_DEFAULT_BASE_IMAGE
        directory = self._support_directory(FTP_SIDECAR)
        with self._lock:
            base_id = self._base_image_id(base)
            digest = image_digest(["ftp", base, base_id], directory)
            tag = image_tag(self.templates.image_prefix, "session-ftp", digest[:12])
            if self.engine.image_id(tag) is not None:
                return tag
            log.info("building image %s (FTP sidecar on %s)", tag, base)
            self.engine.build(
                context_archive(directory),
                tag,
                {"BASE_IMAGE": base},
                {"gpuresa.base-image": base, "gpuresa.image-hash": digest},
            )
            return tag

    def _support_directory(self, name: str) -> Path:
        directory = templates_directory(self.templates) / name
        if not (directory / "Dockerfile").is_file():
            raise SessionError(
                f"{directory / 'Dockerfile'} is missing: the templates directory must hold "
                f"gpuresa's {name!r} folder next to the templates"
            )
        return directory

    def _base_image_id(self, base: str) -> str:
        image = self.engine.image_id(base)
        if image is not None:
            return image
        log.info("base image %s is not here: pulling it", base)
        try:
            return self.engine.pull(base)
        except EngineRefused as error:
            raise SessionError(
                f"base image {base} is not on this host and cannot be pulled ({error}); "
                "load it (docker load) or set templates.base_image"
            ) from None
