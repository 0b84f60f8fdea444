"""Where the config file is, the secrets it names, and the documented example."""

from __future__ import annotations

import os
from pathlib import Path

from gpuresa.errors import UserError

DEFAULT_CONFIG_PATH = Path("/etc/gpuresa/config.toml")
CONFIG_ENVIRONMENT_VARIABLE = "GPURESA_CONFIG"


def config_path(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The config file to read: --config, else $GPURESA_CONFIG, else the default."""
    if explicit:
        return Path(explicit)
    from_environment = os.environ.get(CONFIG_ENVIRONMENT_VARIABLE)
    if from_environment:
        return Path(from_environment)
    return DEFAULT_CONFIG_PATH


def read_secret(
    key_path: str, file: Path | None, credential: str | None, *, required: bool = True
) -> str | None:
    """A password from a file or a systemd credential, never from the config itself.

    `credential` names a file in $CREDENTIALS_DIRECTORY (systemd's LoadCredential=).
    Returns None when neither is set and `required` is false; raises `UserError`
    naming `key_path` otherwise.
    """
    if credential:
        directory = os.environ.get("CREDENTIALS_DIRECTORY")
        if not directory:
            raise UserError(
                f"{key_path}: credential {credential!r} is configured but "
                "$CREDENTIALS_DIRECTORY is not set (use LoadCredential= in the systemd unit, "
                "or a password_file)"
            )
        file = Path(directory) / credential
    if file is None:
        if required:
            raise UserError(f"{key_path}: no password_file or password_credential is set")
        return None
    try:
        return file.read_text(encoding="utf-8").rstrip("\r\n")
    except OSError as error:
        raise UserError(f"{key_path}: cannot read secret file {file}: {error.strerror}") from None


def example_text() -> str:
    """The documented example configuration (`config.example.toml`)."""
    packaged = Path(__file__).parents[1] / "config.example.toml"
    if packaged.exists():
        return packaged.read_text(encoding="utf-8")
    return (Path(__file__).parents[2] / "config.example.toml").read_text(encoding="utf-8")
