"""[notify] and [telemetry]: what the daemon tells people, by e-mail and by metrics."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

from gpuresa.config.schema import Field, at_least, positive_duration


@dataclass(frozen=True)
class NotifyConfig:
    """[notify]: e-mail to users through an SMTP server."""

    enabled: bool = False
    smtp_host: str = "localhost"
    smtp_port: int = Field(25, check=at_least(1))
    security: Literal["none", "starttls", "tls"] = "none"
    ca_file: Path | None = None
    username: str | None = None
    password_file: Path | None = None
    password_credential: str | None = None
    sender: str = "gpuresa@localhost"
    admin: str | None = None
    timeout: timedelta = Field(timedelta(seconds=20), check=positive_duration)
    give_up_after: timedelta = Field(timedelta(days=3), check=positive_duration)


def _listen_address(value: str | None) -> str | None:
    if value is None:
        return None
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f'expected "address:port" such as "127.0.0.1:9464", got {value!r}'
    return None


def _percent(value: int) -> str | None:
    return None if 0 <= value <= 100 else "a percentage from 0 to 100"


@dataclass(frozen=True)
class TelemetryConfig:
    """[telemetry]: GPU sampling, use per booking, idle and unbooked GPUs, metrics, status page."""

    backend: Literal["auto", "nvml", "nvidia-smi", "none"] = "auto"
    sample_interval: timedelta = Field(timedelta(minutes=1), check=positive_duration)
    idle_threshold: int = Field(5, check=_percent)
    idle_after: timedelta = Field(timedelta(hours=2), check=positive_duration)
    idle_action: Literal["notify", "notify-admin"] = "notify"
    report_unbooked: bool = True
    recreate_lost: bool = True
    listen: str | None = Field(None, check=_listen_address)
    page_days: int = Field(3, check=at_least(1))
    job_mapping_dir: Path | None = None
