"""Session images: each template variant and the FTP sidecar, built from `templates/` when missing.

The tag of an image carries a hash of its files and of its base image (name
and id), so an edited template is rebuilt and an unchanged one reused.

Builds take minutes and run on the daemon's build worker (or `gpuresa
templates build`), never under a session's start: `present_tag` and
`ftp_present_tag` only look, and never wait for a build. Each image has a lock
of its own, so building one never holds up another. Every image gpuresa builds
is labelled with the host it was built for (`gpuresa.built-for`), so garbage
collection removes only this host's old images.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gpuresa.backends.engines.engine import Engine, EngineRefused
from gpuresa.sessions.errors import ImageMissing, SessionError
from gpuresa.sessions.templates import (
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
    from gpuresa.config.sections import TemplatesConfig
    from gpuresa.reservations.catalog import Template, Variant

log = logging.getLogger(__name__)

# labels of the images gpuresa builds
HASH_LABEL = "gpuresa.image-hash"
BUILT_FOR_LABEL = "gpuresa.built-for"
FTP_IMAGE_NAME = "session-ftp"


class Images:
    """The images of a host's templates, on one engine."""

    def __init__(self, templates: TemplatesConfig, engine: Engine, host: str = "") -> None:
        self.templates = templates
        self.engine = engine
        self.host = host
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    def _lock(self, name: str) -> threading.Lock:
        """The lock of one image (or one base image's pull): one build of it at a time."""
        with self._locks_lock:
            return self._locks.setdefault(name, threading.Lock())

    def _labels(self, digest: str, base: str) -> dict[str, str]:
        labels = {"gpuresa.base-image": base, HASH_LABEL: digest}
        if self.host:
            labels[BUILT_FOR_LABEL] = self.host
        return labels

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
        with self._lock(f"template {chosen.name} {variant.name}"):
            base_id = self._base_image_id(base)
            tag, digest = self._image_tag(chosen, variant, base, base_id)
            if self.engine.image_id(tag) is not None:
                return tag
            log.info("building image %s (template %s on %s)", tag, chosen.name, base)
            started = time.monotonic()
            labels = {
                "gpuresa.template": chosen.name,
                "gpuresa.cuda": variant.name,
                **self._labels(digest, base),
            }
            stage = self.engine.build(
                context_archive(chosen.directory), None, {"BASE_IMAGE": base}, labels
            )
            self.engine.build(context_archive(access), tag, {"TEMPLATE_IMAGE": stage}, labels)
            log.info("built image %s in %.1f s", tag, time.monotonic() - started)
            return tag

    def image_present(self, template: str, cuda: str | None) -> bool:
        """Whether `ensure_image` would return at once: no pull, no build, no waiting.

        Raises `SessionError` for a template or variant the config does not allow.
        """
        return self.present_tag(template, cuda) is not None

    def present_tag(self, template: str, cuda: str | None) -> str | None:
        """The tag of `template`'s variant `cuda` when its current image is here, else None.

        Never builds or pulls, and never waits for a build under way. Raises
        `SessionError` for a template or variant the config does not allow.
        """
        chosen, variant = resolve_template(self.templates, template, cuda)
        base = self.templates.base_image or variant.base_image
        base_id = self.engine.image_id(base)
        if base_id is None:
            return None
        tag, _ = self._image_tag(chosen, variant, base, base_id)
        return tag if self.engine.image_id(tag) is not None else None

    def require_image(self, template: str, cuda: str | None) -> str:
        """`present_tag`, or `ImageMissing` naming the template and variant to build."""
        tag = self.present_tag(template, cuda)
        if tag is None:
            _, variant = resolve_template(self.templates, template, cuda)
            raise ImageMissing(
                f"the image of template {template} (CUDA {variant.name}) is not built yet",
                template,
                variant.name,
            )
        return tag

    def ftp_present_tag(self) -> str | None:
        """The FTP sidecar's image tag when its current image is here, else None (never waits)."""
        base = self.templates.base_image or FTP_DEFAULT_BASE_IMAGE
        base_id = self.engine.image_id(base)
        if base_id is None:
            return None
        tag, _ = self._ftp_tag(base, base_id)
        return tag if self.engine.image_id(tag) is not None else None

    def require_ftp_image(self) -> str:
        """`ftp_present_tag`, or `ImageMissing` for the FTP sidecar."""
        tag = self.ftp_present_tag()
        if tag is None:
            raise ImageMissing("the FTP sidecar's image is not built yet")
        return tag

    def current_tags(self) -> tuple[set[str], set[tuple[str, str]]]:
        """The tags the current templates' images have, for garbage collection.

        Returns the tags (FTP sidecar included), and the (template, variant)
        pairs whose tag cannot be known because their base image is not here:
        their images are never taken for old ones.
        """
        tags: set[str] = set()
        unknown: set[tuple[str, str]] = set()
        for name in self.templates.allowed:
            try:
                chosen, _ = resolve_template(self.templates, name, None)
            except SessionError:
                continue
            for variant in chosen.variants:
                base = self.templates.base_image or variant.base_image
                base_id = self.engine.image_id(base)
                if base_id is None:
                    unknown.add((chosen.name, variant.name))
                    continue
                tags.add(self._image_tag(chosen, variant, base, base_id)[0])
        ftp_base = self.templates.base_image or FTP_DEFAULT_BASE_IMAGE
        ftp_base_id = self.engine.image_id(ftp_base)
        if ftp_base_id is None:
            unknown.add(("", ""))
        else:
            tags.add(self._ftp_tag(ftp_base, ftp_base_id)[0])
        return tags, unknown

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
        with self._lock("ftp sidecar"):
            base_id = self._base_image_id(base)
            tag, digest = self._ftp_tag(base, base_id)
            if self.engine.image_id(tag) is not None:
                return tag
            log.info("building image %s (FTP sidecar on %s)", tag, base)
            self.engine.build(
                context_archive(directory), tag, {"BASE_IMAGE": base}, self._labels(digest, base)
            )
            return tag

    def _ftp_tag(self, base: str, base_id: str) -> tuple[str, str]:
        """The FTP sidecar's image tag on `base`, and the hash it carries."""
        digest = image_digest(["ftp", base, base_id], self._support_directory(FTP_SIDECAR))
        return image_tag(self.templates.image_prefix, FTP_IMAGE_NAME, digest[:12]), digest

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
        with self._lock(f"pull {base}"):
            image = self.engine.image_id(base)
            if image is not None:
                return image  # pulled while we waited
            log.info("base image %s is not here: pulling it", base)
            return self._pull(base)

    def _pull(self, base: str) -> str:
        try:
            return self.engine.pull(base)
        except EngineRefused as error:
            raise SessionError(
                f"base image {base} is not on this host and cannot be pulled ({error}); "
                "load it (docker load) or set templates.base_image"
            ) from None
