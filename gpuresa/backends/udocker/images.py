"""Template images for udocker: archives built by an image engine, loaded per login.

udocker pulls from no registry here and builds nothing: an image is a saved
archive (`docker save`), either named in `[udocker] images` or built by the
image engine (`[udocker] image_engine`) from the template and saved under the
udocker folder. A session's login loads it into its own repository, as itself,
the first time one of its sessions is prepared (seconds), and its containers
are made from that copy.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from gpuresa.access import Account
from gpuresa.backends.engines.engine import Engine
from gpuresa.backends.engines.engines import engine_kind
from gpuresa.backends.engines.images import Images
from gpuresa.backends.udocker import tools
from gpuresa.config.sections import Config
from gpuresa.sessions.errors import ImageMissing, SessionError
from gpuresa.sessions.labels import safe_key
from gpuresa.sessions.templates import resolve_template

log = logging.getLogger(__name__)


class UdockerImages:
    """The image archives of a udocker folder, and their copies in logins' repositories."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.root = tools.udocker_root(config)

    def _configured(self, template: str, cuda: str | None) -> Path | None:
        images = self.config.udocker.images
        return images.get(f"{template}:{cuda}") or images.get(template)

    def _engine_images(self) -> Images:
        udocker = self.config.udocker
        if udocker.image_engine == "none":
            raise ImageMissing(
                "this host builds no images (udocker.image_engine = \"none\"): "
                "name an archive in udocker.images", "", None,
            )  # fmt: skip
        kind = engine_kind(udocker.image_engine)
        engine = Engine(None, base_url=udocker.image_engine_socket or kind.default_socket)
        return Images(self.config.templates, engine, self.config.daemon.host)

    def _saved(self, name: str) -> Path:
        return self.root / "images" / f"{safe_key(name)}.tar"

    def archive(self, template: str, cuda: str | None) -> tuple[Path, str] | None:
        """The image archive of a template's variant and the image it holds; None when the
        image is not built yet (never builds)."""
        _, variant = resolve_template(self.config.templates, template, cuda)
        configured = self._configured(template, variant.name)
        if configured is not None:
            return (configured, tools.archive_name(configured)) if configured.exists() else None
        name = self._engine_images().present_tag(template, variant.name)
        if name is None:
            return None
        saved = self._saved(name)
        return (saved, name) if saved.exists() else None

    def present(self, template: str, cuda: str | None) -> bool:
        """Whether sessions of the template's variant can start without a build or a save."""
        try:
            return self.archive(template, cuda) is not None
        except SessionError:
            return False

    def ensure(self, template: str, cuda: str | None) -> str:
        """Build the template's image with the image engine and save its archive (minutes);
        the image's name."""
        _, variant = resolve_template(self.config.templates, template, cuda)
        configured = self._configured(template, variant.name)
        if configured is not None:
            return tools.archive_name(configured)
        images = self._engine_images()
        name = images.ensure_image(template, variant.name)
        tools.ensure_folder(self.root / "images")
        saved = self._saved(name)
        if not saved.exists():
            partial = saved.with_suffix(".part")
            images.engine.save_image(name, str(partial))
            os.chmod(partial, 0o644)
            os.replace(partial, saved)
        return name

    def load(self, key: str, account: Account, template: str, cuda: str | None) -> str:
        """Load the template's image into `account`'s repository when missing (seconds); its
        name. Raises `ImageMissing` when the image is not built yet."""
        found = self.archive(template, cuda)
        if found is None:
            raise ImageMissing(
                f"session {key}: the image of {template} is not built yet", template, cuda
            )
        archive, name = found
        tools.ensure_repository(self.config, account)
        if not tools.image_loaded(self.config, account.login, name):
            tools.run_udocker(self.config, account, ["load", "-i", str(archive)], key, 900)
            log.info("%s: image %s loaded for %s", key, name, account.login)
        return name


def make_container(config: Config, account: Account, image: str, name: str, key: str) -> None:
    """Make container `name` from `image` in `account`'s repository, as the login, in runc
    mode (unpacking takes seconds); one left half-made is removed. Raises `SessionError`."""
    tools.run_udocker(config, account, ["create", f"--name={name}", image], key, 600)
    try:
        tools.run_udocker(config, account, ["setup", "--execmode=R1", name], key)
    except BaseException:
        tools.remove_detached(config, account, name, key)
        raise


def container_exists(config: Config, account: Account, name: str) -> bool:
    """Whether container `name` is in `account`'s repository; never waits."""
    return (tools.repository(config, account.login) / "containers" / name).exists()
